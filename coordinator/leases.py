"""Leases and heartbeats: how :class:`coordinator.core.Coordinator` keeps track of who is still there.

:class:`LeaseTable` holds every live lease, by id and by peer, with its expiry schedule: lapsed leases
are found through that schedule, so a :meth:`Coordinator.tick` costs O(leases due). After a restart
every loaded lease gets at least ``restart_grace`` seconds.

:class:`Heartbeats` answers a peer's heartbeat: it renews the lease and records what the peer reports
(progress per module, measured throughput and link rates, the paths it seeds, an archive's
evaluations). Renewals and progress only mark records dirty: :meth:`Heartbeats.take_dirty` collects
them for a group commit every ``flush_interval``.

Both work under the coordinator's lock: :meth:`Heartbeats.heartbeat` and :meth:`Heartbeats.progress_of`
take it, the coordinator holds it around the other calls that touch state.
"""

from __future__ import annotations

import copy
import dataclasses
import heapq
import secrets
import threading
from collections import Counter
from typing import Callable, Iterable, Mapping, Optional, Sequence

from coordinator.credentials import CredentialBook
from coordinator.errors import InvalidArgument, LeaseNotFound
from coordinator.health import LossWatch
from coordinator.planner import ModulePlan
from coordinator.records import PIPELINE_MODES, Assignment, Capabilities, Lease, ModuleProgress, PeerRecord
from coordinator.results import HeartbeatResult, PathEvaluation, ProgressReport
from coordinator.settings import CoordinatorSettings
from coordinator.store import WriteBatch
from coordinator.story import Story
from coordinator.view import ClusterView
from models.config import RunConfig

__all__ = ["LeaseTable", "Heartbeats"]

_MAX_SEEDED = 65536
"""The most paths one heartbeat may say it seeds."""


class LeaseTable:
    """Every live lease by id and by peer, the expiry schedule, and the renewals not committed yet.
    Not thread-safe: the coordinator holds its lock around every call."""

    def __init__(self, leases: dict[str, Lease], settings: CoordinatorSettings):
        """``leases``: as the store loaded them; :meth:`restore` makes them live."""
        self._leases = leases
        self._settings = settings
        self._lease_of: dict[str, str] = {}
        self._renewed: set[str] = set()
        """Lease ids whose expiry changed since the last :meth:`take_renewals`."""
        # (scheduled check time, lease id): a lease is looked at when its check time passes and, if a
        # heartbeat renewed it meanwhile, rescheduled; so a tick costs O(leases due), not O(leases).
        self._expiry_heap: list[tuple[float, str]] = []

    def restore(self, peers: Mapping[str, PeerRecord], now: float) -> set[str]:
        """After a restart: drop the leases of peers that are gone (and a second lease of one peer),
        give every other at least ``restart_grace`` seconds and schedule its expiry. Returns the ids
        dropped, to delete from the store."""
        dropped: set[str] = set()
        for lease in list(self._leases.values()):
            peer = peers.get(lease.peer_id)
            if peer is None or peer.state not in ("active", "draining") or lease.peer_id in self._lease_of:
                del self._leases[lease.lease_id]
                dropped.add(lease.lease_id)
                continue
            if lease.expires_at < now + self._settings.restart_grace:
                lease.expires_at = now + self._settings.restart_grace
                self._renewed.add(lease.lease_id)
            self._lease_of[lease.peer_id] = lease.lease_id
        self._expiry_heap = [(l.expires_at, l.lease_id) for l in self._leases.values()]
        heapq.heapify(self._expiry_heap)
        return dropped

    def __len__(self) -> int:
        return len(self._leases)

    def get(self, lease_id: str) -> Optional[Lease]:
        return self._leases.get(lease_id)

    def holds(self, peer_id: str) -> bool:
        """Whether ``peer_id`` holds a lease."""
        return peer_id in self._lease_of

    def holders(self) -> Iterable[str]:
        """The peers holding a lease."""
        return self._lease_of

    def values(self) -> Iterable[Lease]:
        return self._leases.values()

    def grant(self, peer_id: str, now: float, batch: WriteBatch) -> Lease:
        """A new lease for ``peer_id`` (which holds none), lasting ``lease_timeout``; added to ``batch``."""
        lease = Lease(secrets.token_hex(16), peer_id, now + self._settings.lease_timeout)
        self._leases[lease.lease_id] = lease
        heapq.heappush(self._expiry_heap, (lease.expires_at, lease.lease_id))
        self._lease_of[peer_id] = lease.lease_id
        batch.leases[lease.lease_id] = copy.copy(lease)
        self._renewed.discard(lease.lease_id)
        return lease

    def renew(self, lease: Lease, now: float) -> None:
        """``lease`` lasts ``lease_timeout`` from ``now``; committed with the next group commit."""
        lease.expires_at = now + self._settings.lease_timeout
        self._renewed.add(lease.lease_id)

    def release(self, peer_id: str, batch: WriteBatch) -> None:
        """Drop the lease ``peer_id`` holds, if any; its deletion goes into ``batch``."""
        lease_id = self._lease_of.pop(peer_id, None)
        if lease_id is not None:
            self._leases.pop(lease_id, None)
            self._renewed.discard(lease_id)
            batch.deleted_leases.add(lease_id)

    def due(self, now: float) -> list[Lease]:
        """Leases that have expired by ``now``; renewed ones met on the way are rescheduled."""
        heap, due = self._expiry_heap, []
        while heap and heap[0][0] <= now:
            _, lease_id = heapq.heappop(heap)
            lease = self._leases.get(lease_id)
            if lease is None:
                continue
            if lease.expires_at <= now:
                due.append(lease)
            else:
                heapq.heappush(heap, (lease.expires_at, lease_id))
        return due

    def take_renewals(self) -> dict[str, float]:
        """New expiry times since the last call, by lease id, for a group commit."""
        renewals = {i: self._leases[i].expires_at for i in self._renewed if i in self._leases}
        self._renewed = set()
        return renewals


class Heartbeats:
    """``heartbeat`` and ``check_seeded_paths``; keeps each peer's progress per module and the paths
    it seeds, and collects what heartbeats changed for the group commit (:meth:`take_dirty`).

    Given the coordinator's lock, clock, settings and run, its peer table, lease table, cluster view,
    event counters and loss watch; ``story`` records evaluations and rounds, ``credentials`` renews a
    peer's credential, ``plans_for`` gives the exchange plans of an assignment, ``start_drain`` drains
    a peer that announced preemption (under the lock) and ``durable`` commits that drain."""

    def __init__(
        self,
        *,
        lock: threading.RLock,
        clock: Callable[[], float],
        settings: CoordinatorSettings,
        run: RunConfig,
        peers: dict[str, PeerRecord],
        leases: LeaseTable,
        progress: dict[tuple[str, str], ModuleProgress],
        view: ClusterView,
        counters: Counter[str],
        loss_watch: LossWatch,
        story: Story,
        credentials: CredentialBook,
        plans_for: Callable[[Optional[Assignment]], tuple[ModulePlan, ...]],
        start_drain: Callable[[PeerRecord, str, WriteBatch], None],
        durable: Callable[[WriteBatch], None],
    ):
        """``progress``: as the store loaded it; every peer holding a lease in ``leases`` starts its
        session's totals from its record."""
        self._lock = lock
        self._clock = clock
        self._settings = settings
        self._lattice = run.lattice
        self._module_ids = frozenset(run.lattice.module_ids())
        self._peers = peers
        self._leases = leases
        self._view = view
        self._counters = counters
        self._loss_watch = loss_watch
        self._story = story
        self._credentials = credentials
        self._plans_for = plans_for
        self._start_drain = start_drain
        self._durable = durable
        self._progress = progress
        self._progress_by_peer: dict[str, dict[str, ModuleProgress]] = {}
        for (peer_id, module_id), p in progress.items():
            self._progress_by_peer.setdefault(peer_id, {})[module_id] = p
        self._session_base: dict[str, tuple[int, int]] = {}
        """peer id -> its tokens and bytes exchanged when its lease began (a peer's counts restart per lease)."""
        for peer_id in leases.holders():
            peer = peers[peer_id]
            self._session_base[peer_id] = (peer.tokens, peer.bytes_exchanged)
        self._dirty_peers: set[str] = set()
        self._dirty_progress: set[tuple[str, str]] = set()
        self._seeding: dict[str, frozenset[str]] = {}
        """peer id -> paths whose shards it seeds, from its heartbeats (memory only: status page)."""

    def heartbeat(
        self,
        lease_id: str,
        peer_id: str,
        progress: Sequence[ProgressReport] = (),
        assignment_version: int = 0,
        tokens_per_s: float = 0.0,
        bytes_exchanged: int = 0,
        preempting: bool = False,
        seeded_paths: Optional[frozenset[str]] = None,
        evaluations: Sequence[PathEvaluation] = (),
        measured: bool = False,
        capacity: float = 0.0,
        link_bps: tuple[float, float] = (0.0, 0.0),
        exchange_overhead_s: float = 0.0,
    ) -> HeartbeatResult:
        """Renew the lease and record progress; renewals are durable at the next flush, not on return.
        ``seeded_paths`` (checked by :meth:`check_seeded_paths`; None: unchanged): the paths whose
        shards the peer seeds now, kept in memory for the status page only. ``evaluations`` (checked
        by :meth:`coordinator.story.Story.check_evaluations`): validation bits per byte per path, from
        an archive peer only. ``measured``: ``tokens_per_s`` is a measurement, 0 included (what a stage
        server or trainer served); otherwise 0 means unchanged. ``capacity``: a stage server's tokens/s
        at full load (0: unknown). ``link_bps``: upload and download bytes/s the peer measured from its
        averaging rounds; each replaces the capabilities' figure (the join probe's) when > 0.
        ``exchange_overhead_s``: what its rounds' exchanges block it beyond their bytes at those rates
        (kept when > 0)."""
        with self._lock:
            lease = self._leases.get(lease_id)
            now = self._clock()
            if lease is None or lease.peer_id != peer_id or lease.expires_at <= now:
                self._counters["heartbeats_unknown_lease"] += 1
                raise LeaseNotFound(f"lease_id: no live lease {lease_id[:8]}... for {peer_id}; join again")
            for p in progress:
                if p.module_id not in self._module_ids:
                    raise InvalidArgument("progress.module_id", f"{p.module_id!r} is not a module of this run's lattice")
            peer = self._peers[peer_id]
            if evaluations:
                self._story.record_evaluations(peer, evaluations, now)
            self._counters["heartbeats"] += 1
            self._leases.renew(lease, now)
            peer.last_seen = now
            if seeded_paths is not None:
                if seeded_paths:
                    self._seeding[peer_id] = seeded_paths
                else:
                    self._seeding.pop(peer_id, None)
            if measured and peer.assignment is not None and peer.assignment.mode in PIPELINE_MODES:
                self._record_served(peer, tokens_per_s, capacity)
                tokens_per_s = 0.0  # a pipeline role's figure is what it served, not its device's
            if link_bps[0] > 0 or link_bps[1] > 0:
                self._record_link(peer, link_bps, now)
            if exchange_overhead_s > 0 and exchange_overhead_s != peer.exchange_overhead_s:
                peer.exchange_overhead_s = exchange_overhead_s
                self._dirty_peers.add(peer.peer_id)
            if progress or bytes_exchanged or (tokens_per_s and tokens_per_s != peer.capabilities.tokens_per_s):
                self._record_progress(peer, progress, tokens_per_s, bytes_exchanged, now)
            batch = None
            if preempting and peer.state == "active":
                batch = WriteBatch()
                self._start_drain(peer, "the peer announced preemption", batch)
            assignment = peer.assignment if (peer.assignment and peer.assignment.version > assignment_version) else None
            draining = peer.state == "draining"
            credential = self._credentials.renewal(peer_id, now)
            result = HeartbeatResult(lease.expires_at - now, None if draining else assignment, draining,
                                     peer.drain_reason, credential,
                                     () if draining else self._plans_for(peer.assignment))
        if batch is not None:
            self._durable(batch)
        return result

    def check_seeded_paths(self, names: list[str]) -> frozenset[str]:
        """A heartbeat's ``seeded_paths`` as a set; :class:`InvalidArgument` for a name that is not a
        path of the lattice (written ``0-1``) or more names than the lattice has paths."""
        lat = self._lattice
        if len(names) > min(lat.num_paths, _MAX_SEEDED):
            raise InvalidArgument("seeded_paths", f"{len(names)} paths, more than the lattice's {lat.num_paths}")
        for name in names:
            parts = name.split("-")
            if (len(name) > 64 or len(parts) != lat.levels or not all(p.isdigit() and len(p) < 6 for p in parts)
                    or any(int(p) >= lat.modules_per_level for p in parts) or "-".join(str(int(p)) for p in parts) != name):
                raise InvalidArgument("seeded_paths", f"{name[:32]!r} is not a path of this run's lattice (e.g. 0-1)")
        return frozenset(names)

    def start_session(self, peer: PeerRecord) -> None:
        """``peer`` was just given a lease: its progress reports start anew from its current totals
        (under the lock)."""
        self._session_base[peer.peer_id] = (peer.tokens, peer.bytes_exchanged)
        self._progress_by_peer.pop(peer.peer_id, None)

    def stop_seeding(self, peer_id: str) -> None:
        """``peer_id`` lost its lease: it seeds nothing any more (under the lock)."""
        self._seeding.pop(peer_id, None)

    def take_dirty(self) -> WriteBatch:
        """Renewals, peers and progress changed since the last call, for a group commit (under the lock)."""
        batch = WriteBatch(
            peers={p: copy.copy(self._peers[p]) for p in self._dirty_peers},
            renewals=self._leases.take_renewals(),
            progress={k: copy.copy(self._progress[k]) for k in self._dirty_progress if k in self._progress},
        )
        self._dirty_peers = set()
        self._dirty_progress = set()
        return batch

    def progress_of(self, peer_id: str) -> dict[str, ModuleProgress]:
        """Copies of ``peer_id``'s progress per module in its current lease."""
        with self._lock:
            return {m: copy.copy(p) for m, p in self._progress_by_peer.get(peer_id, {}).items()}

    def progress_by_peer(self) -> dict[str, dict[str, ModuleProgress]]:
        """peer id -> its progress per module, each peer's table copied (under the lock)."""
        return {pid: dict(mods) for pid, mods in self._progress_by_peer.items()}

    def seeding(self) -> dict[str, frozenset[str]]:
        """peer id -> the paths it seeds, copied (under the lock)."""
        return dict(self._seeding)

    def _record_served(self, peer: PeerRecord, tokens_per_s: float, capacity: float) -> None:
        """A stage server's or trainer's measured tokens/s served (and capacity); under the lock."""
        capacity = capacity or peer.capacity_tokens_per_s
        if (tokens_per_s, capacity) == (peer.served_tokens_per_s, peer.capacity_tokens_per_s):
            return
        peer.served_tokens_per_s, peer.capacity_tokens_per_s = tokens_per_s, capacity
        if peer.state == "active":
            self._view.set_tokens_per_s(peer.peer_id, tokens_per_s, capacity)
        self._dirty_peers.add(peer.peer_id)

    def _record_link(self, peer: PeerRecord, link_bps: tuple[float, float], now: float) -> None:
        """Rates measured from the peer's rounds replace the probe's (a direction not measured keeps its
        figure); under the lock."""
        caps = peer.capabilities
        up = link_bps[0] if link_bps[0] > 0 else caps.upload_bps
        down = link_bps[1] if link_bps[1] > 0 else caps.download_bps
        if (up, down) != (caps.upload_bps, caps.download_bps):
            peer.capabilities = dataclasses.replace(caps, upload_bps=up, download_bps=down)
            self._dirty_peers.add(peer.peer_id)
        peer.link_measured_at = now

    def _record_progress(
        self, peer: PeerRecord, progress: Sequence[ProgressReport], tokens_per_s: float, bytes_exchanged: int,
        now: float,
    ) -> None:
        base_tokens, base_bytes = self._session_base.get(peer.peer_id, (peer.tokens, peer.bytes_exchanged))
        mine = self._progress_by_peer.setdefault(peer.peer_id, {})
        self._story.count_rounds(peer, {m: r.round for m, r in mine.items()}, {p.module_id: p.round for p in progress})
        for p in progress:
            key = (peer.peer_id, p.module_id)
            row = ModuleProgress(peer.peer_id, p.module_id, p.round, p.tokens, p.loss, now)
            self._progress[key] = row
            mine[p.module_id] = row
            self._dirty_progress.add(key)
            self._loss_watch.report(peer.peer_id, p.module_id, p.round, p.loss,
                                    peer.assignment.version if peer.assignment is not None else 0, now)
        if progress:
            peer.tokens = base_tokens + max(r.tokens for r in mine.values())
        if bytes_exchanged:
            peer.bytes_exchanged = base_bytes + bytes_exchanged
        if tokens_per_s and tokens_per_s != peer.capabilities.tokens_per_s:
            caps = peer.capabilities
            peer.capabilities = Capabilities(caps.device, caps.memory_bytes, tokens_per_s, caps.upload_bps,
                                             caps.download_bps, caps.multiaddrs)
            if peer.state == "active" and peer.counted_tokens_per_s() == tokens_per_s:
                self._view.set_tokens_per_s(peer.peer_id, tokens_per_s)
        self._dirty_peers.add(peer.peer_id)
