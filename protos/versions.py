"""What version each side speaks: the release, and one protocol version (major.minor) per contract.

A volunteer network is never upgraded at once, so every contract between two processes states its
version, and both sides follow one rule:

- within a major, a reader accepts fields it does not know (it ignores them and counts them in
  :data:`UNKNOWN_FIELDS`, shown on the status pages and in ``/metrics``), and a writer adds only
  optional fields (a reader of the previous minor must understand every message of the next);
- a message of another major is refused, and the refusal names both versions.

The contracts (:data:`CONTRACTS`): the coordinator's gRPC service (``coordinator``), the records peers
write to the DHT (``dht``), the averaging messages between peers (``averaging``: matchmaking, parts,
state transfer), stage mode's activations (``stage``) and a dataset's chunks between peers (``data``).
Each lists the fields every minor added (:attr:`Contract.added`): a writer that states an older minor
leaves them out (:func:`writes`), and the test of the committed golden messages reads the current
messages with the previous minor's schema (``tests/protos/test_contract_versions.py``, which also fails when a
contract's schema changes while its version does not).

Version 1.0 of every contract is what releases 0.1.x spoke; they stated no version at all, and their
DHT readers refused records with fields they did not know. 1.1 is the first versioned one.

:data:`RELEASE` is the package's version (``pyproject.toml`` reads it from here). A coordinator may
require a least release of its peers (``[coordinator] min_peer_version``): :func:`release_key`
orders releases.

Stdlib and protobuf only: the coordinator, every peer process and ``hivepath --version`` import it.
"""

from __future__ import annotations

import functools
import re
import subprocess
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

__all__ = [
    "RELEASE", "Contract", "CONTRACTS", "NAMES", "Version", "parse_version", "stated", "stated_text",
    "stated_all", "set_override", "writes", "stamp", "refusal", "release_key", "older_than", "commit", "describe",
    "UnknownFields", "UNKNOWN_FIELDS", "unknown_proto_fields",
]

RELEASE = "0.2.0"
"""The package's version (``hivepath --version``; ``pyproject.toml`` reads it from here)."""

Version = tuple[int, int]
_VERSION_RE = re.compile(r"^(0|[1-9][0-9]{0,3})\.(0|[1-9][0-9]{0,3})$")


@dataclass(frozen=True)
class Contract:
    """One contract between two processes, at its current version."""

    name: str
    version: Version
    """(major, minor) this release speaks."""
    what: str
    """What the contract covers, for people (``hivepath --version``, docs/upgrade.md)."""
    added: Mapping[int, tuple[str, ...]] = field(default_factory=dict)
    """Minor of the current major -> the fields it added (``Message.field`` for protobuf messages,
    ``Record.field`` for DHT records); every one of them is optional."""

    @property
    def text(self) -> str:
        return f"{self.version[0]}.{self.version[1]}"


CONTRACTS: dict[str, Contract] = {c.name: c for c in (
    Contract("coordinator", (1, 4), "the coordinator's gRPC service (protos/hivepath/coordinator/v1)", {
        1: ("JoinRequest.peer_version", "JoinRequest.protocols", "JoinResponse.coordinator_version",
            "JoinResponse.protocols", "HeartbeatRequest.peer_version", "HeartbeatResponse.required_version",
            "PeerStatus.version"),
        2: ("HeartbeatRequest.measured_upload_bps", "HeartbeatRequest.measured_download_bps",
            "HeartbeatResponse.plans"),
        3: ("HeartbeatRequest.measured_exchange_overhead_s",),
        4: ("ModulePlan.overlap",),
    }),
    Contract("dht", (1, 4), "the records peers write to the DHT (peer.network.records, peer.stage.records, "
             "peer.datasync.records)", {
        1: ("GroupDeclaration.wire", "HolderRecord.wire", "GroupDeclaration.v", "HolderRecord.v", "ArchiveRecord.v",
            "StageServerRecord.v", "SeederRecord.v"),
        2: ("GroupDeclaration.result",),
        3: ("GroupDeclaration.formed",),
        4: ("GroupDeclaration.sparse",),
    }),
    Contract("averaging", (1, 4), "matchmaking, all-reduce parts, results and state transfer between peers "
             "(protos/hivepath/peer/v1/net.proto)", {
        1: ("JoinRequest.protocol", "JoinRequest.wire", "DeclareNotice.wire"),
        2: ("ResultReply.part_digests",),
        3: ("DeclareNotice.sparse",),
        4: ("DeclareNotice.also", "DeclareAck.also_read"),
    }),
    Contract("stage", (1, 2), "stage mode's activations and gradients (protos/hivepath/peer/v1/stage.proto)", {
        1: ("StageRequest.protocol",),
        2: ("StageRequest.residual", "StageReply.residual"),
    }),
    Contract("data", (1, 1), "a dataset's chunks between seeders and fetchers (protos/hivepath/peer/v1/data.proto)", {
        1: ("ChunkRequest.protocol",),
    }),
)}
NAMES = tuple(CONTRACTS)


def parse_version(text: Any) -> Version:
    """``"1.1"`` -> (1, 1); ValueError for anything else."""
    m = _VERSION_RE.match(text) if isinstance(text, str) else None
    if not m:
        raise ValueError(f"{text!r} is not a protocol version MAJOR.MINOR (e.g. 1.1)")
    return int(m.group(1)), int(m.group(2))


_override: dict[str, Version] = {}


def set_override(text: Optional[str]) -> None:
    """State other versions than this release's: ``"all=2.0"`` or ``"dht=1.0,averaging=1.0"`` (tests
    start peers of a previous minor or of the next major with it, ``HIVEPATH_TEST_PROTOCOL``);
    None or '' restores this release's. ValueError naming what is wrong."""
    found: dict[str, Version] = {}
    for part in (text or "").split(","):
        if not part.strip():
            continue
        name, sep, version = part.strip().partition("=")
        if not sep or (name != "all" and name not in CONTRACTS):
            raise ValueError(f"protocol override {part!r} is not NAME=MAJOR.MINOR with NAME 'all' or one of "
                             f"{', '.join(NAMES)}")
        for n in (NAMES if name == "all" else (name,)):
            found[n] = parse_version(version)
    _override.clear()
    _override.update(found)


def stated(name: str) -> Version:
    """The version of contract ``name`` this process speaks (this release's unless overridden)."""
    return _override.get(name, CONTRACTS[name].version)


def stated_text(name: str) -> str:
    major, minor = stated(name)
    return f"{major}.{minor}"


def stated_all() -> dict[str, str]:
    """Contract name -> the version this process speaks, as text."""
    return {name: stated_text(name) for name in NAMES}


def writes(name: str, field_name: str) -> bool:
    """True when a writer of contract ``name`` at the version it states writes ``field_name``: every
    field but those a later minor of its major added (a peer stating the previous minor leaves them out)."""
    contract = CONTRACTS[name]
    major, minor = stated(name)
    if major != contract.version[0]:
        return True
    return not any(field_name in fields for m, fields in contract.added.items() if m > minor)


def stamp(name: str, field_name: str) -> str:
    """What a writer of contract ``name`` puts in its version field ``field_name`` (``Message.field``):
    the version it states, or '' where that field came after the minor it states."""
    return stated_text(name) if writes(name, field_name) else ""


def refusal(name: str, theirs: Any, who: str = "the other side", us: str = "this process") -> str:
    """'' when a message of contract ``name`` at version ``theirs`` (text; '' or None: 1.0, a release
    that stated none) can be read here; else why not, naming both versions, in one line (``who``
    wrote it, ``us`` reads it)."""
    ours = stated(name)
    try:
        major = parse_version(theirs)[0] if theirs else 1
    except ValueError:
        return f"{name} protocol: {who} states {theirs!r}, which is not a version; {us} speaks {ours[0]}.{ours[1]}"
    if major == ours[0]:
        return ""
    return (f"{name} protocol: {who} speaks {theirs or '1.0'} and {us} {ours[0]}.{ours[1]}, a different major "
            f"version: they cannot talk; run the same major on both (docs/upgrade.md)")


def release_key(text: str) -> tuple[int, ...]:
    """A release ``"0.2.0"`` (extra text after the numbers, ``"0.2.0.dev1"``, is ignored) as a sortable
    tuple; '' (a peer of a release that stated none) sorts below every release. ValueError when it
    starts with no number."""
    if not text:
        return (-1,)
    m = re.match(r"^[0-9]+(\.[0-9]+)*", text)
    if not m:
        raise ValueError(f"{text!r} is not a release such as 0.2.0")
    return tuple(int(p) for p in m.group(0).split("."))


def older_than(release: str, least: str) -> bool:
    """True when ``release`` (a peer's, '' for none stated) is below ``least`` ('' accepts every one);
    releases compare number by number, missing numbers counting 0 (0.2 == 0.2.0)."""
    if not least:
        return False
    a, b = list(release_key(release)), list(release_key(least))
    width = max(len(a), len(b))
    return a + [0] * (width - len(a)) < b + [0] * (width - len(b))


@functools.lru_cache(maxsize=1)
def commit() -> str:
    """The git commit this code runs from when installed from a checkout (``abc123def456``, with
    ``+dirty`` when tracked files differ from it); '' when it is not a git checkout."""
    root = Path(__file__).resolve().parent.parent
    if not (root / ".git").exists():
        return ""
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=5.0)
        if head.returncode != 0:
            return ""
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=5.0)
    except (OSError, subprocess.SubprocessError):
        return ""
    return head.stdout.strip() + ("+dirty" if dirty.returncode == 0 and dirty.stdout.strip() else "")


def describe() -> str:
    """One line: ``hivepath 0.2.0 (commit abc123def456), protocols coordinator 1.1, dht 1.1, ...``."""
    built = f" (commit {commit()})" if commit() else ""
    protocols = ", ".join(f"{name} {version}" for name, version in stated_all().items())
    return f"hivepath {RELEASE}{built}, protocols {protocols}"


class UnknownFields:
    """How many fields of each message type a reader here ignored because it did not know them (a
    writer of a newer minor). Thread-safe; :meth:`snapshot` is what status pages show."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    def count(self, message: str, names: Iterable[Any]) -> int:
        """Count each of ``names`` (field names or numbers) as ignored in a ``message``; returns how many."""
        names = [str(n) for n in names]
        if names:
            with self._lock:
                for n in names:
                    self._counts[f"{message}.{n}"] += 1
        return len(names)

    def snapshot(self) -> dict[str, int]:
        """``Message.field`` -> times ignored, sorted by name."""
        with self._lock:
            return dict(sorted(self._counts.items()))

    def total(self) -> int:
        with self._lock:
            return sum(self._counts.values())


UNKNOWN_FIELDS = UnknownFields()
"""Every unknown field this process ignored, by message type and field."""


def unknown_proto_fields(message: Any) -> int:
    """Count, in :data:`UNKNOWN_FIELDS`, the fields of a parsed protobuf ``message`` (top level) that its
    schema here does not know (by field number; a repeated field once); returns how many."""
    from google.protobuf import unknown_fields

    numbers = sorted({f.field_number for f in unknown_fields.UnknownFieldSet(message)})
    return UNKNOWN_FIELDS.count(type(message).DESCRIPTOR.name, numbers)
