"""The coordinator's state as plain dataclasses: peers, their capabilities and assignments, leases,
and per-module progress. Torch-free and proto-free: the servicer translates, the store persists."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Optional

from models import strict_json

__all__ = [
    "MODE_PATH",
    "MODE_STAGE",
    "MODE_ARCHIVE",
    "MODE_TRAINER",
    "PIPELINE_MODES",
    "PEER_STATES",
    "Capabilities",
    "Assignment",
    "PeerRecord",
    "Lease",
    "ModuleProgress",
    "Move",
]

MODE_PATH = "path"
"""Train a whole path locally (DiPaCo, Douillard et al. 2024)."""
MODE_STAGE = "stage"
"""Serve one module as a pipeline stage (SWARM, Ryabinin et al. 2023)."""
MODE_ARCHIVE = "archive"
"""An archive peer: follows every module, trains nothing; never counted as covering work."""
MODE_TRAINER = "trainer"
"""Drive a path's micro-batches through the stage servers of its levels (SWARM's trainer): holds the
path's embedding, head and data."""
PIPELINE_MODES = (MODE_STAGE, MODE_TRAINER)
"""Roles whose throughput is what they served, reported by heartbeats (0 until measured), never the
figure measured at join (which is a whole path's on this peer's device)."""

PEER_STATES = ("active", "draining", "left", "expired", "banned")
"""``active``: holds a lease and work. ``draining``: told to finish its round and leave.
``left``/``expired``: no lease; the history (tokens, key, last assignment) is kept for a rejoin.
``banned``: reported by other peers or banned by the operator; its joins are refused."""


@dataclass(frozen=True)
class Capabilities:
    """What a peer reports about itself at join; validated before it gets here."""

    device: str
    """``cpu``, ``cuda``, ... with an optional model name."""
    memory_bytes: int
    """Memory available for training."""
    tokens_per_s: float
    """Measured training throughput on the run's model."""
    upload_bps: float = 0.0
    """Upload bandwidth in bytes/s (0: not measured, treated as a fast link): the join probe's figure
    at first, then what the peer's heartbeats report from its averaging rounds."""
    download_bps: float = 0.0
    """Download bandwidth in bytes/s (0: not measured), as ``upload_bps``."""
    multiaddrs: tuple[str, ...] = ()
    """libp2p multiaddrs other peers can dial (empty for client-mode peers)."""


@dataclass(frozen=True)
class Assignment:
    """Work for one peer: a path (path mode), a module to serve (stage mode) or a path to drive through
    stage servers (a pipeline trainer)."""

    mode: str
    """:data:`MODE_PATH`, :data:`MODE_STAGE`, :data:`MODE_TRAINER` or :data:`MODE_ARCHIVE`."""
    path: tuple[int, ...] = ()
    """Path mode and trainers: one module index per level."""
    module_id: str = ""
    """Stage mode: the module served."""
    module_ids: tuple[str, ...] = ()
    """Every module this assignment trains."""
    inner_steps: int = 0
    """H for this peer (larger than the run's on a slow link)."""
    codec: str = ""
    """The run's pseudo-gradient codec (``OuterConfig.codec``), handed to the peer, which builds its
    optimizer with it: the same for every peer, since a module's group must share one."""
    reason: str = ""
    """Why, in words."""
    version: int = 0
    """Increases with every change of this peer's assignment."""

    def same_work(self, other: Optional["Assignment"]) -> bool:
        """True when ``other`` trains the same modules the same way (reason and version aside)."""
        return other is not None and (self.mode, self.path, self.module_id, self.inner_steps, self.codec) == (
            other.mode, other.path, other.module_id, other.inner_steps, other.codec
        )

    def label(self) -> str:
        """``path 1,0``, ``stage L0M1`` or ``trainer 1,0``."""
        if self.mode == MODE_PATH:
            return "path " + ",".join(map(str, self.path))
        if self.mode == MODE_TRAINER:
            return "trainer " + ",".join(map(str, self.path))
        if self.mode == MODE_ARCHIVE:
            return "archive"
        return "stage " + self.module_id

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Assignment":
        return cls(**{**d, "path": tuple(d.get("path", ())), "module_ids": tuple(d.get("module_ids", ()))})


@dataclass
class PeerRecord:
    """Everything the coordinator remembers about one peer id, across leaves and rejoins."""

    peer_id: str
    key_fingerprint: str
    """sha256 of the libp2p public key the peer id first joined with."""
    capabilities: Capabilities
    state: str = "active"
    assignment: Optional[Assignment] = None
    """Current work; kept after a leave or expiry as a hint for a rejoin (the work itself is freed)."""
    first_joined: float = 0.0
    last_joined: float = 0.0
    last_seen: float = 0.0
    last_moved: float = float("-inf")
    """When the scheduler last moved this peer (rebalancing hysteresis)."""
    joins: int = 0
    tokens: int = 0
    """Tokens processed in total, summed over modules and rejoins."""
    rounds: int = 0
    """Outer rounds its reports advanced through (within a lease, the most over its modules), summed
    over rejoins: the first report after a join only sets where it starts."""
    bytes_exchanged: int = 0
    drain_reason: str = ""
    reachability: str = "unknown"
    """The coordinator's dial-back verdict at the latest join (:mod:`coordinator.reachability`)."""
    reachable_addr: str = ""
    """The announced multiaddr that accepted the dial-back ('' unless reachable)."""
    observed_addr: str = ""
    """The address the latest join came from, as the coordinator saw it."""
    served_tokens_per_s: float = 0.0
    """Stage servers and trainers (:data:`PIPELINE_MODES`): tokens/s served over the last window, as
    its heartbeats measure it; 0 from each new such assignment until measured."""
    capacity_tokens_per_s: float = 0.0
    """Stage servers: tokens/s they could serve at full load, as measured (0: unknown)."""
    follows_plans: bool = True
    """The peer states coordinator protocol 1.2 or later at its latest join, so it follows exchange
    plans; the planner never changes the codec of a module an older peer holds."""
    link_measured_at: float = 0.0
    """When a heartbeat last reported link rates measured from the peer's rounds (0: never; its
    capabilities' rates are then the join probe's)."""
    exchange_overhead_s: float = 0.0
    """Seconds a round's exchanges block the peer beyond their bytes at its link rates (matchmaking,
    round trips, waiting for its groups), as its heartbeats measure it (0: not measured)."""
    requested_role: str = ""
    """The role the peer asked for at its latest join (``peer join --role``; '' lets the coordinator
    decide): rebalancing never moves it to another."""

    def counted_tokens_per_s(self) -> float:
        """The throughput the scheduler counts this peer at: what it served in a pipeline role, else
        the figure measured at join (or reported since)."""
        if self.assignment is not None and self.assignment.mode in PIPELINE_MODES:
            return self.served_tokens_per_s
        return self.capabilities.tokens_per_s

    @property
    def holds_work(self) -> bool:
        return self.state in ("active", "draining") and self.assignment is not None

    def to_json(self) -> str:
        d = dataclasses.asdict(self)
        d["capabilities"]["multiaddrs"] = list(self.capabilities.multiaddrs)
        if d["last_moved"] == float("-inf"):
            d["last_moved"] = None
        return strict_json.dumps(d, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "PeerRecord":
        d = json.loads(text)
        caps = d.pop("capabilities")
        caps["multiaddrs"] = tuple(caps["multiaddrs"])
        assignment = d.pop("assignment")
        last_moved = d.pop("last_moved")
        return cls(
            capabilities=Capabilities(**caps),
            assignment=Assignment.from_dict(assignment) if assignment else None,
            last_moved=float("-inf") if last_moved is None else last_moved,
            **d,
        )


@dataclass
class Lease:
    """A peer's right to its work; renewed by heartbeats, freed when it expires."""

    lease_id: str
    peer_id: str
    expires_at: float
    """Wall-clock time (``time.time()`` seconds)."""


@dataclass
class ModuleProgress:
    """Latest progress a peer reported for one module."""

    peer_id: str
    module_id: str
    round: int = 0
    tokens: int = 0
    loss: float = field(default=float("nan"))
    updated_at: float = 0.0


@dataclass(frozen=True)
class Move:
    """Rebalancing decision: move ``peer_id`` from one path (or stage module) to another."""

    peer_id: str
    assignment: Assignment
    reason: str
