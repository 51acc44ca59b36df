"""Consistent copies of the coordinator's state, the part of :class:`coordinator.core.Coordinator`
that the servicer, the status page and tests read; every copy is taken under the coordinator's lock
(``_lock``, ``_peers``, ``_leases``, ``_progress_by_peer``, ``counters``, ``last_rebalance_reason``, ``_seeding``, ``bans``,
``clock``, ``_initial_peers``, ``module_rounds``, ``history``), so a reader never sees a half-applied change.
"""

from __future__ import annotations

import copy
from typing import Optional

from coordinator.history import BPB_PREFIX
from coordinator.records import Lease, ModuleProgress, PeerRecord
from coordinator.results import StatusView

__all__ = ["Reading"]


class Reading:
    """``peers``, ``peer``, ``leases``, ``progress_of``, ``status_view`` and ``initial_peers``."""

    def peers(self) -> list[PeerRecord]:
        with self._lock:
            return [copy.copy(p) for p in self._peers.values()]

    def peer(self, peer_id: str) -> Optional[PeerRecord]:
        with self._lock:
            p = self._peers.get(peer_id)
            return copy.copy(p) if p is not None else None

    def leases(self) -> list[Lease]:
        with self._lock:
            return [copy.copy(l) for l in self._leases.values()]

    def progress_of(self, peer_id: str) -> dict[str, ModuleProgress]:
        with self._lock:
            return {m: copy.copy(p) for m, p in self._progress_by_peer.get(peer_id, {}).items()}

    def status_view(self) -> "StatusView":
        """A consistent copy of what the status page shows, taken under the lock."""
        with self._lock:
            return StatusView(
                now=self.clock(),
                peers=[copy.copy(p) for p in self._peers.values()],
                lease_expiry={l.peer_id: l.expires_at for l in self._leases.values()},
                progress={pid: dict(mods) for pid, mods in self._progress_by_peer.items()},
                counters=dict(self.counters),
                rebalance_reason=self.last_rebalance_reason,
                seeding=dict(self._seeding),
                banned=sorted(self.bans.bans),
                module_rounds=dict(self.module_rounds),
                latest_bpb={name[len(BPB_PREFIX):]: self.history.last(name) for name in self.history.names()
                            if name.startswith(BPB_PREFIX)},
                plans={m: list(p) for m, p in self.plans.items()},
                plan_reasons=dict(self.plan_reasons),
                link_reason=self.link_reason,
            )

    def history_series(self) -> dict[str, list[tuple[float, float]]]:
        """Every history series (:mod:`coordinator.history`), copied under the lock."""
        with self._lock:
            return self.history.series()

    def initial_peers(self) -> list[str]:
        """DHT bootstrap multiaddrs of the most recently joined live peers."""
        with self._lock:
            return self._initial_peers("")
