"""The coordinator's state machine: admission, assignment, drain, expiry, rebalancing and exchange plans.

:class:`Coordinator` is synchronous and transport-free; the gRPC servicer translates protos into its
calls. Time comes from an injected clock (wall-clock seconds, because leases outlive restarts), so
tests drive expiry and rebalancing without sleeping. Decisions are delegated to the pure functions
of :mod:`coordinator.scheduler`. Its other parts share its state under one lock: leases and
heartbeats (:mod:`coordinator.leases`), reads (:mod:`coordinator.reading`), reports and bans
(:mod:`coordinator.moderation`), each module's exchange plan (:mod:`coordinator.planning`).

Durability: joins, leaves, drains, expiries and assignment changes are handed to ``durable`` (which
returns once they are committed) before the call returns; heartbeat renewals and progress are
committed in groups (:meth:`Coordinator.take_dirty`).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import heapq
import logging
import secrets
import threading
import time
from collections import OrderedDict
from typing import Callable, Iterator, Mapping, Optional

from coordinator.bans import BANS_META_KEY, BanBook
from coordinator.credentials import CredentialIssuer
from coordinator.health import HealthRules, LossWatch
from coordinator.history import History
from coordinator.errors import Banned, Incompatible, InvalidArgument, LeaseNotFound, NoFit, Overloaded, PeerNotFound
from coordinator.leases import Leases
from coordinator.moderation import Moderation
from coordinator.planning import Planning
from coordinator.reachability import RELAYS_PER_PEER, UNREACHABLE, Reachability, dialable, relay_load
from coordinator.reading import Reading
from coordinator.records import MODE_ARCHIVE, Assignment, Capabilities, Lease, ModuleProgress, Move, PeerRecord
from coordinator.results import HeartbeatResult, JoinResult, ProgressReport, ReportResult, StatusView
from coordinator.pipelines import rebalance_pipelines
from coordinator.scheduler import assign_peer, rebalance
from coordinator.settings import CoordinatorSettings
from coordinator.store import Store, WriteBatch
from coordinator.versions import PeerVersions
from coordinator.story import Story, load_totals
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


class Coordinator(Leases, Reading, Moderation, Story, Planning):
    """Admission, leases and work for one run (DiPaCo lattice, DiLoCo rounds); heartbeats come from
    :class:`coordinator.leases.Leases`, reads from :class:`coordinator.reading.Reading`, reports and
    bans from :class:`coordinator.moderation.Moderation`, totals and history from
    :class:`coordinator.story.Story`."""

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
        self._module_ids = frozenset(run.lattice.module_ids())
        self._lock = threading.RLock()
        self.last_rebalance_reason = "not run yet"
        self.started_at = clock()
        if issuer is None:
            from coordinator.credentials import load_or_create_key

            issuer = CredentialIssuer(load_or_create_key(None), run.run_id, settings.credential_timeout)
        self.issuer = issuer
        self._credential_expiry: dict[str, float] = {}
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
        self._story_batch = WriteBatch()
        """History points from reports (evaluations), committed with the next group commit."""
        self.loss_watch = LossWatch(HealthRules())
        """Each peer's reported loss per module, for the divergence signal (:mod:`coordinator.health`)."""
        self.bans = BanBook(state.meta.get(BANS_META_KEY))
        self._init_plans(state.meta)
        self._leases: dict[str, Lease] = state.leases
        self._lease_of: dict[str, str] = {}
        self._progress: dict[tuple[str, str], ModuleProgress] = state.progress
        self._progress_by_peer: dict[str, dict[str, ModuleProgress]] = {}
        for (peer_id, module_id), p in self._progress.items():
            self._progress_by_peer.setdefault(peer_id, {})[module_id] = p
        self._session_base: dict[str, tuple[int, int]] = {}
        self._dirty_leases: set[str] = set()
        self._dirty_peers: set[str] = set()
        self._dirty_progress: set[tuple[str, str]] = set()
        self._live_addrs: OrderedDict[str, tuple[str, ...]] = OrderedDict()
        self._seeding: dict[str, frozenset[str]] = {}
        """peer id -> paths whose shards it seeds, from its heartbeats (memory only: status page)."""

        for p in self._progress.values():  # a database written before module rounds were kept
            self.module_rounds[p.module_id] = max(self.module_rounds.get(p.module_id, 0), p.round)
        fixes = self._restore_leases(clock())
        self._durable(fixes)
        if self._leases:
            log.info("restored %d peers and %d leases (grace %.0fs)", len(self._peers), len(self._leases),
                     settings.restart_grace)

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
            if len(self._leases) >= self.settings.max_peers and peer_id not in self._lease_of:
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
                credential = self._issue(peer_id, now)
                relays = self._relays_for(peer_id) if reachability.state == UNREACHABLE else []
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

    # -- time ---------------------------------------------------------------------------------

    def tick(self) -> list[str]:
        """Expire lapsed leases (their work is freed) and rebalance; returns what happened."""
        events: list[str] = []
        batch = WriteBatch()
        with self._lock:
            now = self.clock()
            for lease in self._due_leases(now):
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
            events.extend(self._plan_pass(now, batch, moves < self.settings.max_moves_per_tick))
        self._durable(batch)
        for e in events:
            log.info("%s", e)
        return events

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
        lease = Lease(secrets.token_hex(16), peer_id, now + self.settings.lease_timeout)
        self._leases[lease.lease_id] = lease
        heapq.heappush(self._expiry_heap, (lease.expires_at, lease.lease_id))
        self._lease_of[peer_id] = lease.lease_id
        self._session_base[peer_id] = (peer.tokens, peer.bytes_exchanged)
        self._progress_by_peer.pop(peer_id, None)
        self.view.add(peer_id, assignment, peer.counted_tokens_per_s())
        if role:
            self.view.pinned.add(peer_id)
        initial = self._initial_peers(peer_id)
        self._live_addrs.pop(peer_id, None)
        if caps.multiaddrs and dialable(reachability.state):  # nobody could bootstrap from it otherwise
            self._live_addrs[peer_id] = caps.multiaddrs
            self._live_addrs.move_to_end(peer_id)
        batch.peers[peer_id] = copy.copy(peer)
        batch.leases[lease.lease_id] = copy.copy(lease)
        self._dirty_leases.discard(lease.lease_id)
        self.counters["rejoins" if rejoined else "joins"] += 1
        return lease, assignment, initial, rejoined

    def _initial_peers(self, joining: str) -> list[str]:
        out: list[str] = []
        archives = [p for p in self._live_addrs if (a := self.view.assignments.get(p)) and a.mode == MODE_ARCHIVE]
        for peer_id in archives + [p for p in reversed(self._live_addrs) if p not in archives]:
            if len(out) >= self.settings.initial_peers:
                break
            if peer_id == joining:
                continue
            # every address: the first may be loopback inside a container, useless to anyone else
            for addr in self._live_addrs[peer_id]:
                out.append(_with_peer_id(addr, peer_id))
        return out

    def _relays_for(self, joining: str) -> list[str]:
        """One multiaddr each of the :data:`RELAYS_PER_PEER` live reachable peers carrying the fewest
        relayed peers (archives first among equals: they live longest); under the lock."""
        load = relay_load([p.reachable_addr for p in self._peers.values()
                           if p.state == "active" and p.peer_id != joining])
        archives = {p for p in self._live_addrs if (a := self.view.assignments.get(p)) and a.mode == MODE_ARCHIVE}
        candidates = [p for p in self._live_addrs if p != joining and self._peers[p].reachable_addr]
        candidates.sort(key=lambda p: (load.get(p, 0), p not in archives))
        return [_with_peer_id(self._peers[p].reachable_addr, p) for p in candidates[:RELAYS_PER_PEER]]

    def _issue(self, peer_id: str, now: float) -> bytes:
        cred = self.issuer.issue(peer_id, now)
        self._credential_expiry[peer_id] = cred.expires_at
        return cred.encode()

    def _start_drain(self, peer: PeerRecord, reason: str, batch: WriteBatch) -> None:
        self.view.remove(peer.peer_id)
        self._live_addrs.pop(peer.peer_id, None)
        peer.state = "draining"
        peer.drain_reason = reason
        batch.peers[peer.peer_id] = copy.copy(peer)
        self.counters["drains"] += 1
        log.info("draining %s: %s", peer.peer_id, reason)


def _with_peer_id(addr: str, peer_id: str) -> str:
    """``addr`` as others dial it: ending in ``/p2p/<peer id>``."""
    return addr if "/p2p/" in addr else f"{addr}/p2p/{peer_id}"
