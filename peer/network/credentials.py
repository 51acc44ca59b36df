"""The peer's side of admission credentials: carrying our own and checking everyone else's.

The coordinator signs each admitted peer a credential bound to its libp2p peer id (byte format and
signature check: :mod:`protos.credential`); the public key comes in the RunSpec. A peer presents
its credential in its DHT records (:class:`peer.network.records.HolderRecord`,
:class:`peer.network.records.GroupDeclaration`), in matchmaking join requests and in state-transfer
requests; the receiver checks it against the *libp2p sender* (authenticated by the transport's
handshake), so a copied credential is useless on a P2P stream. Records whose credential does not
check out are ignored where they are read (see :func:`peer.network.records.records_from_value`).

Wiring (peer/node/): after ``CoordinatorClient.join()``, build
``CredentialVerifier(run_id, join.coordinator_public_key)`` and pass it with
``credential=lambda: client.credential`` (heartbeats renew it) to :class:`peer.averaging.matchmaking.Matchmaker`,
:class:`peer.averaging.state_transfer.StateServer` and :func:`peer.averaging.state_transfer.fetch_module_state`, and
write ``credential=client.credential`` into the records the peer stores.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from typing import Callable, Optional

from protos.credential import PUBLIC_KEY_BYTES, Credential, CredentialError, decode_credential, verify_credential

__all__ = ["CredentialProvider", "CredentialVerifier"]

log = logging.getLogger(__name__)

CredentialProvider = Callable[[], bytes]
"""Returns this peer's current credential bytes (e.g. ``lambda: client.credential``)."""

_CACHE = 4096
_LOGGED = 4096


class CredentialVerifier:
    """Checks other peers' credentials for one run against the coordinator's public key.

    A verified signature is cached per credential (a few hundred microseconds saved on every DHT
    poll); expiry and the peer-id binding are checked on every call. Thread-safe."""

    def __init__(self, run_id: str, coordinator_public_key: bytes, clock: Callable[[], float] = time.time):
        if len(coordinator_public_key) != PUBLIC_KEY_BYTES:
            raise ValueError(f"the coordinator's public key must be {PUBLIC_KEY_BYTES} raw bytes, "
                             f"got {len(coordinator_public_key)}; is the coordinator older than the peer?")
        self.run_id = run_id
        self.public_key = bytes(coordinator_public_key)
        self.clock = clock
        self._good: OrderedDict[bytes, Credential] = OrderedDict()
        self._logged: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._lock = threading.Lock()

    def check(self, blob: bytes, sender_peer_id: str) -> str:
        """``""`` when ``blob`` admits ``sender_peer_id`` to this run now; else why not."""
        if not blob:
            return "no credential (not admitted by the coordinator)"
        if not isinstance(blob, (bytes, bytearray)):
            return f"credential is a {type(blob).__name__}, not bytes"
        blob = bytes(blob)
        now = self.clock()
        with self._lock:
            cached = self._good.get(blob)
        if cached is not None:
            if cached.peer_id != sender_peer_id:
                return f"credential belongs to {cached.peer_id}, not to the sender {sender_peer_id}"
            if not cached.expires_at > now:
                return f"credential expired {now - cached.expires_at:.0f}s ago"
            return ""
        cred, problem = verify_credential(blob, self.public_key, self.run_id, sender_peer_id, now)
        if cred is not None:
            with self._lock:
                self._good[blob] = cred
                if len(self._good) > _CACHE:
                    self._good.popitem(last=False)
        return problem

    def admits(self, blob: bytes, sender_peer_id: str, what: str) -> bool:
        """:meth:`check`, logging a refusal once per (peer, reason): "refusing <what> from <peer>: why"."""
        problem = self.check(blob, sender_peer_id)
        if problem:
            self.log_refusal(sender_peer_id, what, problem)
        return not problem

    def log_refusal(self, peer_id: str, what: str, problem: str) -> None:
        key = (peer_id, problem)
        with self._lock:
            if key in self._logged:
                return
            self._logged[key] = None
            if len(self._logged) > _LOGGED:
                self._logged.popitem(last=False)
        log.warning("refusing %s from %s: %s", what, peer_id, problem)

    @staticmethod
    def expiry_of(blob: bytes) -> Optional[float]:
        """When our own credential expires (None if it does not parse), for status lines."""
        try:
            return decode_credential(blob).expires_at
        except CredentialError:
            return None
