"""The DHT record of a seeder: which files of a dataset it serves.

Under :func:`seeders_key` (one key per dataset, derived from its manifest hash), each seeder stores a
:class:`SeederRecord` with its peer id as subkey and an expiration :data:`RECORD_TTL` ahead, and
refreshes it every third of that (as ``peer.stage.records`` does), so a seeder that died vanishes
from every fetcher's view within one TTL.

A record names the files it holds as a bitmap over the manifest's sorted file names (bit ``i`` of
byte ``i // 8``, lowest bit first): 256 paths of 4 shard files fit in 128 bytes, where a list of names
would not fit a DHT value. Readers validate every record (STYLE item 8): a subkey that is not a peer
id, a missing field, a file count that is not the manifest's or a bitmap of the wrong
length is ignored with a log line. A record is only a claim: every chunk is still checked against
the manifest on arrival (:mod:`peer.datasync.fetcher`). Seeder records carry no admission
credential: they are not the run's keys, and a seeder that lies only wastes a fetcher's request.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

from peer.network import is_peer_id, stamped, version_problem

__all__ = ["SeederRecord", "seeders_key", "parse_seeder_record", "seeders_from_value", "seeder_value",
           "RECORD_TTL", "MAX_FILES"]

log = logging.getLogger(__name__)

RECORD_TTL = 60.0
"""Seconds a seeder record lives on the DHT unless refreshed (every third of it)."""
MAX_FILES = 1 << 17
"""The most files a dataset may have for its seeders' bitmaps to be accepted."""
_HASH_RE = re.compile(r"^[0-9a-f]{16,64}$")


def seeders_key(manifest_hash: str) -> str:
    """DHT key listing the seeders of one dataset: ``data_{manifest_hash}_seeders``."""
    if not _HASH_RE.match(manifest_hash):
        raise ValueError(f"manifest hash {manifest_hash!r} is not 16-64 lowercase hex digits")
    return f"data_{manifest_hash}_seeders"


@dataclass(frozen=True)
class SeederRecord:
    """What a seeder holds of one dataset."""

    files: int
    """How many files the manifest names (the bitmap covers exactly these)."""
    have: bytes
    """Bitmap over the manifest's sorted file names: set bits are files this seeder serves whole."""

    @classmethod
    def of(cls, names: Sequence[str], held: set[str]) -> "SeederRecord":
        """The record of a seeder holding ``held`` among the manifest's sorted ``names``."""
        bits = bytearray((len(names) + 7) // 8)
        for i, name in enumerate(names):
            if name in held:
                bits[i // 8] |= 1 << (i % 8)
        return cls(len(names), bytes(bits))

    def holds(self, names: Sequence[str]) -> set[str]:
        """The files of ``names`` (the manifest's sorted file names) this record says it holds."""
        if len(names) != self.files:
            return set()
        return {name for i, name in enumerate(names) if self.have[i // 8] >> (i % 8) & 1}


def _problem(subkey: Any, value: Any) -> str:
    if not is_peer_id(subkey):
        return "subkey is not a peer id"
    if not isinstance(value, Mapping):
        return f"value is a {type(value).__name__}, not a table"
    names = {f.name for f in dataclasses.fields(SeederRecord)}
    problem = version_problem("SeederRecord", subkey, value, names)  # a later minor's fields: counted
    if problem:
        return problem
    missing = sorted(names - set(value))
    if missing:
        return f"missing {missing}"
    files, have = value["files"], value["have"]
    if isinstance(files, bool) or not isinstance(files, int) or not 0 <= files <= MAX_FILES:
        return f"files={files!r} is not an integer in [0, {MAX_FILES}]"
    if not isinstance(have, bytes) or len(have) != (files + 7) // 8:
        return f"have is not a bitmap of {(files + 7) // 8} bytes"
    return ""


def parse_seeder_record(subkey: Any, value: Any) -> Optional[SeederRecord]:
    """Validate one DHT entry under :func:`seeders_key`; None (and a log line) if invalid."""
    problem = _problem(subkey, value)
    if problem:
        if problem.startswith("dht protocol"):  # another major: version_problem said so once per writer
            return None
        log.warning("ignoring invalid seeder record from %r: %s", subkey, problem)
        return None
    return SeederRecord(int(value["files"]), bytes(value["have"]))


def seeders_from_value(found: Any) -> dict[str, SeederRecord]:
    """Parse a DHT get of :func:`seeders_key` into valid records by peer id."""
    if found is None:
        return {}
    entries = getattr(found, "value", None)
    if not isinstance(entries, dict):
        log.warning("ignoring a seeders entry that is not a dictionary of subkeys")
        return {}
    out = {}
    for subkey, item in entries.items():
        record = parse_seeder_record(subkey, getattr(item, "value", None))
        if record is not None:
            out[subkey] = record
    return out


def seeder_value(record: SeederRecord) -> dict[str, Any]:
    """The dict stored in the DHT for a record, with our DHT protocol version (``peer.network.records``)."""
    return stamped(record, dataclasses.asdict(record))
