"""Leases and heartbeats, the part of :class:`coordinator.core.Coordinator` that keeps track of who is
still there.

A heartbeat renews its peer's lease and records its progress; a lease that is not renewed lapses
and :meth:`Coordinator.tick` frees its work (lapsed leases are found through an expiry schedule, so
a tick costs O(leases due)). Renewals and progress only mark records dirty: :meth:`Leases.take_dirty`
collects them for a group commit every ``flush_interval``. After a restart every loaded lease gets at
least ``restart_grace`` seconds.

Kept apart from admission and assignment, whose state it shares under the coordinator's lock
(``_lock``, ``_peers``, ``_leases``, ``_lease_of``, ``_seeding``, ``run``, ``_progress``, ``_progress_by_peer``,
``_session_base``, ``_dirty_*``, ``_expiry_heap``, ``_live_addrs``, ``view``, ``settings``, ``clock``,
``counters``, ``issuer``, ``_durable``, ``_issue``, ``_start_drain``, ``_story_batch``, and
:class:`coordinator.story.Story`'s ``_record_evaluations``, ``_count_rounds`` and ``take_totals``).
"""

from __future__ import annotations

import copy
import dataclasses
import heapq
from typing import Optional, Sequence

from coordinator.errors import InvalidArgument, LeaseNotFound
from coordinator.reachability import dialable
from coordinator.records import PIPELINE_MODES, Capabilities, Lease, ModuleProgress, PeerRecord
from coordinator.results import HeartbeatResult, PathEvaluation, ProgressReport
from coordinator.store import WriteBatch
from coordinator.view import ClusterView

__all__ = ["Leases"]

_MAX_SEEDED = 65536
"""The most paths one heartbeat may say it seeds."""


class Leases:
    """``heartbeat`` and ``take_dirty``, lease expiry and release for :class:`coordinator.core.Coordinator`."""

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
        by :meth:`check_evaluations`): validation bits per byte per path, from an archive peer only.
        ``measured``: ``tokens_per_s`` is a measurement, 0 included (what a stage server or trainer
        served); otherwise 0 means unchanged. ``capacity``: a stage server's tokens/s at full load (0:
        unknown). ``link_bps``: upload and download bytes/s the peer measured from its averaging
        rounds; each replaces the capabilities' figure (the join probe's) when > 0.
        ``exchange_overhead_s``: what its rounds' exchanges block it beyond their bytes at those rates
        (kept when > 0)."""
        with self._lock:
            lease = self._leases.get(lease_id)
            now = self.clock()
            if lease is None or lease.peer_id != peer_id or lease.expires_at <= now:
                self.counters["heartbeats_unknown_lease"] += 1
                raise LeaseNotFound(f"lease_id: no live lease {lease_id[:8]}... for {peer_id}; join again")
            for p in progress:
                if p.module_id not in self._module_ids:
                    raise InvalidArgument("progress.module_id", f"{p.module_id!r} is not a module of this run's lattice")
            peer = self._peers[peer_id]
            if evaluations:
                self._record_evaluations(peer, evaluations, now, self._story_batch)
            self.counters["heartbeats"] += 1
            lease.expires_at = now + self.settings.lease_timeout
            self._dirty_leases.add(lease_id)
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
            renew = self.issuer.needs_renewal(self._credential_expiry.get(peer_id, 0.0), now)
            result = HeartbeatResult(lease.expires_at - now, None if draining else assignment, draining,
                                     peer.drain_reason, self._issue(peer_id, now) if renew else b"",
                                     () if draining else self.plans_for(peer.assignment))
        if batch is not None:
            self._durable(batch)
        return result

    def take_dirty(self) -> WriteBatch:
        """Renewals and progress since the last call, for a group commit."""
        with self._lock:
            leases = self._leases
            batch = WriteBatch(
                peers={p: copy.copy(self._peers[p]) for p in self._dirty_peers},
                renewals={i: leases[i].expires_at for i in self._dirty_leases if i in leases},
                progress={k: copy.copy(self._progress[k]) for k in self._dirty_progress if k in self._progress},
            )
            self._dirty_peers = set()
            self._dirty_leases = set()
            self._dirty_progress = set()
            batch.merge(self._story_batch)
            self._story_batch = WriteBatch()
        return batch.merge(self.take_totals())

    def _restore_leases(self, now: float) -> WriteBatch:
        """After a restart: drop leases of peers that are gone, give every loaded lease at least
        ``restart_grace`` seconds, expire live peers without a lease, rebuild the cluster view and the
        expiry schedule. Returns the fixes to commit (under construction: no lock needed yet)."""
        fixes = WriteBatch(meta={"run_config_hash": self.run_hash, "run_id": self.run.run_id})
        for lease in list(self._leases.values()):
            peer = self._peers.get(lease.peer_id)
            if peer is None or peer.state not in ("active", "draining") or lease.peer_id in self._lease_of:
                del self._leases[lease.lease_id]
                fixes.deleted_leases.add(lease.lease_id)
                continue
            if lease.expires_at < now + self.settings.restart_grace:
                lease.expires_at = now + self.settings.restart_grace
                self._dirty_leases.add(lease.lease_id)
            self._lease_of[lease.peer_id] = lease.lease_id
            self._session_base[peer.peer_id] = (peer.tokens, peer.bytes_exchanged)
        for peer in self._peers.values():
            if peer.state in ("active", "draining") and peer.peer_id not in self._lease_of:
                peer.state = "expired"
                fixes.peers[peer.peer_id] = copy.copy(peer)
            if peer.state == "active" and peer.capabilities.multiaddrs and dialable(peer.reachability):
                self._live_addrs[peer.peer_id] = peer.capabilities.multiaddrs
        self.view = ClusterView.from_peers(p for p in self._peers.values() if p.state == "active")
        # (scheduled check time, lease id): a lease is looked at when its check time passes and, if a
        # heartbeat renewed it meanwhile, rescheduled; so a tick costs O(leases due), not O(leases).
        self._expiry_heap: list[tuple[float, str]] = [(l.expires_at, l.lease_id) for l in self._leases.values()]
        heapq.heapify(self._expiry_heap)
        return fixes

    def _due_leases(self, now: float) -> list[Lease]:
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

    def _release(self, peer: PeerRecord, batch: WriteBatch) -> None:
        """Drop the peer's lease and stop counting its work (the assignment stays as a rejoin hint)."""
        lease_id = self._lease_of.pop(peer.peer_id, None)
        if lease_id is not None:
            self._leases.pop(lease_id, None)
            self._dirty_leases.discard(lease_id)
            batch.deleted_leases.add(lease_id)
        self.view.remove(peer.peer_id)
        self._live_addrs.pop(peer.peer_id, None)
        self._seeding.pop(peer.peer_id, None)

    def check_seeded_paths(self, names: list[str]) -> frozenset[str]:
        """A heartbeat's ``seeded_paths`` as a set; :class:`InvalidArgument` for a name that is not a
        path of the lattice (written ``0-1``) or more names than the lattice has paths."""
        lat = self.run.lattice
        if len(names) > min(lat.num_paths, _MAX_SEEDED):
            raise InvalidArgument("seeded_paths", f"{len(names)} paths, more than the lattice's {lat.num_paths}")
        for name in names:
            parts = name.split("-")
            if (len(name) > 64 or len(parts) != lat.levels or not all(p.isdigit() and len(p) < 6 for p in parts)
                    or any(int(p) >= lat.modules_per_level for p in parts) or "-".join(str(int(p)) for p in parts) != name):
                raise InvalidArgument("seeded_paths", f"{name[:32]!r} is not a path of this run's lattice (e.g. 0-1)")
        return frozenset(names)

    def _record_served(self, peer: PeerRecord, tokens_per_s: float, capacity: float) -> None:
        """A stage server's or trainer's measured tokens/s served (and capacity); under the lock."""
        capacity = capacity or peer.capacity_tokens_per_s
        if (tokens_per_s, capacity) == (peer.served_tokens_per_s, peer.capacity_tokens_per_s):
            return
        peer.served_tokens_per_s, peer.capacity_tokens_per_s = tokens_per_s, capacity
        if peer.state == "active":
            self.view.set_tokens_per_s(peer.peer_id, tokens_per_s, capacity)
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
        self._count_rounds(peer, {m: r.round for m, r in mine.items()}, {p.module_id: p.round for p in progress})
        for p in progress:
            key = (peer.peer_id, p.module_id)
            row = ModuleProgress(peer.peer_id, p.module_id, p.round, p.tokens, p.loss, now)
            self._progress[key] = row
            mine[p.module_id] = row
            self._dirty_progress.add(key)
            self.loss_watch.report(peer.peer_id, p.module_id, p.round, p.loss,
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
                self.view.set_tokens_per_s(peer.peer_id, tokens_per_s)
        self._dirty_peers.add(peer.peer_id)
