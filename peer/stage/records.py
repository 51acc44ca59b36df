"""Strict DHT records of stage servers (stage mode, SWARM parallelism, Ryabinin et al. 2023).

A stage server announces, under :func:`stage_servers_key` and with its peer id as subkey, a
:class:`StageServerRecord`: which module it serves, under which run config hash, its measured
throughput and its queue length. The record's DHT expiration is its expiry: a server refreshes it
every third of its time to live, so a dead server vanishes from every trainer's view within one TTL.

Every record is validated where it is read (STYLE item 8): a missing field, a wrong type, a
non-finite or negative number, a module id that is not the key's module, or a subkey that is not a
peer id makes the record ignored, with a log line. The numbers are still only what the server
claims; :mod:`peer.stage.client` prefers its own measurements once it has any.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from models.config import is_module_id
from peer.network import is_peer_id, stamped, version_problem

__all__ = [
    "StageServerRecord",
    "StageServerEntry",
    "stage_servers_key",
    "parse_stage_record",
    "stage_records_from_value",
    "stage_record_value",
    "MAX_QUEUE",
    "MAX_THROUGHPUT",
]

log = logging.getLogger(__name__)

MAX_QUEUE = 1_000_000
"""Largest queue length a valid record may claim."""
MAX_THROUGHPUT = 1e12
"""Largest throughput (tokens/s) a valid record may claim."""

_RUN_ID_CHARS = set("abcdefghijklmnopqrstuvwxyz0123456789-")
_HEX = set("0123456789abcdef")


def stage_servers_key(run_id: str, module_id: str) -> str:
    """DHT key listing the stage servers of one module: ``{run_id}_{module_id}_stages``."""
    if not run_id or len(run_id) > 40 or not set(run_id) <= _RUN_ID_CHARS or run_id[0] == "-":
        raise ValueError(f"run id {run_id!r} must be 1-40 lowercase letters, digits or '-'")
    if not is_module_id(module_id):
        raise ValueError(f"{module_id!r} is not a module id")
    return f"{run_id}_{module_id}_stages"


@dataclass(frozen=True)
class StageServerRecord:
    """What a stage server says about itself."""

    module_id: str
    """The module it serves (must match the key's module)."""
    config_hash: str
    """Run config hash of the server; trainers use only servers of their own hash."""
    throughput: float
    """Measured tokens/s through the module (forward plus backward)."""
    queue_length: int
    """Requests waiting or running on the server when the record was written."""


@dataclass(frozen=True)
class StageServerEntry:
    """A valid record as read from the DHT, with who wrote it and when it expires."""

    peer_id: str
    record: StageServerRecord
    expires: float
    """DHT time (``hivemind.utils.get_dht_time``) at which the record expires."""


def _problem(module_id: str, subkey: Any, value: Any) -> str:
    if not is_peer_id(subkey):
        return "subkey is not a peer id"
    if not isinstance(value, Mapping):
        return f"value is a {type(value).__name__}, not a table"
    names = {f.name for f in dataclasses.fields(StageServerRecord)}
    problem = version_problem("StageServerRecord", subkey, value, names)  # a later minor's fields: counted
    if problem:
        return problem
    missing = sorted(names - set(value))
    if missing:
        return f"missing {missing}"
    mid, h, tps, queue = value["module_id"], value["config_hash"], value["throughput"], value["queue_length"]
    if mid != module_id:
        return f"module_id={mid!r} is not the key's module {module_id!r}"
    if not isinstance(h, str) or not 1 <= len(h) <= 64 or not set(h) <= _HEX:
        return f"config_hash={h!r} is not a hex hash"
    if isinstance(tps, bool) or not isinstance(tps, (int, float)) or not math.isfinite(tps) or not 0 <= tps <= MAX_THROUGHPUT:
        return f"throughput={tps!r} is not a finite number in [0, {MAX_THROUGHPUT:g}]"
    if isinstance(queue, bool) or not isinstance(queue, int) or not 0 <= queue <= MAX_QUEUE:
        return f"queue_length={queue!r} is not an integer in [0, {MAX_QUEUE}]"
    return ""


def parse_stage_record(module_id: str, subkey: Any, value: Any) -> Optional[StageServerRecord]:
    """Validate one DHT entry under ``module_id``'s key; None (and a log line) if invalid."""
    problem = _problem(module_id, subkey, value)
    if problem:
        if problem.startswith("dht protocol"):  # another major: version_problem said so once per writer
            return None
        log.warning("ignoring invalid stage server record from %r: %s", subkey, problem)
        return None
    return StageServerRecord(value["module_id"], value["config_hash"], float(value["throughput"]),
                             int(value["queue_length"]))


def stage_records_from_value(module_id: str, found: Any) -> dict[str, StageServerEntry]:
    """Parse a DHT get of :func:`stage_servers_key` into valid entries by peer id."""
    if found is None:
        return {}
    entries = getattr(found, "value", None)
    if not isinstance(entries, dict):
        log.warning("ignoring stage server entry of %s that is not a dictionary of subkeys", module_id)
        return {}
    out: dict[str, StageServerEntry] = {}
    for subkey, item in entries.items():
        record = parse_stage_record(module_id, subkey, getattr(item, "value", None))
        expires = getattr(item, "expiration_time", None)
        if record is not None and isinstance(expires, (int, float)) and math.isfinite(expires):
            out[subkey] = StageServerEntry(subkey, record, float(expires))
    return out


def stage_record_value(record: StageServerRecord) -> dict[str, Any]:
    """The dict stored in the DHT for a record, with our DHT protocol version (``peer.network.records``)."""
    return stamped(record, dataclasses.asdict(record))
