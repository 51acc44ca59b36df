"""Consistent copies of the coordinator's state, the part of :class:`coordinator.core.Coordinator`
that the servicer, the status page and tests read; every copy is taken under the coordinator's lock
(``_lock``, ``_peers``, ``_leases``, ``_progress_by_peer``, ``counters``, ``last_rebalance_reason``, ``_seeding``, ``bans``,
``clock``, ``_initial_peers``, ``module_rounds``, ``history``, ``loss_watch``, ``run``), so a reader never sees a half-applied change.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Optional

from coordinator.health import BpbRise, bpb_rise, bpb_round_series, suspect_module
from coordinator.history import BPB_PREFIX
from coordinator.records import Lease, ModuleProgress, PeerRecord
from models.config import parse_path
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
                bpb_rises=self._bpb_rises(),
                loss_divergences=self.loss_watch.diverging({p.peer_id for p in self._peers.values()
                                                            if p.state == "active"}),
            )

    def _bpb_rises(self) -> list[BpbRise]:
        """Paths whose validation bits per byte rise, each with its suspect module (under the lock)."""
        lattice = self.run.lattice
        rising: list[BpbRise] = []
        for name in self.history.names():
            if not name.startswith(BPB_PREFIX):
                continue
            path = name[len(BPB_PREFIX):]
            points = self.history.series([name])[name]
            rounds = dict(self.history.series([bpb_round_series(path)])[bpb_round_series(path)])
            rise = bpb_rise(path, points, rounds, self.loss_watch.rules)
            if rise is not None:
                rising.append(rise)
        if not rising:
            return []
        arrivals: dict[str, float] = {}
        for p in self._peers.values():
            if p.state == "active" and p.assignment is not None:
                arrived = max(p.last_joined, p.last_moved)
                for m in p.assignment.module_ids:
                    arrivals[m] = max(arrivals.get(m, arrived), arrived)
        modules = {r.path: lattice.path_modules(parse_path(r.path, lattice.levels)) for r in rising}
        through = {m: len(lattice.paths_through(m)) for m in {m for ms in modules.values() for m in ms}}
        return [dataclasses.replace(r, module=suspect_module(modules[r.path], list(modules.values()), arrivals,
                                                             r.since_time, through)) for r in rising]

    def history_series(self) -> dict[str, list[tuple[float, float]]]:
        """Every history series (:mod:`coordinator.history`), copied under the lock."""
        with self._lock:
            return self.history.series()

    def initial_peers(self) -> list[str]:
        """DHT bootstrap multiaddrs of the most recently joined live peers."""
        with self._lock:
            return self._initial_peers("")
