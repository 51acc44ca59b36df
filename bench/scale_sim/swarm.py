"""The simulated swarm: the real coordinator and the real DHT records, a modelled network and clock.

Real code, called in-process: :class:`coordinator.Coordinator` (admission, leases, heartbeats,
drains on preemption notice, expiry and reassignment in ``tick``, rebalancing) on a real
:class:`coordinator.SQLiteStore` with its group commits; the record types, key builders and parser
of :mod:`peer.network.records`; the bandwidth-proportional partition of
:func:`peer.averaging.partition.part_bounds`; the exchange size of
:func:`coordinator.scheduler.exchange_bytes`.

Modelled (``docs/BENCHMARKS.md`` lists them): compute time (H steps at the peer's tokens/s, cut at
the first whole step past ``round_seconds``, as ``DiLoCoOptimizer.step`` checks the time budget after
each inner step), link transfer times (bytes over a bandwidth, plus a fixed latency), the group
decision of :class:`peer.averaging.matchmaking.Matchmaker` (a group closes a ``POLL`` after every
expected holder has declared, when the members' next reads see it, or at the gather deadline; its
leader is the smallest declared peer id that accepts connections; late declarers fail the round and
re-sync), and an exchange that loses a member ending at the round's deadline (the reducer waits for
it, :mod:`peer.averaging.allreduce`).

Re-alignment after a miss is modelled as the real trainer does it: a member that failed a round
re-syncs (fetches the state from a holder ahead, :mod:`peer.diloco.resync`) and starts its next
round; while computing it checks every ``WAITING_POLL`` seconds whether another holder already
declared its modules' current round (:meth:`peer.averaging.net_averager.NetAverager.others_waiting`)
and, if one has, ends its round at once with the tokens it has (``DiLoCoOptimizer._others_waiting``;
the trainer ends it at its next inner step, which is not modelled: with it, the simulator fell into
rounds far shorter than ``round_seconds`` in churn runs, a mode not investigated; the real network
showed the same once, at 8 peers, before a paced declaration stopped pacing others):
the fastest member paces the round, so phases do not drift apart. As in the real code, only a member
that computed its whole round paces the others (``GroupDeclaration.paced``).

With ``max_group_size`` > 0 a module's holders split each round into
:func:`peer.network.records.group_buckets` groups by :func:`peer.network.records.group_bucket` (real
code), each with its own group key and holders-of-this-group key; a member reads the module's whole
holders key once a round to count the holders (the bucket count), and polls only its group's keys.
"""

from __future__ import annotations

import math
import random
import statistics
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from bench.scale_sim.dht import SimDHT
from bench.scale_sim.events import EventLoop
from bench.scale_sim.population import PREEMPT_NOTICE, PeerSpec, draw_peer, draw_peers
from coordinator import Coordinator, CoordinatorSettings, CredentialIssuer, SQLiteStore
from coordinator.errors import LeaseNotFound, NoFit
from coordinator.reachability import REACHABLE, UNREACHABLE, Reachability
from coordinator.records import Capabilities
from coordinator.results import ProgressReport
from coordinator.scheduler import exchange_bytes
from models.config import InnerConfig, LatticeConfig, OuterConfig, RunConfig
from peer.averaging.partition import part_bounds
from peer.network.records import (GroupDeclaration, HolderRecord, group_bucket, group_buckets, group_key, holders_key,
                                  records_from_value, to_value)

__all__ = ["SimConfig", "SimResult", "simulate", "run_config"]

GATHER = 0.2
"""Share of ``round_timeout`` a member gathers declarations (``Matchmaker.form_group``)."""
DEADLINE = 0.95
"""Share of ``round_timeout`` after which an exchange ends whatever happened."""
POLL = 0.1
"""Seconds between matchmaking reads of the DHT (``peer.averaging.matchmaking._POLL``)."""
LATENCY = 0.2
"""Seconds of round trips per exchange (join, begin, segment pipeline start): a model."""
WAITING_POLL = 1.0
"""Seconds between a computing member's checks for others waiting (``peer.averaging.net_averager.WAITING_POLL``)."""
LOSS_OF = {"start": "startup_lost_s", "churn": "churn_lost_s", "move": "move_lost_s", "": "straggler_lost_s"}
"""Where a failed round's compute and a state download are counted, by why the peer is new to its
modules: one of the first peers (the ramp, not measured as churn), a replacement for a departed peer
(churn), moved by the coordinator (rebalancing), or none (a straggler in steady state)."""


@dataclass(frozen=True)
class SimConfig:
    """One simulated run."""

    peers: int
    """Peers online at a time (each departure brings a replacement)."""
    levels: int = 2
    modules_per_level: int = 2
    duration: float = 1800.0
    """Simulated seconds measured, after ``ramp``."""
    ramp: float = 120.0
    """Seconds over which the first ``peers`` join (not measured)."""
    leave_per_hour: float = 0.1
    seed: int = 0
    inner_steps: int = 3000
    """H: large enough that every device ends its round at ``round_seconds`` (time-bounded rounds)."""
    round_seconds: float = 120.0
    round_timeout: float = 60.0
    max_group_size: int = 0
    """Split a module's holders into groups of about this size each round (0: one group a module)."""
    replace_departures: bool = True
    """Each departed peer is replaced by a new volunteer (the population stays at ``peers``)."""
    base_run: Optional[RunConfig] = None
    """The model, inner and coordinator settings to simulate (default: the 13M-parameter lattice of
    :func:`run_config`); its lattice shape and ``[outer]`` round settings are this config's."""
    peer_specs: tuple[PeerSpec, ...] = ()
    """Explicit peers instead of drawn ones (``peers`` must be their count): a real run's measured
    peers, arrival times and links, for calibration (``bench.scale_calibrate``)."""

    def __post_init__(self) -> None:
        if self.peer_specs and len(self.peer_specs) != self.peers:
            raise ValueError(f"peers={self.peers} but {len(self.peer_specs)} peer_specs")


@dataclass
class SimResult:
    """What one run measured (simulated seconds unless said)."""

    config: SimConfig
    figures: dict[str, Any]
    refusals: list[str] = field(default_factory=list)
    """The reason of every refused join."""
    unserved: list[str] = field(default_factory=list)
    """Peers that got neither work nor a refusal (should be empty)."""
    uncovered_spans: list[float] = field(default_factory=list)
    """Seconds each path was left without a path-mode peer after a departure (when peers outnumber paths)."""


def run_config(cfg: SimConfig) -> RunConfig:
    """A 13M-parameter-per-path lattice (d_model 512, 2 blocks a module) of the given shape, or
    ``cfg.base_run`` with the shape and round settings of ``cfg``."""
    if cfg.base_run is not None:
        return cfg.base_run.replace(
            lattice={"levels": cfg.levels, "modules_per_level": cfg.modules_per_level},
            outer={"inner_steps": cfg.inner_steps, "round_seconds": cfg.round_seconds,
                   "round_timeout": cfg.round_timeout})
    return RunConfig(
        run_id="scale",
        lattice=LatticeConfig(vocab_size=256, d_model=512, n_heads=8, blocks_per_module=2, seq_len=256,
                              levels=cfg.levels, modules_per_level=cfg.modules_per_level),
        inner=InnerConfig(batch_size=16),
        outer=OuterConfig(inner_steps=cfg.inner_steps, round_seconds=cfg.round_seconds,
                          round_timeout=cfg.round_timeout),
    )


class _Peer:
    __slots__ = ("spec", "lease_id", "assignment", "pending", "alive", "draining", "leaving", "credential",
                 "rounds", "round_start", "compute", "open", "failed", "cause", "progress", "tokens", "gone_at",
                 "seq", "declared", "buckets", "values")

    def __init__(self, spec: PeerSpec):
        self.spec = spec
        self.lease_id = ""
        self.assignment = None
        self.pending = None  # a new assignment, taken up at the next round start
        self.alive = True
        self.draining = False
        self.leaving = False
        self.credential = b""
        self.rounds: dict[str, int] = {}
        self.round_start = 0.0
        self.compute = 0.0
        self.open = 0  # module exchanges of this round not finished
        self.failed = 0
        self.cause = "start"  # why new to its modules (LOSS_OF): its first round's miss is counted there
        self.seq = 0  # rounds started: a scheduled declaration of an earlier round is void
        self.declared = False
        self.buckets: dict[str, Optional[int]] = {}
        self.values: Optional[tuple[dict, dict]] = None
        self.progress: list[ProgressReport] = []
        self.tokens = 0
        self.gone_at = math.inf


class _Group:
    __slots__ = ("module", "round_no", "bucket", "expected", "waiting", "declared", "first", "first_full", "closed",
                 "members", "end", "deadline", "finished", "lost_member", "close_at")

    def __init__(self, module: str, round_no: int, bucket: Optional[int]):
        self.module, self.round_no, self.bucket = module, round_no, bucket
        self.expected: set[str] = set()
        self.waiting = 0  # expected members that have not declared
        self.declared: dict[str, float] = {}
        self.first = math.inf
        self.first_full = math.inf  # the first declaration of a member that was not paced: it paces the others
        self.closed = False
        self.members: list[_Peer] = []
        self.end = math.inf
        self.deadline = math.inf
        self.finished = False
        self.lost_member = False
        self.close_at = math.inf


class Swarm:
    """One simulated run: peers, the coordinator, the DHT and the event loop."""

    def __init__(self, cfg: SimConfig, db_dir: Path):
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.loop = EventLoop()
        self.run = run_config(cfg)
        self.config_hash = self.run.content_hash()[:16]
        self.settings = CoordinatorSettings(sqlite_synchronous="NORMAL")
        self.store = SQLiteStore(db_dir / "coordinator.db", synchronous="NORMAL")
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        key = Ed25519PrivateKey.from_private_bytes(random.Random(cfg.seed).randbytes(32))
        issuer = CredentialIssuer(key, self.run.run_id, self.settings.credential_timeout)
        self.coord_cpu = 0.0
        self.coord = self._timed(Coordinator, self.run, self.settings, self.store, self.loop.now, None, issuer)
        self.dht = SimDHT(self.loop.now, self.loop.at)
        self.peers: dict[str, _Peer] = {}
        self.groups: dict[tuple[str, int, Optional[int]], _Group] = {}
        self.next_round: Counter[str] = Counter()
        self.next_index = cfg.peers
        self.c: Counter[str] = Counter()  # counts and sums measured in the window
        self.round_times: list[float] = []
        self.group_sizes: list[int] = []
        self.join_cpu: list[float] = []
        self.refusals: list[str] = []
        self.uncovered_since: dict[tuple, float] = {}
        self.uncovered_spans: list[float] = []
        lat = self.run.lattice
        self.numel = {m: lat.module_param_count(m) for m in lat.module_ids()}
        self.wire = {m: exchange_bytes(self.run, [m]) for m in lat.module_ids()}
        self.window = (cfg.ramp, cfg.ramp + cfg.duration)

    # -- measurement ----------------------------------------------------------------------------

    def _timed(self, fn, *args, **kwargs):
        t = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            self.coord_cpu += time.thread_time() - t

    def _in_window(self) -> bool:
        return self.window[0] <= self.loop.now() < self.window[1]

    def _add(self, name: str, value: float = 1.0) -> None:
        if self._in_window():
            self.c[name] += value

    # -- coordinator's own loops ----------------------------------------------------------------

    def _tick(self) -> None:
        events = self._timed(self.coord.tick)
        self._add("coordinator_moves", sum(1 for e in events if "rebalanced" in e or "moved" in e))
        self._check_coverage()
        self.loop.after(self.settings.tick_interval, self._tick)

    def _flush(self) -> None:
        self._timed(lambda: self.store.apply(self.coord.take_dirty()))
        self.loop.after(self.settings.flush_interval, self._flush)

    def _check_coverage(self) -> None:
        """Spans during which a path had no path-mode peer, measured once peers outnumber paths 2:1."""
        if self.cfg.peers < 2 * self.run.lattice.num_paths:
            return
        covered = self.coord.view.path_tps
        now = self.loop.now()
        for path in list(self.uncovered_since):
            if path in covered:
                self.uncovered_spans.append(now - self.uncovered_since.pop(path))
        if now >= self.cfg.ramp and len(covered) < self.run.lattice.num_paths:
            for path in self.run.lattice.paths():
                if path not in covered and path not in self.uncovered_since:
                    self.uncovered_since[path] = now

    # -- a peer's life --------------------------------------------------------------------------

    def arrive(self, spec: PeerSpec, replacement: bool = False) -> None:
        p = _Peer(spec)
        self.peers[spec.peer_id] = p
        caps = Capabilities(spec.device, spec.memory_bytes, spec.tokens_per_s, spec.upload_bps, spec.download_bps,
                            () if spec.natted else (f"/ip4/10.{spec.index >> 16 & 255}.{spec.index >> 8 & 255}."
                                                    f"{spec.index & 255}/tcp/31337",))
        reach = (Reachability(UNREACHABLE, "", f"198.51.100.{spec.index & 255}:4000") if spec.natted
                 else Reachability(REACHABLE, caps.multiaddrs[0], caps.multiaddrs[0]))
        t = time.thread_time()
        try:
            joined = self._timed(self.coord.join, spec.peer_id, spec.peer_id.encode(), caps, reachability=reach)
        except NoFit as e:
            self.refusals.append(str(e))
            p.alive = False
            return
        finally:
            self.join_cpu.append(time.thread_time() - t)
        self._add("joins")
        p.lease_id, p.assignment, p.credential = joined.lease.lease_id, joined.assignment, joined.credential
        self.loop.after(self.rng.uniform(0, self.settings.heartbeat_interval), self._heartbeat, p)
        depart = spec.lifetime
        if spec.leave_kind == "preempt":
            self.loop.after(max(0.0, depart - PREEMPT_NOTICE), self._notice, p)
        elif spec.leave_kind == "kill":
            self.loop.after(depart, self._kill, p)
        else:
            self.loop.after(depart, self._want_leave, p)
        self._bootstrap(p, p.assignment.module_ids, "churn" if replacement else "start")

    def _bootstrap(self, p: _Peer, module_ids, cause: str) -> None:
        """Fetch the modules' state (fp32) from their holders, then start a round."""
        p.cause = cause
        seconds = sum(4 * self.numel[m] for m in module_ids) / p.spec.download_bps + LATENCY
        self._add(LOSS_OF[cause], seconds)
        self._add("idle_s", seconds)
        for m in module_ids:
            p.rounds[m] = self.next_round[m]
        self.loop.after(seconds, self._start_round, p)

    def _heartbeat(self, p: _Peer, preempting: bool = False) -> None:
        if not p.alive or not p.lease_id:
            return
        version = p.pending.version if p.pending else p.assignment.version
        try:
            r = self._timed(self.coord.heartbeat, p.lease_id, p.spec.peer_id, p.progress, version,
                            p.spec.tokens_per_s, 0, preempting)
        except LeaseNotFound:
            self._add("lease_lost")
            return
        self._add("heartbeats")
        p.progress = []
        if r.assignment is not None:
            p.pending = r.assignment
        if r.drain:
            p.draining = True
        if not preempting:
            self.loop.after(self.settings.heartbeat_interval, self._heartbeat, p)

    def _notice(self, p: _Peer) -> None:
        if p.alive:
            self._heartbeat(p, preempting=True)
            self.loop.after(self.settings.heartbeat_interval, self._heartbeat, p)
            self.loop.after(PREEMPT_NOTICE, self._kill, p)

    def _want_leave(self, p: _Peer) -> None:
        p.leaving = True

    def _depart(self, p: _Peer) -> None:
        """Gone (any way): a replacement volunteer arrives."""
        p.alive = False
        p.gone_at = self.loop.now()
        self._add("departures")
        if not self.cfg.replace_departures:
            return
        spec = draw_peer(self.rng, self.next_index, self.loop.now(), self.cfg.leave_per_hour)
        self.next_index += 1
        self.loop.after(self.rng.expovariate(1 / 30.0), self.arrive, spec, True)

    def _kill(self, p: _Peer) -> None:
        if not p.alive:
            return
        if p.open:  # its round's compute is never averaged
            lost = p.compute if p.declared else self.loop.now() - p.round_start
            self._add("churn_lost_s", lost)
            self._add("idle_s", lost)
        for m in p.assignment.module_ids if p.assignment else ():
            g = self.groups.get((m, p.rounds.get(m, -1), p.buckets.get(m)))
            if g is not None and g.closed and not g.finished and p in g.members:
                self._lose_member(g)
        self._add("kills")
        self._depart(p)

    def _leave(self, p: _Peer) -> None:
        try:
            self._timed(self.coord.leave, p.lease_id, p.spec.peer_id, "simulated departure")
        except LeaseNotFound:
            pass
        self._depart(p)

    # -- rounds ---------------------------------------------------------------------------------

    def _start_round(self, p: _Peer) -> None:
        if not p.alive:
            return
        if p.draining or p.leaving:
            self._leave(p)
            return
        if p.pending is not None:
            moved = p.pending.module_ids != p.assignment.module_ids
            p.assignment, p.pending = p.pending, None
            if moved:
                self._bootstrap(p, p.assignment.module_ids, "move")
                return
        a = p.assignment
        step = self._step_seconds(p)
        steps = a.inner_steps
        if self.cfg.round_seconds > 0:  # the budget is checked after each step: the round ends at a whole step
            steps = min(steps, max(1, math.ceil(self.cfg.round_seconds / step - 1e-9)))
        full = steps * step
        now = self.loop.now()
        p.round_start = now
        p.open, p.failed = len(a.module_ids), 0
        p.seq += 1
        p.declared = False
        others_waiting = False
        for m in a.module_ids:
            r = p.rounds[m]
            h_key = holders_key(self.run.run_id, m)
            value = {**self._records(p)[0], "round_no": r}
            expires = now + 3 * self.cfg.round_seconds
            self._add("dht_bytes", self.dht.store(h_key, p.spec.peer_id, value, expires, expire=True))
            self._add("dht_ops")
            b = p.buckets[m] = self._bucket(p, m, r)
            if b is not None:  # announce ourselves to our group of this round too
                self._add("dht_bytes", self.dht.store(self._holders_key(m, r, b), p.spec.peer_id, value,
                                                      expires, expire=True))
                self._add("dht_ops")
            g = self._group(m, r, b)
            if not g.closed:
                g.expected.add(p.spec.peer_id)
                g.waiting += 1
            others_waiting |= math.isfinite(g.first_full)
        # others_waiting: a holder that computed its whole round already waits for this round: end ours at
        # the next check (and say so: a paced declaration paces nobody, GroupDeclaration.paced)
        self.loop.after(self.rng.uniform(0.0, WAITING_POLL) if others_waiting else full, self._declare, p, p.seq,
                        others_waiting)

    def _step_seconds(self, p: _Peer) -> float:
        """Seconds of one inner step (a batch of ``batch_size`` sequences) at the peer's tokens/s."""
        return self.run.inner.batch_size * self.run.lattice.seq_len / p.spec.tokens_per_s

    def _records(self, p: _Peer) -> tuple[dict, dict]:
        """The peer's holder record (round 0) and group declaration as the real ``to_value`` writes them
        (built once a peer: only the holder record's round changes between rounds)."""
        if p.values is None:
            bw = 0.0 if p.spec.natted else p.spec.upload_bps
            p.values = (to_value(HolderRecord(self.config_hash, "", 0, p.spec.tokens_per_s, bw, p.credential)),
                        to_value(GroupDeclaration(self.config_hash, "", bw, p.credential)))
        return p.values

    def _bucket(self, p: _Peer, m: str, r: int) -> Optional[int]:
        """This peer's group of module ``m``'s round ``r`` (None: one group a module): it counts the
        holders in one read of the module's holders key, then applies the real rule."""
        if self.cfg.max_group_size <= 0:
            return None
        h_key = holders_key(self.run.run_id, m)
        self._add("dht_bytes", self.dht.get_size(h_key))
        self._add("dht_ops")
        k = group_buckets(self.dht.count(h_key), self.cfg.max_group_size)
        return None if k == 1 else group_bucket(m, r, p.spec.peer_id, k)

    def _holders_key(self, m: str, r: int, b: Optional[int]) -> str:
        """The holders a member polls while gathering: the module's, or (split groups) its group's."""
        if b is None:
            return holders_key(self.run.run_id, m)
        return group_key(self.run.run_id, m, r, b)[:-len("group")] + "holders"

    def _group(self, m: str, r: int, b: Optional[int]) -> _Group:
        g = self.groups.get((m, r, b))
        if g is None:
            g = self.groups[(m, r, b)] = _Group(m, r, b)
        return g

    def _declare(self, p: _Peer, seq: int, paced: bool = False) -> None:
        if not p.alive or seq != p.seq or p.declared:
            return
        p.declared = True
        now = self.loop.now()
        p.compute = now - p.round_start
        timeout = self.cfg.round_timeout
        mods = p.assignment.module_ids
        # the others_waiting checks while computing: one get of each module's (empty) group key a poll
        polls = int(p.compute / WAITING_POLL)
        if polls:
            self._add("dht_ops", polls * len(mods))
            self.dht.ops += polls * len(mods)
            self._add("dht_bytes", polls * sum(len(group_key(self.run.run_id, m, p.rounds[m], p.buckets[m]))
                                               for m in mods))
        for m in mods:
            g = self._group(m, p.rounds[m], p.buckets[m])
            if g.closed:  # the group formed without us: behind, re-sync and fail this round
                ready = g.end if math.isfinite(g.end) else now
                self._module_done(p, m, g, ok=False, at=max(now, ready) + 4 * self.numel[m] / p.spec.download_bps)
                continue
            key = group_key(self.run.run_id, m, g.round_no, g.bucket)
            self._add("dht_bytes", self.dht.store(key, p.spec.peer_id, self._records(p)[1], now + timeout))
            self._add("dht_ops")
            g.declared[p.spec.peer_id] = now
            if p.spec.peer_id in g.expected:
                g.waiting -= 1
            if g.first == math.inf:
                g.first = now
                g.close_at = now + GATHER * timeout
                self.loop.at(g.close_at, self._close, g)
            if not paced and g.first_full == math.inf:
                g.first_full = now
                for pid in g.expected:  # their others_waiting check sees us within a poll
                    q = self.peers[pid]
                    if q.alive and not q.declared:
                        self.loop.after(self.rng.uniform(0.0, WAITING_POLL), self._declare, q, q.seq, True)
            if g.waiting <= 0:  # the members' next gather reads see it
                self.loop.after(POLL, self._close, g)

    def _close(self, g: _Group) -> None:
        if g.closed:
            return
        now = self.loop.now()
        g.closed = True
        self.next_round[g.module] = max(self.next_round[g.module], g.round_no + 1)
        key = group_key(self.run.run_id, g.module, g.round_no, g.bucket)
        found = self.dht.get(key)  # the leader's last read, through the real parser
        self._add("dht_ops")
        declared = records_from_value(found, GroupDeclaration)
        members = sorted(p for p in declared if self.peers[p].alive)
        # each member polled both keys from its declaration until the group closed (or its own deadline)
        h_key = self._holders_key(g.module, g.round_no, g.bucket)
        for pid in members:
            polls = int(max(0.0, min(now, g.declared[pid] + GATHER * self.cfg.round_timeout)
                            - g.declared[pid]) / POLL) + 1
            nbytes = self.dht.get_size(key, polls) + self.dht.get_size(h_key, polls)
            self._add("dht_ops", 2 * polls)
            self._add("dht_bytes", nbytes * polls)
        self.loop.after(self.cfg.round_timeout, self.dht.drop_key, key)
        g.members = [self.peers[p] for p in members]
        g.deadline = g.first + DEADLINE * self.cfg.round_timeout
        if not members:
            g.finished = True
            return
        accepting = [p for p in members if declared[p].bandwidth > 0]
        if len(members) > 1 and not accepting:  # nobody to lead: every member fails the round
            for p in g.members:
                self._module_done(p, g.module, g, ok=False, at=now)
            g.finished = True
            return
        self._add("groups")
        self._add("group_members", len(members))
        if self._in_window():
            self.group_sizes.append(len(members))
        g.end = now + self._exchange_seconds(g.module, g.members)
        self.loop.at(g.end, self._finish, g)

    def _exchange_seconds(self, m: str, members: list[_Peer]) -> float:
        """Butterfly all-reduce with parts sized by upload bandwidth (the real :func:`part_bounds`):
        the slowest member's upload or download sets the time."""
        n = len(members)
        if n == 1:
            return 0.0
        numel = self.numel[m]
        per_elem = self.wire[m] / numel
        bounds = part_bounds(numel, [0.0 if p.spec.natted else p.spec.upload_bps for p in members])
        worst = 0.0
        for p, (a, b) in zip(members, bounds):
            part = (b - a) * per_elem
            rest = numel * per_elem - part
            up = rest + part * (n - 1)
            down = part * (n - 1) + rest
            worst = max(worst, up / p.spec.upload_bps, down / p.spec.download_bps)
        return worst + LATENCY

    def _lose_member(self, g: _Group) -> None:
        """A member died mid-exchange: the others wait for it until the round's deadline."""
        if g.deadline > g.end:
            for p in g.members:
                if p.alive:
                    self._add("churn_lost_s", g.deadline - g.end)
                    self._add("idle_s", g.deadline - g.end)
            g.end = g.deadline
            g.lost_member = True
            self._add("groups_lost_member")
            self.loop.at(g.end, self._finish, g)

    def _finish(self, g: _Group) -> None:
        if g.finished or self.loop.now() < g.end:
            return
        g.finished = True
        for p in g.members:
            self._module_done(p, g.module, g, ok=True, at=self.loop.now())

    def _module_done(self, p: _Peer, m: str, g: _Group, ok: bool, at: float) -> None:
        if at > self.loop.now():
            self.loop.at(at, self._module_done, p, m, g, ok, at)
            return
        if not p.alive or p.open == 0:
            return
        p.rounds[m] = g.round_no + 1 if ok else self.next_round[m]
        p.open -= 1
        if not ok:
            p.failed += 1
        if p.open == 0:
            self._end_round(p)

    def _end_round(self, p: _Peer) -> None:
        a = p.assignment
        share_lost = p.failed / len(a.module_ids)
        self._add("compute_s", p.compute)
        if p.failed:
            self._add(LOSS_OF[p.cause], p.compute * share_lost)
        self._add("round_s_sum", self.loop.now() - p.round_start)
        if self._in_window():
            self.round_times.append(self.loop.now() - p.round_start)
        tokens = int(p.compute * p.spec.tokens_per_s * (1 - share_lost))
        p.tokens += tokens
        p.progress = [ProgressReport(m, p.rounds[m], p.tokens, 3.0) for m in a.module_ids]
        p.cause = ""
        self._start_round(p)

    # -- the run --------------------------------------------------------------------------------

    def simulate(self) -> SimResult:
        cfg = self.cfg
        specs = cfg.peer_specs or draw_peers(self.rng, cfg.peers, cfg.ramp, cfg.leave_per_hour)
        for spec in specs:
            self.loop.at(spec.arrival, self.arrive, spec)
        self.loop.at(0.0, self._tick)
        self.loop.at(0.0, self._flush)
        wall = time.perf_counter()
        self.loop.run(self.window[0])
        cpu0 = self.coord_cpu
        self.loop.run(self.window[1])
        coord_cpu = self.coord_cpu - cpu0
        wall = time.perf_counter() - wall
        self.store.close()
        return self._result(coord_cpu, wall)

    def _result(self, coord_cpu: float, wall: float) -> SimResult:
        cfg, c = self.cfg, self.c
        live = [p for p in self.peers.values() if p.alive]
        served = sum(1 for p in self.peers.values() if p.assignment is not None)
        unserved = [pid for pid, p in self.peers.items() if p.assignment is None and p.alive]
        # a peer's per-round DHT use: every module exchange of a round counts
        peer_rounds = len(self.round_times)
        groups = max(1.0, c["groups"])
        n_ring = max(2, cfg.peers)
        # compute time the live peers had: rounds computed, plus state downloads, killed rounds and
        # waits for a lost member (the losses not inside a computed round)
        capacity = max(1e-9, c["compute_s"] + c["idle_s"])
        figures = {
            "peers": cfg.peers,
            "lattice": f"{cfg.levels}x{cfg.modules_per_level}",
            "max_group_size": cfg.max_group_size,
            "paths": self.run.lattice.num_paths,
            "modules": len(self.numel),
            "simulated_s": cfg.duration,
            "wall_s": round(wall, 2),
            "events": self.loop.events,
            "peers_ever": len(self.peers),
            "peers_live_at_end": len(live),
            "peers_served": served,
            "refused": len(self.refusals),
            "round_s_median": statistics.median(self.round_times) if self.round_times else None,
            "round_s_p90": _quantile(self.round_times, 0.9),
            "peer_rounds": peer_rounds,
            "group_size_mean": c["group_members"] / groups,
            "group_size_max": max(self.group_sizes, default=0),
            "groups_lost_member_share": c["groups_lost_member"] / groups,
            "dht_ops_per_peer_round": c["dht_ops"] / max(1, peer_rounds),
            "dht_bytes_per_peer_round": c["dht_bytes"] / max(1, peer_rounds),
            "dht_hottest_key_ops_per_s": max(self.dht.key_ops.values(), default=0) / (cfg.ramp + cfg.duration),
            "dht_hops_per_op_model": math.ceil(math.log2(n_ring)),
            "coordinator_cpu_s": coord_cpu,
            "coordinator_cpu_share": coord_cpu / cfg.duration,
            "coordinator_join_cpu_ms_median": 1e3 * statistics.median(self.join_cpu) if self.join_cpu else None,
            "coordinator_join_cpu_ms_p99": 1e3 * (_quantile(self.join_cpu, 0.99) or 0.0),
            "heartbeats_per_s": c["heartbeats"] / cfg.duration,
            "joins": c["joins"],
            "departures": c["departures"],
            "kills": c["kills"],
            "moves": c["coordinator_moves"],
            "compute_s": c["compute_s"],
            "churn_lost_s": c["churn_lost_s"],
            "churn_compute_loss": c["churn_lost_s"] / capacity,
            "straggler_compute_loss": c["straggler_lost_s"] / capacity,
            "rebalance_compute_loss": c["move_lost_s"] / capacity,
            "startup_compute_loss": c["startup_lost_s"] / capacity,
            "uncovered_path_max_s": max(self.uncovered_spans, default=0.0),
            "uncovered_paths_open_at_end": len(self.uncovered_since),
        }
        return SimResult(cfg, figures, self.refusals, unserved, self.uncovered_spans)


def _quantile(values: list[float], q: float) -> Optional[float]:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def simulate(cfg: SimConfig) -> SimResult:
    """Run one simulation in a temporary directory (the coordinator's SQLite file lives there)."""
    with tempfile.TemporaryDirectory(prefix="hivepath-scale-") as d:
        return Swarm(cfg, Path(d)).simulate()
