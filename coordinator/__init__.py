"""The coordinator service: admission, leases, work assignment, persisted state, status.

It imports neither torch nor hivemind, and never touches weights or gradients.

- :mod:`coordinator.core`: :class:`Coordinator`, the state machine (injected clock, no transport):
  admission, assignment, drain, expiry, rebalancing and consistent reads (peers, leases, status view);
  it builds the collaborators below and delegates to them
- :mod:`coordinator.leases`: its lease table (expiry schedule, restart grace) and heartbeats (renewal,
  progress, group commit)
- :mod:`coordinator.bootstrap`: whom a joining peer dials first (live peers' DHT addresses, relays)
- :mod:`coordinator.scheduler`: pure assignment functions returning ``(decision, reason)``
- :mod:`coordinator.planner`, :mod:`coordinator.planning`: each module's exchange plan, the pure decision
  and the coordinator's planning passes
- :mod:`coordinator.view`: :class:`ClusterView`, the aggregates decisions read
- :mod:`coordinator.store`, :mod:`coordinator.sqlite_store`: the store interface, memory and SQLite-WAL
- :mod:`coordinator.committer`: group commit of write batches
- :mod:`coordinator.servicer`, :mod:`coordinator.server`: gRPC (grpc.aio on uvloop), health, TLS
- :mod:`coordinator.wire`: frames that are not messages refused INVALID_ARGUMENT before any servicer runs
- :mod:`coordinator.web`, :mod:`coordinator.metrics`, :mod:`coordinator.status`: status page, JSON, /metrics
- :mod:`coordinator.history`, :mod:`coordinator.story`, :mod:`coordinator.plots`: the run's sampled history
  (bounded, stored), totals that survive restarts, archive peers' validation reports, and the page's SVG plots
- :mod:`coordinator.health`: long-run health signals (a path's validation bpb rising, a peer's loss diverging)
- :mod:`coordinator.settings`: the ``[coordinator]`` section of run.toml
- :mod:`coordinator.validation`, :mod:`coordinator.errors`: request checks and refusals
- :mod:`coordinator.credentials`: the signing key and admission credentials, issued and renewed
  (format: :mod:`protos.credential`)
- :mod:`coordinator.bans`, :mod:`coordinator.moderation`: reports of misbehaving peers, the pure ban
  decision, and the coordinator's report/ban/unban calls
"""

from coordinator.bans import Ban, BanBook, Report, ban_decision
from coordinator.core import Coordinator, HeartbeatResult, JoinResult, ProgressReport, ReportResult
from coordinator.credentials import CredentialIssuer, load_or_create_key
from coordinator.records import Assignment, Capabilities, Lease, ModuleProgress, PeerRecord
from coordinator.scheduler import Move, assign_peer, rebalance
from coordinator.server import BackgroundServer, ServeOptions, run_server, serve
from coordinator.settings import CoordinatorSettings, load_run_and_settings, load_settings
from coordinator.sqlite_store import SQLiteStore, open_store
from coordinator.store import MemoryStore, Store, WriteBatch
from coordinator.view import ClusterView

__all__ = [
    "Coordinator",
    "JoinResult",
    "HeartbeatResult",
    "ProgressReport",
    "ReportResult",
    "Ban",
    "BanBook",
    "Report",
    "ban_decision",
    "CredentialIssuer",
    "load_or_create_key",
    "Assignment",
    "Capabilities",
    "Lease",
    "ModuleProgress",
    "PeerRecord",
    "Move",
    "assign_peer",
    "rebalance",
    "ClusterView",
    "CoordinatorSettings",
    "load_settings",
    "load_run_and_settings",
    "Store",
    "MemoryStore",
    "SQLiteStore",
    "WriteBatch",
    "open_store",
    "ServeOptions",
    "BackgroundServer",
    "serve",
    "run_server",
]
