"""What :class:`coordinator.core.Coordinator` returns to its callers: plain frozen dataclasses."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from coordinator.planner import ModulePlan
from coordinator.health import BpbRise, LossDivergence
from coordinator.records import Assignment, Lease, ModuleProgress, PeerRecord

__all__ = ["ProgressReport", "PathEvaluation", "JoinResult", "StatusView", "HeartbeatResult", "ReportResult"]


@dataclass(frozen=True)
class ProgressReport:
    """One module's progress as a heartbeat reports it (validated by the servicer)."""

    module_id: str
    round: int
    tokens: int
    loss: float


@dataclass(frozen=True)
class PathEvaluation:
    """One path's validation bits per byte, as an archive peer measured it on its latest snapshot."""

    path: tuple[int, ...]
    bpb: float
    round: int = 0
    """The lowest round among the path's modules in the snapshot evaluated."""


@dataclass(frozen=True)
class JoinResult:
    lease: Lease
    assignment: Assignment
    initial_peers: list[str]
    rejoined: bool
    credential: bytes = b""
    """The peer's admission credential (:mod:`protos.credential` bytes)."""
    relays: list[str] = field(default_factory=list)
    """For an unreachable peer: multiaddrs of the peers chosen to relay for it."""


@dataclass(frozen=True)
class StatusView:
    """What :meth:`Coordinator.status_view` returns: copies, safe to read without the lock."""

    now: float
    peers: list[PeerRecord]
    lease_expiry: dict[str, float]
    """peer id -> when its lease expires."""
    progress: dict[str, dict[str, ModuleProgress]]
    """peer id -> module id -> latest progress."""
    counters: dict[str, int]
    rebalance_reason: str
    seeding: dict[str, frozenset[str]] = field(default_factory=dict)
    """peer id -> paths (written ``0-1``) whose shards it seeds, as its heartbeats say."""
    banned: list[str] = field(default_factory=list)
    """Banned peer ids, sorted."""
    module_rounds: dict[str, int] = field(default_factory=dict)
    """module id -> highest outer round any peer reported (kept across restarts)."""
    latest_bpb: dict[str, tuple[float, float]] = field(default_factory=dict)
    """path name (``0,1``) -> (time, validation bits per byte) of the latest evaluation."""
    plans: dict[str, list[ModulePlan]] = field(default_factory=dict)
    """module id -> its exchange plans, oldest first."""
    plan_reasons: dict[str, str] = field(default_factory=dict)
    """module id -> what the latest planning pass said about it."""
    link_reason: str = ""
    """What the latest planning pass found about a link that alone holds a module back, and did."""
    bpb_rises: list[BpbRise] = field(default_factory=list)
    """Paths whose validation bits per byte rise (:func:`coordinator.health.bpb_rise`), by path."""
    loss_divergences: list[LossDivergence] = field(default_factory=list)
    """Active peers whose training loss diverges (:class:`coordinator.health.LossWatch`), by peer id."""


@dataclass(frozen=True)
class HeartbeatResult:
    lease_remaining: float
    assignment: Optional[Assignment]
    """Set when the peer's assignment version is older than the coordinator's."""
    drain: bool
    drain_reason: str
    credential: bytes = b""
    """A renewed credential, when the current one is past half its life (else empty)."""
    plans: tuple[ModulePlan, ...] = ()
    """The exchange plans of the modules the peer trains (:meth:`coordinator.planning.Planning.plans_for`)."""


@dataclass(frozen=True)
class ReportResult:
    """What a ``ReportPeer`` led to: whether the suspect is banned now, and why (or why not)."""

    banned: bool
    reason: str

