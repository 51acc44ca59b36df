"""Strict schemas for everything a peer writes to the DHT, and one key builder per record type.

Keys follow ``{run_id}_{module_id}_...`` (hivemind forbids dots in key prefixes). Values are plain
dicts of primitive types (msgpack on the wire). Every record is validated where it is read: a record
with a missing field, a wrong type, a non-finite or negative number, or a malformed hash or peer id is
ignored and logged -- never trust a number another peer reported (STYLE item 8).

Versions (:mod:`protos.versions`, contract ``dht``): every record carries the writer's DHT protocol
version under :data:`VERSION_FIELD` (``"v": "1.1"``; a record without one is 1.0, a release that stated
none). A record of another major is ignored, with one log line per writer naming both versions; a
field a reader does not know (a later minor's) is ignored and counted
(:data:`protos.versions.UNKNOWN_FIELDS`), and the record is read.

Admission: holder records, group declarations and archive records carry the writer's credential
(:mod:`peer.network.credentials`); given a :class:`~peer.network.credentials.CredentialVerifier`,
:func:`records_from_value` drops every record whose credential is missing, forged, expired, for
another run or bound to a peer id other than the record's subkey.

Record types:

- :class:`HolderRecord` under :func:`holders_key`: "I hold this module, I am at round R, this is my
  throughput and upload bandwidth". Subkey: the holder's peer id.
- :class:`GroupDeclaration` under :func:`group_key`: "I want to average this module's round R now".
  Subkey: the declaring peer id. Matchmaking reads these to pick the group's leader.
- :class:`ArchiveRecord` under :func:`archive_key`: "I keep this module's state at round R and serve
  it" (an archive peer: it serves newcomers but never averages). Subkey: the archive's peer id.

A peer that stops holding a module (a drain, a leave, a reassignment) overwrites its record under any
of these keys with a :func:`withdrawal` (``{"withdrawn": true, "credential": ..., "round": R}`` and the
config and dataset hashes of that round, stored with a later expiration so it replaces the record at
once): readers drop it as a record, so the others stop waiting for the peer now instead of when its
record would have expired. The round it left at stays readable (:func:`withdrawn_rounds`) until the
withdrawal expires: a holder still at an earlier round learns that the module moved on without it,
and re-syncs instead of stepping alone into a second state at the round the leaver already applied.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, TypeVar

from models.config import is_module_id
from protos import versions
from protos.credential import MAX_CREDENTIAL_BYTES

if TYPE_CHECKING:
    from peer.network.credentials import CredentialVerifier

__all__ = [
    "OwnExpirations",
    "refresh_until",
    "HolderRecord",
    "GroupDeclaration",
    "ArchiveRecord",
    "holders_key",
    "archive_key",
    "group_key",
    "group_buckets",
    "split_levels",
    "level_group_key",
    "group_bucket",
    "top_group_key",
    "parse_record",
    "read_records",
    "is_peer_id",
    "records_from_value",
    "to_value",
    "withdrawal",
    "is_withdrawal",
    "withdrawn_rounds",
    "WITHDRAWN",
    "VERSION_FIELD",
    "version_problem",
    "stamped",
    "is_wire_key",
]

log = logging.getLogger(__name__)

_HASH_RE = re.compile(r"^[0-9a-f]{0,64}$")
_PEER_ID_RE = re.compile(r"^[1-9A-HJ-NP-Za-km-z]{20,80}$")  # base58btc
_RUN_ID_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,39}$")
_MAX_ROUND = 2**53
MAX_EXPECTING = 256
"""Most peer ids a declaration may list as expected (a bound on what a reader waits for)."""
VERSION_FIELD = "v"
"""The field of every record that states its writer's DHT protocol version."""
_WIRE_RE = re.compile(r"^[0-9a-z.+-]{0,32}$")
_told_versions: set[tuple[str, str, str]] = set()


def is_wire_key(text: Any) -> bool:
    """True for an averaging bytes key (:func:`peer.averaging.wire_key`): '' or up to 32 of ``0-9a-z.+-``."""
    return isinstance(text, str) and bool(_WIRE_RE.match(text))


def version_problem(kind: str, subkey: Any, value: Mapping, known: set[str]) -> str:
    """What makes ``value`` (a record of type ``kind`` from ``subkey``) unreadable by version: a
    malformed version, or another major than ours (said once per writer and version, naming both).
    Fields outside ``known`` (and the version field) are a later minor's: counted, never a problem."""
    theirs = value.get(VERSION_FIELD, "")
    why = versions.refusal("dht", theirs, who=f"{kind} record from {str(subkey)[-8:]}", us="this peer")
    if why:
        told = (kind, str(subkey), str(theirs))
        if told not in _told_versions and len(_told_versions) < 4096:
            _told_versions.add(told)
            log.warning("ignoring it: %s", why)
        return why
    versions.UNKNOWN_FIELDS.count(kind, sorted(set(value) - known - {VERSION_FIELD}))
    return ""


def is_peer_id(text: Any) -> bool:
    """True for a base58 libp2p peer id."""
    return isinstance(text, str) and bool(_PEER_ID_RE.match(text))


def _check_key_parts(run_id: str, module_id: str) -> None:
    if not _RUN_ID_RE.match(run_id):
        raise ValueError(f"run id {run_id!r} must be 1-40 lowercase letters, digits or '-'")
    if not is_module_id(module_id):
        raise ValueError(f"{module_id!r} is not a module id")


def holders_key(run_id: str, module_id: str) -> str:
    """DHT key listing the live holders of one module: ``{run_id}_{module_id}_holders``."""
    _check_key_parts(run_id, module_id)
    return f"{run_id}_{module_id}_holders"


def archive_key(run_id: str, module_id: str) -> str:
    """DHT key listing the archive peers that serve one module's state: ``{run_id}_{module_id}_archive``."""
    _check_key_parts(run_id, module_id)
    return f"{run_id}_{module_id}_archive"


def group_key(run_id: str, module_id: str, round_no: int, bucket: Optional[int] = None) -> str:
    """DHT key where members of one averaging round declare themselves: ``{run_id}_{module_id}_r{round}_group``;
    with a ``bucket`` (a module split into several groups a round, :func:`group_bucket`),
    ``{run_id}_{module_id}_r{round}_b{bucket}_group``."""
    _check_key_parts(run_id, module_id)
    if not 0 <= round_no < _MAX_ROUND:
        raise ValueError(f"round number {round_no} out of range")
    if bucket is None:
        return f"{run_id}_{module_id}_r{round_no}_group"
    if not isinstance(bucket, int) or isinstance(bucket, bool) or not 0 <= bucket < _MAX_ROUND:
        raise ValueError(f"bucket {bucket!r} out of range")
    return f"{run_id}_{module_id}_r{round_no}_b{bucket}_group"


def top_group_key(run_id: str, module_id: str, round_no: int) -> str:
    """DHT key where the delegates of a split round's groups (one per bucket,
    :mod:`peer.averaging.hierarchy`) declare themselves: ``{run_id}_{module_id}_r{round}_top_group``."""
    _check_key_parts(run_id, module_id)
    if not 0 <= round_no < _MAX_ROUND:
        raise ValueError(f"round number {round_no} out of range")
    return f"{run_id}_{module_id}_r{round_no}_top_group"


def level_group_key(run_id: str, module_id: str, round_no: int, level: int, index: int) -> str:
    """DHT key where the delegates of a split round's groups at level ``level`` - 1 that meet in group
    ``index`` of level ``level`` (2 .. the level below the top, :func:`split_levels`) declare themselves:
    ``{run_id}_{module_id}_r{round}_l{level}_g{index}_group``."""
    _check_key_parts(run_id, module_id)
    if not 0 <= round_no < _MAX_ROUND:
        raise ValueError(f"round number {round_no} out of range")
    for name, v, least in (("level", level, 2), ("group index", index, 0)):
        if not isinstance(v, int) or isinstance(v, bool) or not least <= v < _MAX_ROUND:
            raise ValueError(f"{name} {v!r} out of range")
    return f"{run_id}_{module_id}_r{round_no}_l{level}_g{index}_group"


def split_levels(holders: int, max_group_size: int) -> tuple[int, ...]:
    """How many groups each level of a split round of ``holders`` live holders has, from the buckets
    (:func:`group_buckets`) up: ``(B1, ..., Bk)``, each a power of two, ``Bk`` <= ``max_group_size``.
    The delegates of the ``Bk`` groups of the last level form the top group; a group of level j + 1
    gathers the delegates of the groups of level j whose index is its own modulo ``B(j+1)``: at most
    ``B(j) / B(j+1)`` <= ``max_group_size`` of them. ``(1,)``: one group, no split; ``(B1,)`` with
    1 < ``B1`` <= the cap: buckets and a top group (two levels)."""
    counts = [group_buckets(holders, max_group_size)]
    while max_group_size > 0 and counts[-1] > max_group_size:
        counts.append(group_buckets(counts[-1], max_group_size))
    return tuple(counts)


def group_buckets(holders: int, max_group_size: int) -> int:
    """How many groups a module of ``holders`` live holders splits into each round so that none
    exceeds about ``max_group_size`` members: the smallest power of two >= ceil(holders / max_group_size)
    (1 when ``max_group_size`` <= 0: one group of every holder). A power of two keeps holders that
    counted slightly different numbers in agreement except near a doubling, and a holder that counted
    half as many buckets computes the union of two of the other's groups (``bucket % k``)."""
    if max_group_size <= 0 or holders <= max_group_size:
        return 1
    need = -(-int(holders) // int(max_group_size))
    return 1 << (need - 1).bit_length()


def group_bucket(module_id: str, round_no: int, peer_id: str, buckets: int) -> int:
    """The group (0 .. ``buckets`` - 1) ``peer_id`` averages ``module_id``'s round ``round_no`` in: a hash
    of the three, the same on every peer. The round is in the hash, so groups are drawn anew every
    round (a slow or undiallable member does not weigh on the same group every round, as in Moshpit
    SGD's random regrouping, Ryabinin et al. 2021); the groups' means are then averaged by a top
    group, so every holder applies the same average (:mod:`peer.averaging.hierarchy`)."""
    if buckets <= 1:
        return 0
    digest = hashlib.blake2b(f"{module_id}/{round_no}/{peer_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % buckets


@dataclass(frozen=True)
class HolderRecord:
    """A peer holds a module (trains it on its path or serves it as a stage)."""

    config_hash: str
    """Run config hash of the holder (peers of another hash are never grouped)."""
    data_hash: str
    """Dataset manifest hash of the holder ('' when the run has none)."""
    round_no: int
    """The module round the holder will average next."""
    throughput: float
    """Measured training throughput, tokens/s."""
    bandwidth: float
    """Measured upload bandwidth, bytes/s; 0 for a client-mode peer that cannot accept connections."""
    credential: bytes = b""
    """The holder's admission credential (:mod:`protos.credential` bytes)."""
    digest: str = ""
    """:func:`peer.outer.state_digest` of the state it serves to newcomers ('' until known: a holder
    announces its next round as soon as its group forms). The archive keeps a fetched state only when
    most holders announce its digest."""
    idle: bool = False
    """The holder trains nothing now (a stage server nobody drives, a trainer whose pipeline lacks a
    server): nobody waits for it to declare, nor for it to catch up; it serves its state as any holder."""
    wire: str = ""
    """The holder's averaging bytes key (:attr:`GroupDeclaration.wire`): holders of another key average
    in groups of their own, so matchmaking neither waits for them nor counts them ahead or behind."""


@dataclass(frozen=True)
class GroupDeclaration:
    """A peer is ready to average one (run, module, round) now."""

    config_hash: str
    """Run config hash of the declaring peer."""
    data_hash: str
    """Dataset manifest hash of the declaring peer."""
    bandwidth: float
    """Upload bandwidth, bytes/s (sizes its share of the reduction); 0 in client mode."""
    credential: bytes = b""
    """The declaring peer's admission credential."""
    digest: str = ""
    """:func:`peer.outer.state_digest` of the state the declaring peer will apply this round's mean
    to: only declarations of equal digest are grouped (equal round numbers do not prove equal states)."""
    expecting: tuple[str, ...] = ()
    """Peers that fetched this round's state from the declaring peer to average it (newcomers whose
    holder records may not be visible yet): every member waits for them to declare, up to its gather
    deadline, so a leader that never heard of them does not close the group without them."""
    paced: bool = False
    """The declaring peer ended this round early because another holder was waiting (pacing,
    :meth:`peer.averaging.net_averager.NetAverager.others_waiting`). Such a declaration paces nobody
    in turn: every early end traces back to a member that computed its whole round budget. Without
    this rule, two sets of holders whose module round numbers are offset by one (a newcomer that
    re-synced one module to a newer round) would end each other's rounds, each as soon as it began:
    every group complete, but rounds a fraction of their budget."""
    wire: str = ""
    """The declaring peer's averaging bytes key (:func:`peer.averaging.wire_key`): matchmaking groups only
    declarations of equal keys, whose members compute the same bytes ('' for the averaging protocol's
    first bytes, those of 1.0)."""
    result: str = ""
    """Under a split round's :func:`top_group_key` only: the :func:`peer.averaging.hierarchy.result_digest`
    of the round's average, stated by a member of the top group once its all-reduce ended ('' before).
    A bucket member takes a digest that more than half of the round's buckets' delegates state as the
    top group's, and checks the average its parent in the bucket's tree sends against it."""
    sparse: bool = False
    """The declaring peer's steps are far apart (a stage server, a pipeline trainer): it answers paced
    declarations too (:meth:`peer.averaging.net_averager.NetAverager.others_waiting`'s ``paced_too``), so
    a paced declaration of its own paces no such peer either. Without this rule, the trainers sharing
    the embedding and head would end each other's rounds a step or two apart, and begin those rounds'
    groups without the path peers, still computing theirs, which then failed them as behind."""
    formed: bool = False
    """Stated by the leader of a (whole, not split) round's group once it began the group: the round's
    group has formed. A holder of that state that declares the round later, or that leads a group of
    the declared members that did not join it, is not in that group and forms no second one: it is
    behind the group and re-syncs to the round it applies (two groups of one round would apply two
    averages under one round number, a fork that no digest shows until the lineages meet)."""


@dataclass(frozen=True)
class ArchiveRecord:
    """An archive peer keeps a module's state and serves it to newcomers (it does not average)."""

    config_hash: str
    """Run config hash of the archive."""
    data_hash: str
    """Dataset manifest hash of the archive."""
    round_no: int
    """Round number of the state it serves."""
    credential: bytes = b""
    """The archive's admission credential."""


R = TypeVar("R", HolderRecord, GroupDeclaration, ArchiveRecord)


def parse_record(cls: type[R], subkey: Any, value: Any) -> Optional[R]:
    """Validate one DHT entry as a ``cls`` record written by peer ``subkey``; None (and a log line) if invalid."""
    problem = _problem(cls, subkey, value)
    if problem:
        if problem != _OTHER_MAJOR:
            log.warning("ignoring invalid %s record from %r: %s", cls.__name__, subkey, problem)
        return None
    return cls(**{f.name: _typed(f.type, value[f.name]) for f in dataclasses.fields(cls) if f.name in value})


def _typed(kind: Any, v: Any) -> Any:
    if kind in ("float", float):
        return float(v)
    if kind == "tuple[str, ...]":
        return tuple(v)  # the DHT's msgpack hands sequences back as lists
    return v


_OTHER_MAJOR = "another major version (logged once per writer)"


def _problem(cls: type, subkey: Any, value: Any) -> str:
    if not is_peer_id(subkey):
        return "subkey is not a peer id"
    if not isinstance(value, Mapping):
        return f"value is a {type(value).__name__}, not a table"
    fields = {f.name: f.type for f in dataclasses.fields(cls)}
    required = {f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING}
    if version_problem(cls.__name__, subkey, value, set(fields)):
        return _OTHER_MAJOR
    missing = sorted(required - set(value))
    if missing:
        return f"missing {missing}"
    for name, kind in fields.items():
        if name not in value:
            continue
        v = value[name]
        kind = kind if isinstance(kind, str) else kind.__name__
        if name == "wire":
            if not is_wire_key(v):
                return f"wire={v!r} is not an averaging bytes key"
        elif kind == "int":
            if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < _MAX_ROUND:
                return f"{name}={v!r} is not a round number"
        elif kind == "float":
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
                return f"{name}={v!r} is not a finite number >= 0"
        elif kind == "str":
            if not isinstance(v, str) or not _HASH_RE.match(v):
                return f"{name}={v!r} is not a hex hash"
        elif kind == "tuple[str, ...]":
            if (not isinstance(v, (list, tuple)) or len(v) > MAX_EXPECTING
                    or not all(is_peer_id(p) for p in v)):
                return f"{name} is not a list of at most {MAX_EXPECTING} peer ids"
        elif kind == "bool":
            if not isinstance(v, bool):
                return f"{name}={v!r} is not true or false"
        elif kind == "bytes":
            if not isinstance(v, bytes) or len(v) > MAX_CREDENTIAL_BYTES:
                return f"{name} is not bytes of at most {MAX_CREDENTIAL_BYTES}"
    return ""


def read_records(dht: Any, key: str, cls: type[R], latest: bool = True,
                 verifier: Optional["CredentialVerifier"] = None) -> dict[str, R]:
    """Every valid ``cls`` record stored under ``key``, by peer id (invalid ones are logged and dropped)."""
    found = dht.get(key, latest=latest)
    return records_from_value(found, cls, verifier)


def records_from_value(found: Any, cls: type[R], verifier: Optional["CredentialVerifier"] = None) -> dict[str, R]:
    """Parse the result of a DHT get (a dictionary of subkeys) into valid records by peer id; with a
    ``verifier``, records without a valid credential for their subkey's peer id are dropped too."""
    if found is None:
        return {}
    entries = found.value
    if not isinstance(entries, dict):
        log.warning("ignoring %s entry that is not a dictionary of subkeys", cls.__name__)
        return {}
    out: dict[str, R] = {}
    for subkey, item in entries.items():
        if is_withdrawal(getattr(item, "value", None)):
            continue  # the writer stopped holding it: not an invalid record, nothing to say
        record = parse_record(cls, subkey, getattr(item, "value", None))
        if record is not None and (verifier is None
                                   or verifier.admits(record.credential, subkey, f"{cls.__name__} record")):
            out[subkey] = record
    return out


WITHDRAWN = "withdrawn"
"""The field that marks a :func:`withdrawal`."""


def withdrawal(credential: bytes = b"", round_no: int = -1, config_hash: str = "", data_hash: str = "") -> dict[str, Any]:
    """The value that replaces one of our records when we stop holding it: readers drop it
    (:func:`records_from_value`); ``credential``: ours, for the DHT's admission check; ``round_no``:
    the round our record announced when we left (-1: none), read back by :func:`withdrawn_rounds`
    together with the config and dataset hashes it belongs to."""
    value: dict[str, Any] = {WITHDRAWN: True}
    if credential:
        value["credential"] = credential
    if round_no >= 0:
        value.update(round=int(round_no), config_hash=config_hash, data_hash=data_hash)
    return value


def is_withdrawal(value: Any) -> bool:
    """True for a :func:`withdrawal` value (``withdrawn`` true, its fields well-typed; fields of a later
    minor are ignored)."""
    if not (isinstance(value, Mapping) and value.get(WITHDRAWN) is True):
        return False
    round_no = value.get("round", 0)
    return (isinstance(value.get("credential", b""), bytes) and isinstance(round_no, int)
            and not isinstance(round_no, bool) and 0 <= round_no < 2 ** 62
            and all(isinstance(value.get(k, ""), str) and len(value.get(k, "")) <= 64
                    for k in ("config_hash", "data_hash")))


def withdrawn_rounds(found: Any, config_hash: str, data_hash: str,
                     verifier: Optional["CredentialVerifier"] = None) -> dict[str, int]:
    """Peer id -> the round it announced when it withdrew, for every :func:`withdrawal` of a holder
    of ``config_hash`` and ``data_hash`` in the result of a DHT get (a dictionary of subkeys); with a
    ``verifier``, only withdrawals with a valid credential for their subkey's peer id (a forged one
    could hold the others back)."""
    entries = getattr(found, "value", None)
    if not isinstance(entries, dict):
        return {}
    out: dict[str, int] = {}
    for subkey, item in entries.items():
        value = getattr(item, "value", None)
        if (not is_withdrawal(value) or "round" not in value or not is_peer_id(subkey)
                or (value.get("config_hash"), value.get("data_hash")) != (config_hash, data_hash)):
            continue
        if verifier is None or verifier.admits(value.get("credential", b""), subkey, "withdrawal"):
            out[subkey] = value["round"]
    return out


def to_value(record: Any) -> dict[str, Any]:
    """The dict stored in the DHT for a record (an empty credential, digest, list or wire key, or a false
    ``paced``, ``idle``, ``formed`` or ``sparse``, is left out; so is a field a later minor than the one
    we state added), with our DHT protocol version (:data:`VERSION_FIELD`)."""
    return stamped(record, dataclasses.asdict(record), ("credential", "digest", "expecting", "paced", "idle", "wire", "result",
                                                         "formed", "sparse"))


def stamped(record: Any, value: dict[str, Any], optional: tuple[str, ...] = ()) -> dict[str, Any]:
    """``value`` (``record`` as a dict) as written at the DHT protocol version we state: the ``optional``
    fields left out when empty, the fields a later minor added left out, and the version field added."""
    kind = type(record).__name__
    for name in list(value):
        if (name in optional and not value[name]) or not versions.writes("dht", f"{kind}.{name}"):
            del value[name]
    if versions.writes("dht", f"{kind}.{VERSION_FIELD}"):
        value[VERSION_FIELD] = versions.stated_text("dht")
    return value


class OwnExpirations:
    """The DHT expiration of the value we last stored under each key as our subkey (the last ``keep``
    keys), so that whatever we store there next replaces it.

    hivemind's storage keeps, per subkey, the value of the later expiration and refuses one that
    expires no later (the same expiration too), whichever arrived last. So a withdrawal must expire
    after the declaration or record it withdraws, a declaration made again after a withdrawal after
    that withdrawal, and a declaration stored again with more to say (whom to wait for, that our
    group began, the round's result digest) after the one before: a value with the same expiration
    is refused by every node that holds the earlier one. Every store of a subkey value of ours goes
    through :meth:`take`. Thread-safe."""

    STEP = 0.01
    """Seconds past our last value's expiration a new value expires when it would not otherwise be later."""

    def __init__(self, keep: int = 1024):
        self._last: OrderedDict[str, float] = OrderedDict()
        self._keep = keep
        self._lock = threading.Lock()

    def _after(self, key: str, wanted: float) -> float:
        last = self._last.get(key)
        return wanted if last is None or wanted > last else last + self.STEP

    def after(self, key: str, wanted: float) -> float:
        """An expiration for a new value under ``key``: ``wanted``, or just past our last value there
        when that one would outlive it. Records nothing (:meth:`take` does)."""
        with self._lock:
            return self._after(key, wanted)

    def take(self, key: str, wanted: float) -> float:
        """:meth:`after`, recorded as our last value under ``key``: call it just before storing there."""
        with self._lock:
            expires = self._after(key, wanted)
            self._last[key] = expires
            self._last.move_to_end(key)
            while len(self._last) > self._keep:
                self._last.popitem(last=False)
            return expires

    def last(self, key: str) -> Optional[float]:
        """The expiration of our last value under ``key`` (None: none recorded)."""
        with self._lock:
            return self._last.get(key)


STORE_TIMEOUT = 15.0
"""How long one store of a refreshed record may take before the caller gives up on it: a DHT process that
stopped answering (killed, or stuck on a dead connection) must not hang the thread that announces."""


def store_within(dht: Any, key: Any, value: Any, expiration_time: float, subkey: Any,
                 timeout: float = STORE_TIMEOUT) -> bool:
    """``dht.store`` of one subkey, waiting at most ``timeout`` seconds (:class:`TimeoutError` past it)."""
    return dht.store(key, value, expiration_time, subkey=subkey, return_future=True).result(timeout)


def announce_within(dht: Any, key: Any, value: Any, ttl: float, subkey: Any, what: str,
                    timeout: float = STORE_TIMEOUT) -> bool:
    """Store (or refresh) one of our records for ``ttl`` seconds through :func:`store_within`; False,
    logged at warning with ``what``, when the store failed or took too long (a refresh loop that calls
    this every third of ``ttl`` tries again)."""
    from hivemind.utils.timed_storage import get_dht_time

    try:
        return bool(store_within(dht, key, value, get_dht_time() + ttl, subkey, timeout))
    except Exception as e:
        log.warning("could not announce %s on the DHT (%r); trying again in %.0f s", what, e, ttl / 3)
        return False


def refresh_until(stopping: Any, interval: float, announce: Callable[[], None]) -> None:
    """Call ``announce()`` every ``interval`` seconds until ``stopping`` (a :class:`threading.Event`)
    is set: the loop that keeps one of our records alive on the DHT. A failed store (the DHT shutting
    down) is logged at debug and tried again next time."""
    while not stopping.wait(interval):
        try:
            announce()
        except Exception as e:
            log.debug("announcing failed: %r", e)
