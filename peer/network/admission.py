"""The DHT itself refuses records of unadmitted peers (admission).

Readers already drop records without a valid credential (:func:`peer.network.records.records_from_value`);
this validator makes every DHT node refuse to *store* them, so an outsider cannot fill the run's
keys with junk that every reader must fetch and discard. hivemind runs a node's validators on every
record another node asks it to store, on its own stores, and on records returned to its lookups
(``hivemind.dht.validation.RecordValidatorBase``).

Which records are checked (keys are hashed in the DHT, so they are recognised by their hashes or by
their shape):

- under a module's holders or archive key (:func:`peer.network.records.holders_key`,
  :func:`peer.network.records.archive_key`, every module of the lattice): every record;
- under any key: a record whose value has the required fields of a
  :class:`peer.network.records.GroupDeclaration` (group keys carry round numbers, so they are not listed),
  whatever other fields it carries: readers read a declaration with fields they do not know (the
  version field, a later minor's), so every value a reader would take for a declaration is checked;
  or a :func:`peer.network.records.withdrawal` (which replaces a peer's record: only that peer may).

Such a record is stored only if its subkey is a peer id and its value carries a credential
(:mod:`protos.credential`) that the coordinator signed for that peer id, for this run, unexpired.
Stage-server records (:mod:`peer.stage.records`) carry no credential and are only checked where read.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Iterable, Optional

from hivemind.dht.validation import DHTRecord, RecordValidatorBase

from peer.network.records import GroupDeclaration, archive_key, holders_key, is_peer_id, is_withdrawal

__all__ = ["AdmissionValidator"]

log = logging.getLogger(__name__)

_DECLARATION_REQUIRED = frozenset(f.name for f in dataclasses.fields(GroupDeclaration)
                                  if f.default is dataclasses.MISSING)


class AdmissionValidator(RecordValidatorBase):
    """Refuse the run's records that lack a valid credential for their writer (see module docstring).

    Picklable: it is built in the peer's process and runs inside the DHT's process, where it makes
    its own :class:`peer.network.credentials.CredentialVerifier`."""

    def __init__(self, run_id: str, coordinator_public_key: bytes, module_ids: Iterable[str]):
        from hivemind.dht.routing import DHTID

        self.run_id = run_id
        self.public_key = bytes(coordinator_public_key)
        keys = [k(run_id, m) for m in module_ids for k in (holders_key, archive_key)]
        self.key_ids = frozenset(DHTID.generate(source=k).to_bytes() for k in keys)
        self._verifier: Optional[Any] = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_verifier": None}

    def _verify(self, credential: Any, peer_id: str) -> str:
        if self._verifier is None:
            from peer.network.credentials import CredentialVerifier

            self._verifier = CredentialVerifier(self.run_id, self.public_key)
        return self._verifier.check(credential, peer_id)

    def validate(self, record: DHTRecord) -> bool:
        from hivemind.utils.serializer import MSGPackSerializer

        listed = record.key in self.key_ids
        try:
            value = MSGPackSerializer.loads(record.value)
        except Exception:
            return not listed
        # No upper bound on the fields: a value with one unknown field more is still read as a declaration.
        declaration = isinstance(value, dict) and _DECLARATION_REQUIRED <= set(value)
        if not listed and not declaration and not is_withdrawal(value):
            return True  # not one of the run's credentialed records
        try:
            subkey = MSGPackSerializer.loads(record.subkey) if record.subkey else None
        except Exception:
            subkey = None
        if not is_peer_id(subkey) or not isinstance(value, dict):
            log.info("DHT: refusing a record without a peer-id subkey under a credentialed key")
            return False
        problem = self._verify(value.get("credential", b""), subkey)
        if problem:
            self._verifier.log_refusal(subkey, "a DHT record", problem)
            return False
        return True

    @property
    def priority(self) -> int:
        return 5

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return False
