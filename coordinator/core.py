"""The coordinator's state machine: admission, assignment, drain, expiry, rebalancing and exchange plans.

:class:`Coordinator` is synchronous and transport-free; the gRPC servicer translates protos into its
calls. Time comes from an injected clock (wall-clock seconds, because leases outlive restarts), so
tests drive expiry and rebalancing without sleeping. Decisions are delegated to the pure functions
of :mod:`coordinator.scheduler`. It owns the peer table, the cluster view and admission, and builds
the collaborators that answer the rest, each given what it needs of that state and one lock: the lease
table and heartbeats (:mod:`coordinator.leases`), reports and bans (:mod:`coordinator.moderation`),
totals and history (:mod:`coordinator.story`), each module's exchange plan (:mod:`coordinator.planning`),
whom a joining peer dials first (:mod:`coordinator.bootstrap`).

Durability: joins, leaves, drains, expiries and assignment changes are handed to ``durable`` (which
returns once they are committed) before the call returns; heartbeat renewals and progress are
committed in groups (:meth:`Coordinator.take_dirty`).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import logging
import threading
import time
from typing import Callable, Iterator, Mapping, Optional, Sequence

from coordinator.bans import BANS_META_KEY, BanBook
from coordinator.bootstrap import Bootstrap
from coordinator.credentials import CredentialBook, CredentialIssuer
from coordinator.health import HealthRules, LossWatch
from coordinator.history import History
from coordinator.errors import Banned, Incompatible, InvalidArgument, LeaseNotFound, NoFit, Overloaded, PeerNotFound
from coordinator.leases import Heartbeats, LeaseTable
from coordinator.moderation import Moderation
from coordinator.planner import ModulePlan
from coordinator.planning import Planning
from coordinator.reachability import UNREACHABLE, Reachability, dialable
from coordinator.records import MODE_ARCHIVE, Assignment, Capabilities, Lease, ModuleProgress, Move, PeerRecord
from coordinator.results import (HeartbeatResult, JoinResult, PathEvaluation, ProgressReport, ReportResult,
                                 StatusView)
from coordinator.pipelines import rebalance_pipelines
from coordinator.scheduler import assign_peer, rebalance
from coordinator.settings import CoordinatorSettings
from coordinator.store import Store, WriteBatch
from coordinator.versions import PeerVersions
from coordinator.story import Story, load_totals
from coordinator.view import ClusterView
from models.config import RunConfig
from models.errors import HivepathError

__all__ = ["Coordinator", "JoinResult", "HeartbeatResult", "ProgressReport", "ReportResult", "StatusView",
           "key_fingerprint"]

log = logging.getLogger(__name__)

Clock = Callable[[], float]


class _LastMoved(Mapping):
    def __init__(self, peers: dict[str, PeerRecord]):
        self._peers = peers

    def __getitem__(self, peer_id: str) -> float:
        return self._peers[peer_id].last_moved

    def __iter__(self) -> Iterator[str]:
        return iter(self._peers)

    def __len__(self) -> int:
        return len(self._peers)


class _Caps(_LastMoved):
    def __getitem__(self, peer_id: str) -> Capabilities:  # type: ignore[override]
        return self._peers[peer_id].capabilities


def key_fingerprint(public_key: bytes) -> str:
    """What binds a peer id to its key: sha256 of the libp2p public key (empty when none was sent)."""
    return hashlib.sha256(public_key).hexdigest()[:32] if public_key else ""


class Coordinator:
    """Admission, leases and work for one run (DiPaCo lattice, DiLoCo rounds). Heartbeats are answered
    by :class:`coordinator.leases.Heartbeats` over a :class:`coordinator.leases.LeaseTable`, reports
    and bans by :class:`coordinator.moderation.Moderation`, totals and history are kept by
    :class:`coordinator.story.Story`, exchange plans by :class:`coordinator.planning.Planning`; the
    coordinator's methods of the same names delegate to them."""

    def __init__(
        self,
        run: RunConfig,
        settings: CoordinatorSettings,
        store: Store,
        clock: Clock = time.time,
        durable: Optional[Callable[[WriteBatch], None]] = None,
        issuer: Optional[CredentialIssuer] = None,
    ):
        self.run = run
        self.settings = settings
        self.store = store
        self.clock = clock
        self._durable = durable or store.apply
        self.run_json = run.to_json()
        self.run_hash = run.content_hash()
        self.lattice_hash = run.lattice.content_hash()
        self._lock = threading.RLock()
        self.last_rebalance_reason = "not run yet"
        self.started_at = clock()
        if issuer is None:
            from coordinator.credentials import load_or_create_key

            issuer = CredentialIssuer(load_or_create_key(None), run.run_id, settings.credential_timeout)
        self.issuer = issuer
        self._credentials = CredentialBook(issuer)
        self.peer_versions = PeerVersions()
        """The release each peer stated (:mod:`coordinator.versions`), for the status page and drains."""

        state = store.load()
        stored_hash = state.meta.get("run_config_hash")
        if stored_hash is not None and stored_hash != self.run_hash:
            raise HivepathError(
                f"the database belongs to run '{state.meta.get('run_id')}' (config hash {stored_hash}) but the run "
                f"config hashes to {self.run_hash}; use the run config it was created with or a new --db"
            )
        self._peers: dict[str, PeerRecord] = state.peers
        self.counters, self.module_rounds = load_totals(state.meta)
        self.history = History(state.history, settings.history_points)
        self.loss_watch = LossWatch(HealthRules())
        """Each peer's reported loss per module, for the divergence signal (:mod:`coordinator.health`)."""
        self.bans = BanBook(state.meta.get(BANS_META_KEY))
        self._bootstrap = Bootstrap(self._peers, settings)
        self._leases = LeaseTable(state.leases, settings)
        fixes = self._restore(clock())
        self.view = ClusterView.from_peers(p for p in self._peers.values() if p.state == "active")

        self._story = Story(lock=self._lock, clock=clock, lattice=run.lattice, peers=self._peers,
                            leased=self._leases.holders, counters=self.counters, module_rounds=self.module_rounds,
                            history=self.history, rules=self.loss_watch.rules)
        self._planning = Planning(meta=state.meta, run=run, settings=settings, peers=self._peers, view=self.view,
                                  module_rounds=self.module_rounds, counters=self.counters,
                                  apply_move=self._apply_move)
        self._heartbeats = Heartbeats(lock=self._lock, clock=clock, settings=settings, run=run, peers=self._peers,
                                      leases=self._leases, progress=state.progress, view=self.view,
                                      counters=self.counters, loss_watch=self.loss_watch, story=self._story,
                                      credentials=self._credentials, plans_for=self._planning.plans_for,
                                      start_drain=self._start_drain, durable=self._durable)
        self._moderation = Moderation(lock=self._lock, clock=clock, settings=settings, run=run, peers=self._peers,
                                      leases=self._leases, bans=self.bans, credentials=self._credentials,
                                      counters=self.counters, release=self._release, durable=self._durable)

        for p in state.progress.values():  # a database written before module rounds were kept
            self.module_rounds[p.module_id] = max(self.module_rounds.get(p.module_id, 0), p.round)
        self._durable(fixes)
        if self._leases:
            log.info("restored %d peers and %d leases (grace %.0fs)", len(self._peers), len(self._leases),
                     settings.restart_grace)

    def _restore(self, now: float) -> WriteBatch:
        """After a restart: restore the leases (:meth:`LeaseTable.restore`), expire live peers without
        one, and gather the live peers' bootstrap addresses. Returns the fixes to commit (under
        construction: no lock needed yet)."""
        fixes = WriteBatch(meta={"run_config_hash": self.run_hash, "run_id": self.run.run_id},
                           deleted_leases=self._leases.restore(self._peers, now))
        for peer in self._peers.values():
            if peer.state in ("active", "draining") and not self._leases.holds(peer.peer_id):
                peer.state = "expired"
                fixes.peers[peer.peer_id] = copy.copy(peer)
            if peer.state == "active" and peer.capabilities.multiaddrs and dialable(peer.reachability):
                self._bootstrap.add(peer.peer_id, peer.capabilities.multiaddrs)
        return fixes

    # -- peers' calls -------------------------------------------------------------------------

    def join(self, peer_id: str, public_key: bytes, caps: Capabilities, manifest_hash: str = "",
             archive: bool = False, reachability: Reachability = Reachability(), role: str = "",
             follows_plans: bool = True) -> JoinResult:
        """Admit ``peer_id`` (token already checked) and give it a lease and work; durable on return.
        ``reachability``: the dial-back verdict (:mod:`coordinator.reachability`); an unreachable or
        relayed peer's addresses are never handed out as bootstrap peers, and an unreachable one is
        handed relays (reachable peers, the least loaded first).

        An ``archive`` peer gets a lease but no work; its addresses are handed out first as DHT
        bootstrap peers, since it is the longest-lived peer of a run. ``role``: the role the peer asks
        for (:data:`coordinator.pipelines.ROLES`; '' lets the scheduler decide); refused when it does
        not fit, never moved by rebalancing. ``follows_plans``: the peer reads exchange plans (it
        states coordinator protocol 1.2 or later), so the planner may change its modules' codec."""
        want = self.run.data.manifest_hash
        if want and manifest_hash and manifest_hash != want:
            self.counters["rejected_incompatible"] += 1
            raise Incompatible(
                f"manifest_hash: the peer's data has manifest {manifest_hash} but the run trains on {want}; "
                "prepare the run's data (hivepath data prepare) and join again"
            )
        fingerprint = key_fingerprint(public_key)
        batch = WriteBatch()
        with self._lock:
            now = self.clock()
            ban = self.bans.is_banned(peer_id)
            if ban is not None:
                self.counters["rejected_banned"] += 1
                raise Banned(f"peer_id: {peer_id} is banned from this run ({ban.reason}); "
                             "ask the run's operator (hivepath coordinator unban)")
            peer = self._peers.get(peer_id)
            if peer is not None and peer.key_fingerprint and peer.key_fingerprint != fingerprint:
                self.counters["rejected_key"] += 1
                raise InvalidArgument("peer_id", f"{peer_id} is registered with a different public key; "
                                                 "each peer needs its own identity")
            if len(self._leases) >= self.settings.max_peers and not self._leases.holds(peer_id):
                raise Overloaded(f"the coordinator holds {len(self._leases)} leases, its max_peers; try again later")
            previous = peer.assignment if peer is not None else None
            if peer is not None:
                self._release(peer, batch)
            version = (previous.version + 1) if previous is not None else 1
            if archive:
                reason = "archive peer: follows every module's rounds and trains nothing"
                assignment = Assignment(mode=MODE_ARCHIVE, reason=reason, version=version)
            else:
                assignment, reason = assign_peer(
                    now, caps, self.view, self.run, self.settings, previous=previous, version=version, role=role,
                )
            if assignment is None:
                self.counters["rejected_no_fit"] += 1
                refusal = NoFit(f"capabilities.memory_bytes: {reason}")
                if peer is None:
                    raise refusal
                peer.state = "expired" if peer.state in ("active", "draining") else peer.state
                batch.peers[peer_id] = copy.copy(peer)
            else:
                refusal = None
                lease, assignment, initial, rejoined = self._admit(peer_id, peer, fingerprint, caps, assignment,
                                                                   previous, now, batch, reachability, role)
                self._peers[peer_id].follows_plans = follows_plans
                credential = self._credentials.issue(peer_id, now)
                relays = (self._bootstrap.relays_for(peer_id, self.view.assignments)
                          if reachability.state == UNREACHABLE else [])
        self._durable(batch)
        if refusal is not None:  # the old lease was released: that is recorded, then the join refused
            raise refusal
        log.info("peer %s joined: %s (%s)", peer_id, assignment.label(), reason)
        return JoinResult(copy.copy(lease), assignment, initial, rejoined, credential, relays)

    def leave(self, lease_id: str, peer_id: str, reason: str = "") -> None:
        """The peer gives its lease back; its work is freed at once. Durable on return."""
        batch = WriteBatch()
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None or lease.peer_id != peer_id:
                raise LeaseNotFound(f"lease_id: no live lease {lease_id[:8]}... for {peer_id}")
            peer = self._peers[peer_id]
            self._release(peer, batch)
            peer.state = "left"
            batch.peers[peer_id] = copy.copy(peer)
            self.counters["leaves"] += 1
        self._durable(batch)
        log.info("peer %s left%s", peer_id, f": {reason}" if reason else "")

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
        """Renew the lease and record progress; renewals are durable at the next flush, not on return
        (:meth:`Heartbeats.heartbeat`)."""
        return self._heartbeats.heartbeat(lease_id, peer_id, progress, assignment_version, tokens_per_s,
                                          bytes_exchanged, preempting, seeded_paths, evaluations, measured, capacity,
                                          link_bps, exchange_overhead_s)

    def report(self, lease_id: str, reporter: str, suspect: str, module_id: str, round_no: int,
               reason: str) -> ReportResult:
        """A peer reports ``suspect`` for one module's round (:meth:`Moderation.report`)."""
        return self._moderation.report(lease_id, reporter, suspect, module_id, round_no, reason)

    def report_seeder(self, lease_id: str, reporter: str, suspect: str, manifest_hash: str, file: str, chunk: int,
                      reason: str) -> ReportResult:
        """A peer reports a seeder's bad chunk (:meth:`Moderation.report_seeder`)."""
        return self._moderation.report_seeder(lease_id, reporter, suspect, manifest_hash, file, chunk, reason)

    def check_seeded_paths(self, names: list[str]) -> frozenset[str]:
        """A heartbeat's ``seeded_paths``, checked (:meth:`Heartbeats.check_seeded_paths`)."""
        return self._heartbeats.check_seeded_paths(names)

    def check_evaluations(self, evaluations: Sequence[PathEvaluation]) -> None:
        """A heartbeat's ``evaluations``, checked (:meth:`Story.check_evaluations`)."""
        self._story.check_evaluations(evaluations)

    # -- operator -----------------------------------------------------------------------------

    def drain(self, peer_id: str, reason: str = "") -> str:
        """Tell ``peer_id`` to finish its round and leave; its work is handed to others now."""
        batch = WriteBatch()
        with self._lock:
            peer = self._peers.get(peer_id)
            if peer is None:
                raise PeerNotFound(f"peer_id: no peer {peer_id} has joined this run")
            if peer.state == "active":
                self._start_drain(peer, reason or "drained by the operator", batch)
            state = peer.state
        self._durable(batch)
        return state

    def ban(self, peer_id: str, reason: str = "") -> str:
        """Ban ``peer_id`` (:meth:`Moderation.ban`)."""
        return self._moderation.ban(peer_id, reason)

    def unban(self, peer_id: str) -> str:
        """Lift a ban (:meth:`Moderation.unban`)."""
        return self._moderation.unban(peer_id)

    # -- time ---------------------------------------------------------------------------------

    def tick(self) -> list[str]:
        """Expire lapsed leases (their work is freed) and rebalance; returns what happened."""
        events: list[str] = []
        batch = WriteBatch()
        with self._lock:
            now = self.clock()
            for lease in self._leases.due(now):
                peer = self._peers[lease.peer_id]
                self._release(peer, batch)
                peer.state = "expired"
                batch.peers[peer.peer_id] = copy.copy(peer)
                self.counters["expirations"] += 1
                events.append(f"lease of {peer.peer_id} expired")
            moves = 0
            for decide in (rebalance, rebalance_pipelines):  # paths first, then pipeline roles
                while moves < self.settings.max_moves_per_tick:
                    move, reason = decide(now, _LastMoved(self._peers), _Caps(self._peers), self.view, self.run,
                                          self.settings)
                    if decide is rebalance or move is not None or self.view.stage_peers or self.view.trainer_peers:
                        self.last_rebalance_reason = reason
                    if move is None:
                        break
                    moves += 1
                    events.append(self._apply_move(move, now, batch))
            events.extend(self._planning.plan_pass(now, batch, moves < self.settings.max_moves_per_tick))
        self._durable(batch)
        for e in events:
            log.info("%s", e)
        return events

    def take_dirty(self) -> WriteBatch:
        """Renewals, progress, reported history points and changed totals since the last call, for a
        group commit."""
        with self._lock:
            batch = self._heartbeats.take_dirty().merge(self._story.take_points())
        return batch.merge(self._story.take_totals())

    def sample_history(self) -> WriteBatch:
        """One point of each run-wide series (:meth:`Story.sample_history`)."""
        return self._story.sample_history()

    def take_totals(self) -> WriteBatch:
        """The counters and module rounds, when they changed (:meth:`Story.take_totals`)."""
        return self._story.take_totals()

    def _apply_move(self, move: Move, now: float, batch: WriteBatch) -> str:
        """Give a moved peer its new work (under the lock); returns the event, in words."""
        peer = self._peers[move.peer_id]
        self.view.remove(peer.peer_id)
        peer.assignment = move.assignment
        peer.served_tokens_per_s = peer.capacity_tokens_per_s = 0.0  # measured anew in the new role
        self.view.add(peer.peer_id, move.assignment, peer.counted_tokens_per_s())
        peer.last_moved = now
        batch.peers[peer.peer_id] = copy.copy(peer)
        self.counters["moves"] += 1
        return f"{peer.peer_id}: {move.reason}"

    def count(self, name: str, n: int = 1) -> None:
        """Add ``n`` to the counter ``name`` (transport events the servicer sees: streams, probes)."""
        with self._lock:
            self.counters[name] += n

    # -- reads: copies taken under the lock, so a reader never sees a half-applied change -------

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
        return self._heartbeats.progress_of(peer_id)

    def status_view(self) -> StatusView:
        """A consistent copy of what the status page shows, taken under the lock."""
        with self._lock:
            return StatusView(
                now=self.clock(),
                peers=[copy.copy(p) for p in self._peers.values()],
                lease_expiry={l.peer_id: l.expires_at for l in self._leases.values()},
                progress=self._heartbeats.progress_by_peer(),
                counters=dict(self.counters),
                rebalance_reason=self.last_rebalance_reason,
                seeding=self._heartbeats.seeding(),
                banned=sorted(self.bans.bans),
                module_rounds=dict(self.module_rounds),
                latest_bpb=self._story.latest_bpb(),
                plans={m: list(p) for m, p in self._planning.plans.items()},
                plan_reasons=dict(self._planning.plan_reasons),
                link_reason=self._planning.link_reason,
                bpb_rises=self._story.bpb_rises(),
                loss_divergences=self.loss_watch.diverging({p.peer_id for p in self._peers.values()
                                                            if p.state == "active"}),
            )

    def history_series(self) -> dict[str, list[tuple[float, float]]]:
        """Every history series (:mod:`coordinator.history`), copied under the lock."""
        return self._story.history_series()

    def initial_peers(self) -> list[str]:
        """DHT bootstrap multiaddrs of the most recently joined live peers."""
        with self._lock:
            return self._bootstrap.initial_peers("", self.view.assignments)

    def plans_for(self, assignment: Optional[Assignment]) -> tuple[ModulePlan, ...]:
        """The plans of the modules ``assignment`` trains (:meth:`Planning.plans_for`; under the lock)."""
        return self._planning.plans_for(assignment)

    @property
    def plans(self) -> dict[str, list[ModulePlan]]:
        """module id -> its latest plans, oldest first (:class:`coordinator.planning.Planning` owns them)."""
        return self._planning.plans

    @property
    def plan_reasons(self) -> dict[str, str]:
        """module id -> what the latest planning pass said about it."""
        return self._planning.plan_reasons

    @property
    def link_reason(self) -> str:
        """What the latest planning pass found about links that alone hold a module back."""
        return self._planning.link_reason

    # -- internals ----------------------------------------------------------------------------

    def _admit(self, peer_id: str, peer: Optional[PeerRecord], fingerprint: str, caps: Capabilities,
               assignment: Assignment, previous: Optional[Assignment], now: float,
               batch: WriteBatch, reachability: Reachability = Reachability(),
               role: str = "") -> tuple[Lease, Assignment, list[str], bool]:
        """Record an admitted peer with its new lease and work (under the lock)."""
        rejoined = peer is not None
        if peer is None:
            peer = PeerRecord(peer_id, fingerprint, caps, first_joined=now)
            self._peers[peer_id] = peer
        if previous is not None and previous.same_work(assignment):
            assignment = dataclasses.replace(assignment, version=previous.version)
        peer.key_fingerprint = peer.key_fingerprint or fingerprint
        peer.capabilities = caps
        peer.state = "active"
        peer.assignment = assignment
        peer.requested_role = role
        peer.served_tokens_per_s = peer.capacity_tokens_per_s = 0.0  # a pipeline role is measured anew
        peer.last_joined = peer.last_seen = now
        peer.joins += 1
        peer.drain_reason = ""
        peer.reachability, peer.reachable_addr, peer.observed_addr = reachability.state, reachability.addr, reachability.observed
        lease = self._leases.grant(peer_id, now, batch)
        self._heartbeats.start_session(peer)
        self.view.add(peer_id, assignment, peer.counted_tokens_per_s())
        if role:
            self.view.pinned.add(peer_id)
        initial = self._bootstrap.initial_peers(peer_id, self.view.assignments)
        self._bootstrap.drop(peer_id)
        if caps.multiaddrs and dialable(reachability.state):  # nobody could bootstrap from it otherwise
            self._bootstrap.add(peer_id, caps.multiaddrs)
        batch.peers[peer_id] = copy.copy(peer)
        self.counters["rejoins" if rejoined else "joins"] += 1
        return lease, assignment, initial, rejoined

    def _release(self, peer: PeerRecord, batch: WriteBatch) -> None:
        """Drop the peer's lease and stop counting its work (the assignment stays as a rejoin hint);
        under the lock."""
        self._leases.release(peer.peer_id, batch)
        self.view.remove(peer.peer_id)
        self._bootstrap.drop(peer.peer_id)
        self._heartbeats.stop_seeding(peer.peer_id)

    def _start_drain(self, peer: PeerRecord, reason: str, batch: WriteBatch) -> None:
        self.view.remove(peer.peer_id)
        self._bootstrap.drop(peer.peer_id)
        peer.state = "draining"
        peer.drain_reason = reason
        batch.peers[peer.peer_id] = copy.copy(peer)
        self.counters["drains"] += 1
        log.info("draining %s: %s", peer.peer_id, reason)
