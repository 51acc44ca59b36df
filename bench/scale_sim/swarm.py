"""The simulated swarm: the real coordinator and the real DHT records, a modelled network and clock.

Real code, called in-process: :class:`coordinator.Coordinator` (admission, leases, heartbeats,
drains on preemption notice, expiry and reassignment in ``tick``, rebalancing) on a real
:class:`coordinator.SQLiteStore` with its group commits; the record types, key builders and parser
of :mod:`peer.network.records`; the bandwidth-proportional partition of
:func:`peer.averaging.partition.part_bounds`; the exchange size of
:func:`coordinator.scheduler.exchange_bytes`.

Modelled (``docs/BENCHMARKS.md`` lists them): compute time (H steps at the peer's tokens/s, cut at
the first whole step past ``round_seconds``, as ``DiLoCoOptimizer.step`` checks the time budget after
each inner step), link transfer times (bytes over a bandwidth, plus a fixed latency), each member's
processing of the others' parts (``PART_CPU`` a part, slower where peers share a machine), the group
decision of :class:`peer.averaging.matchmaking.Matchmaker` (a group closes half a ``POLL`` after every
expected holder has declared, the mean wait for the members' next reads, or at the gather deadline; its
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
code), each with its own group key; a member reads the module's whole holders key once a round, when
it declares (``SplitRounds.plan``), to count the holders (the bucket count), then polls its group's key
every ``POLL`` and the module's holders key every ``HOLDERS_POLL`` (as ``Matchmaker._gather`` does).
As :mod:`peer.averaging.hierarchy` does, each bucket's delegate (real rule: its smallest member that
accepts connections) then reads the holders key once more, declares the top group under
:func:`peer.network.records.top_group_key` and polls it until the top group closes (every bucket with
members there, or the gather deadline ``SPLIT_TOP_GATHER`` of the real averager); the top group needs
more than half of those buckets, and its all-reduce is modelled as a group's (a bucket that comes after
it closed fetches its average from a top member and applies it, its members' deltas carried into their
next round, or fails if the top group failed); each bucket's members
get the average down the real :func:`peer.averaging.hierarchy.tree` (the fastest uploads inner), passed
on part by part as it arrives: the encoded average times its children over its upload, for the
slowest inner node, plus a part's time at that pace and a round trip a hop. Above the cap, the real
:func:`peer.network.records.split_levels` adds levels of groups of delegates between the buckets and the
top group (each modelled as a declaration and a read of its key, an all-reduce of its delegates' means,
and a part and a round trip on the way down), so no group of delegates and no top group exceeds
``max_group_size`` (``upper_group_size_max``); every member reads the top group's key once for the
digest of the average it checks (``SplitRounds._agreement``).
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

from bench.scale_sim.census import (PACERS, bucket_holders_key, census_bound, census_depth, census_estimate,
                                    census_key, census_level)
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
from peer.averaging.hierarchy import tree, tree_depth
from peer.averaging.matchmaking import HOLDERS_POLL
from peer.averaging.split_round import SPLIT_BUCKET, SPLIT_TOP_GATHER
from peer.averaging.partition import MAX_SEGMENTS, Group, part_bounds
from peer.network.records import (GroupDeclaration, HolderRecord, group_bucket, group_buckets, group_key, holders_key,
                                  level_group_key, records_from_value, split_levels, to_value, top_group_key)

__all__ = ["SimConfig", "SimResult", "simulate", "run_config"]

GATHER = 0.2
"""Share of ``round_timeout`` a member gathers declarations (``Matchmaker.form_group``)."""
DEADLINE = 0.95
"""Share of ``round_timeout`` after which an exchange ends whatever happened."""
POLL = 0.1
"""Seconds between matchmaking reads of the DHT (``peer.averaging.matchmaking._POLL``)."""
LATENCY = 0.2
"""Default ``SimConfig.latency``: seconds of round trips per exchange (join, begin, segment pipeline
start) over the internet, and a round trip per hop of a split round's tree: a model."""
PART_CPU = 0.0075
"""CPU seconds a member spends on each other member's part of an exchange (the p2p messages, decoding,
adding, encoding), on a core of its own: a model, chosen on the calibration run of
``bench/results/scale_calibrate.json`` at commit 1e51584 (its 4, 8 and 12 peers; the tiny preset's
parts), where the real exchange's wait grew with the group times the peers sharing the machine."""
WAITING_POLL = 1.0
"""Seconds between a computing member's checks for others waiting (``peer.averaging.pacing.WAITING_POLL``)."""
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
    latency: float = LATENCY
    """Seconds of round trips per exchange and per hop of a split round's tree (``LATENCY``; a
    calibration on loopback measures its machine's beside ``part_cpu``, :mod:`bench.exchange_probe`)."""
    part_cpu: float = PART_CPU
    """Seconds a member spends on each other member's part on a core of its own (``PART_CPU``; a
    calibration measures its machine's, :mod:`bench.exchange_probe`)."""
    exchange_cores: float = 0.0
    """Cores the live peers' exchange processing shares (a calibration's peers on one machine): each
    member's ``part_cpu`` per part is that many times slower when more peers than cores are live; 0:
    every peer processes its exchange on a core of its own."""
    census: bool = False
    """Model the design of :mod:`bench.scale_sim.census` (control reads of a split round bounded by the
    cap, not by the holders) instead of the peers' code, which reads whole holders keys."""
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
                 "seq", "declared", "buckets", "expected_in", "values")

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
        self.expected_in: dict[str, tuple[int, Optional[int]]] = {}  # module -> (round, bucket) its last group expects
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


class _Top:
    """The top group of one split round (:mod:`peer.averaging.hierarchy`): the buckets' delegates."""

    __slots__ = ("module", "round_no", "groups", "ready", "arrived", "closed", "deadline", "expected", "first_full",
                 "done_at", "late")

    def __init__(self, module: str, round_no: int):
        self.module, self.round_no = module, round_no
        self.groups: list[_Group] = []  # the round's bucket groups
        self.ready: list[_Group] = []  # those whose all-reduce ended (their delegate declared the top group)
        self.arrived: dict[int, float] = {}  # id(group) -> when its delegate declared
        self.closed = False
        self.deadline = math.inf
        self.expected: Optional[set[int]] = None  # the buckets of the holders at this round or the next
        self.first_full = math.inf  # the first member of any bucket that computed its whole round: it paces all
        self.done_at = math.inf  # when the top group's average exists (inf: it failed, or not yet)
        self.late: list[_Peer] = []  # members that missed their bucket: they fetch the average once it exists


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
        self.tops: dict[tuple[str, int], _Top] = {}
        self.next_round: Counter[str] = Counter()
        self.next_index = cfg.peers
        self.c: Counter[str] = Counter()  # counts and sums measured in the window
        self.round_times: list[float] = []
        self.exchange_times: list[float] = []  # per peer round: from its declaration (compute done) to its round's end
        self.group_sizes: list[int] = []
        self.upper_sizes: list[int] = []  # the groups of delegates and the top groups of split rounds
        self.levels_seen = 1  # the most levels of groups a round had, its top group included
        self.census_at: dict[str, int] = {}  # module -> the census level read last (SimConfig.census)
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
        seconds = sum(4 * self.numel[m] for m in module_ids) / p.spec.download_bps + self.cfg.latency
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
            stored = self.dht.store(h_key, p.spec.peer_id, value, expires, expire=True)
            if self.cfg.census and self.cfg.max_group_size > 0:  # the census levels instead (the simulator
                # keeps the whole key for its own bookkeeping; no peer reads it in this design)
                for level in range(max(0, self.census_at.get(m, 0) - 2), census_depth(m, p.spec.peer_id) + 1):
                    self._add("dht_bytes", self.dht.store(census_key(self.run.run_id, m, level), p.spec.peer_id,
                                                          value, expires, expire=True))
                    self._add("dht_ops")
            else:
                self._add("dht_bytes", stored)
                self._add("dht_ops")
            b = p.buckets[m] = self._bucket(p, m, r, count=False)  # what its holder record tells the others
            self._bucket_holder(p, m, r, b, now + self.cfg.round_timeout + self.cfg.round_seconds)
            g = self._group(m, r, b)
            earlier = p.expected_in.pop(m, None)  # where its last group's close announced it, if elsewhere
            if earlier is not None and earlier != (r, b) and (m, *earlier) in self.groups:
                self._unexpect(self.groups[(m, *earlier)], p)
            self._expect(g, p)
            # (a split round's pacer declared under the module's key, where its declaration lives for
            # round_timeout: Matchmaker.announce_full_round)
            others_waiting |= math.isfinite(g.first_full) or (
                b is not None and 0.0 <= now - self._top(m, r).first_full < self.cfg.round_timeout)
        # others_waiting: a holder that computed its whole round already waits for this round: end ours at
        # the next check (and say so: a paced declaration paces nobody, GroupDeclaration.paced)
        self.loop.after(self.rng.uniform(0.0, WAITING_POLL) if others_waiting else full, self._declare, p, p.seq,
                        others_waiting)

    def _rebucket(self, p: _Peer, m: str, b: Optional[int]) -> None:
        """``p`` counted another number of buckets when it declared than its holder record gave the others
        at its round's start: the group it declares in expects it, the one it left no longer does."""
        r = p.rounds[m]
        self._unexpect(self._group(m, r, p.buckets[m]), p)
        p.buckets[m] = b
        self._bucket_holder(p, m, r, b, self.loop.now() + self.cfg.round_timeout)
        self._expect(self._group(m, r, b), p)

    def _bucket_holder(self, p: _Peer, m: str, r: int, b: Optional[int], expires: float) -> None:
        """The census design: ``p`` holds ``m``'s round ``r`` in bucket ``b``, under the bucket's own holders key."""
        if self.cfg.census and b is not None:
            self._add("dht_bytes", self.dht.store(bucket_holders_key(self.run.run_id, m, r, b), p.spec.peer_id,
                                                  {**self._records(p)[0], "round_no": r}, expires, expire=True))
            self._add("dht_ops")

    def _expect(self, g: _Group, p: _Peer) -> None:
        """``g``'s members wait for ``p`` (its holder record announces ``g``'s round) until it declares."""
        pid = p.spec.peer_id
        if not g.closed and pid not in g.expected:
            g.expected.add(pid)
            if pid not in g.declared:
                g.waiting += 1

    def _unexpect(self, g: _Group, p: _Peer) -> None:
        """``g``'s members no longer wait for ``p`` (it counted itself into another bucket); ``g`` closes
        once nobody else it waits for is missing."""
        pid = p.spec.peer_id
        if not g.closed and pid in g.expected:
            g.expected.discard(pid)
            if pid not in g.declared:
                g.waiting -= 1
                if g.waiting <= 0 and math.isfinite(g.first):
                    self.loop.after(POLL / 2, self._close, g)

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

    def _bucket(self, p: _Peer, m: str, r: int, count: bool = True) -> Optional[int]:
        """This peer's group of module ``m``'s round ``r`` (None: one group a module): it counts the
        holders in one read of the module's holders key (``count``: the peer's own read, measured), then
        applies the real rule."""
        if self.cfg.max_group_size <= 0:
            return None
        h_key = holders_key(self.run.run_id, m)
        if count:
            if self.cfg.census:
                self._census_read(m)
            else:
                self._add("dht_bytes", self.dht.get_size(h_key))
                self._add("dht_ops")
        k = group_buckets(self._holders(m), self.cfg.max_group_size)
        return None if k == 1 else group_bucket(m, r, p.spec.peer_id, k)

    def _holders(self, m: str) -> int:
        """The holders of ``m`` the split rules count: the whole holders key's (the peers' code), or the
        census's estimate (``SimConfig.census``)."""
        h_key = holders_key(self.run.run_id, m)
        if not self.cfg.census:
            return self.dht.count(h_key)
        level = census_level(lambda s: self.dht.count(census_key(self.run.run_id, m, s)),
                             census_bound(self.cfg.max_group_size), self.census_at.get(m, 0))
        self.census_at[m] = level
        return census_estimate(self.dht.count(census_key(self.run.run_id, m, level)), level) or self.dht.count(h_key)

    def _census_read(self, m: str) -> None:
        """One peer's count of ``m``'s holders in the census design: the level it settles on and the
        one below (``census_level``)."""
        self._holders(m)
        level = self.census_at.get(m, 0)
        for s in range(max(0, level - 1), level + 1):
            self._add("dht_bytes", self.dht.get_size(census_key(self.run.run_id, m, s)))
            self._add("dht_ops")

    def _group(self, m: str, r: int, b: Optional[int]) -> _Group:
        g = self.groups.get((m, r, b))
        if g is None:
            g = self.groups[(m, r, b)] = _Group(m, r, b)
            if b is not None:
                self._top(m, r).groups.append(g)
        return g

    def _top(self, m: str, r: int) -> _Top:
        top = self.tops.get((m, r))
        if top is None:
            top = self.tops[(m, r)] = _Top(m, r)
            self.loop.after(3 * self.cfg.round_timeout + self.cfg.round_seconds, self.tops.pop, (m, r), None)
        return top

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
            # (the module's key: a split round's pacers declare there too)
            self._add("dht_bytes", polls * sum(self.dht.size(group_key(self.run.run_id, m, p.rounds[m]))
                                               for m in mods))
        for m in mods:
            if self.cfg.max_group_size > 0:  # SplitRounds.plan: its bucket from the holders it reads now
                b = self._bucket(p, m, p.rounds[m])
                if b != p.buckets[m]:
                    self._rebucket(p, m, b)
            g = self._group(m, p.rounds[m], p.buckets[m])
            if g.closed:  # the group formed without us
                if g.bucket is not None:  # a split round: the round's average from a top member, if any
                    self._late_member(p, m, g)
                    continue
                ready = g.end if math.isfinite(g.end) else now  # behind: re-sync and fail this round
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
            pacer_key = group_key(self.run.run_id, m, g.round_no)
            if not paced and g.bucket is not None and (not self.cfg.census or self.dht.count(pacer_key) < PACERS):
                # a split round's pacer also declares under the module's key (the census design: only
                # while fewer than PACERS did; its pacing polls read the key first)
                self._add("dht_bytes", self.dht.store(pacer_key, p.spec.peer_id, self._records(p)[1], now + timeout))
                self._add("dht_ops")
                top = self._top(m, g.round_no)
                if top.first_full == math.inf:
                    top.first_full = now
                    # every bucket's others_waiting sees us (in a fixed order: the run does not depend on
                    # the process's string hashing)
                    for pid in sorted({q for x in top.groups for q in x.expected}):
                        q = self.peers[pid]
                        if q.alive and not q.declared:
                            self.loop.after(self.rng.uniform(0.0, WAITING_POLL), self._declare, q, q.seq, True)
            if not paced and g.first_full == math.inf:
                g.first_full = now
                for pid in sorted(g.expected):  # their others_waiting check sees us within a poll
                    q = self.peers[pid]
                    if q.alive and not q.declared:
                        self.loop.after(self.rng.uniform(0.0, WAITING_POLL), self._declare, q, q.seq, True)
            if g.waiting <= 0:  # the members' next gather reads see it
                self.loop.after(POLL / 2, self._close, g)

    def _close(self, g: _Group) -> None:
        if g.closed:
            return
        now = self.loop.now()
        g.closed = True
        if g.bucket is None:  # a split round is applied only once its top group is through (_top_close)
            self.next_round[g.module] = max(self.next_round[g.module], g.round_no + 1)
        key = group_key(self.run.run_id, g.module, g.round_no, g.bucket)
        found = self.dht.get(key)  # the leader's last read, through the real parser
        self._add("dht_ops")
        declared = records_from_value(found, GroupDeclaration)
        # (those that declared to this attempt: a round retried after its top group failed reuses the key,
        # where the first attempt's declarations stay until they expire)
        members = sorted(p for p in declared if p in g.declared and self.peers[p].alive)
        # each member polled its group key from its declaration until the group closed (or its own
        # deadline), and the module's holders key as often, or once a HOLDERS_POLL in a split round (an
        # upper bound for an unsplit round: the real gather reads the holders once a HOLDERS_POLL too, its
        # group key less often while the holders it waits for push their declarations, and nothing at all
        # when the last round's group pushes them)
        h_key = holders_key(self.run.run_id, g.module)
        if self.cfg.census and g.bucket is not None:  # the bucket's own holders key
            h_key = bucket_holders_key(self.run.run_id, g.module, g.round_no, g.bucket)
        gather = GATHER * self.cfg.round_timeout
        for pid in members:
            gathered = max(0.0, min(now, g.declared[pid] + gather) - g.declared[pid])
            polls = int(gathered / POLL) + 1
            h_polls = polls if g.bucket is None else int(gathered / HOLDERS_POLL) + 1
            nbytes = self.dht.get_size(key, polls) * polls + self.dht.get_size(h_key, h_polls) * h_polls
            self._add("dht_ops", polls + h_polls)
            self._add("dht_bytes", nbytes)
        self.loop.after(self.cfg.round_timeout, self.dht.drop_key, key)
        g.members = [self.peers[p] for p in members]
        # its members announce their next round now (NetAverager holds round + 1 once the group formed):
        # the next round's groups wait for them from here on, as the real matchmaker reads their records
        for q in g.members:
            b = None if g.bucket is None else self._bucket(q, g.module, g.round_no + 1, count=False)
            q.expected_in[g.module] = (g.round_no + 1, b)
            self._expect(self._group(g.module, g.round_no + 1, b), q)
        # a split round's bucket all-reduces by SPLIT_BUCKET of the round's budget (SplitRounds.average)
        g.deadline = g.first + self.cfg.round_timeout * (DEADLINE if g.bucket is None else SPLIT_BUCKET)
        if g.bucket is not None:
            top = self._top(g.module, g.round_no)
            top.deadline = min(top.deadline, g.first + SPLIT_TOP_GATHER * self.cfg.round_timeout)
            self.loop.at(top.deadline, self._top_close, top)
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
        return worst + self.cfg.latency + (n - 1) * self.cfg.part_cpu * self._cpu_slowdown()

    def _cpu_slowdown(self) -> float:
        """How much slower than on a core of its own a member processes its exchange: the live peers'
        exchanges share ``SimConfig.exchange_cores`` (peers on one machine), or 1."""
        if self.cfg.exchange_cores <= 0:
            return 1.0
        return max(1.0, sum(p.alive for p in self.peers.values()) / self.cfg.exchange_cores)

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
        if g.bucket is not None:  # a split round: the bucket's mean goes to the top group
            self._top_arrive(g)
            return
        for p in g.members:
            self._module_done(p, g.module, g, ok=True, at=self.loop.now())

    # -- split rounds (peer.averaging.hierarchy) ------------------------------------------------

    def _top_arrive(self, g: _Group) -> None:
        """A bucket's all-reduce ended: its delegate counts the module's holders (one read of the holders
        key) and declares the top group; the top group closes once every bucket with members is there."""
        now = self.loop.now()
        if self.groups.get((g.module, g.round_no, g.bucket)) is not g:  # an attempt whose top group failed
            for p in g.members:
                self._module_done(p, g.module, g, ok=False, at=now, retry=True)
            return
        top = self._top(g.module, g.round_no)
        if top.closed:  # too late for the top group
            self._add("top_late_groups")
            if math.isfinite(top.done_at):  # its delegate fetches the round's average from a top member
                spread = self._tree_seconds(g, self.wire[g.module] / MAX_SEGMENTS)
                for p in g.members:  # (their deltas carry into their next round: not lost)
                    self._module_done(p, g.module, g, ok=True, at=max(now, top.done_at) + self.cfg.latency + spread)
                return
            for p in g.members:  # no average: nobody applied the round, the members average it again
                self._module_done(p, g.module, g, ok=False, at=now, retry=True)
            return
        h_key = holders_key(self.run.run_id, g.module)
        t_key = top_group_key(self.run.run_id, g.module, g.round_no)
        d = self._delegate(g)
        if self.cfg.census:
            self._census_read(g.module)
        else:
            self._add("dht_bytes", self.dht.get_size(h_key))
        self._add("dht_bytes", self.dht.store(t_key, d.spec.peer_id, self._records(d)[1], now + self.cfg.round_timeout))
        self._add("dht_ops", 2)
        top.ready.append(g)
        top.arrived[id(g)] = now
        if top.expected is None:  # as SplitRounds._top_round reads them: the buckets of the live holders at
            top.expected = self._held_buckets(g.module, g.round_no)  # this round or the next, ours included
            top.expected.add(g.bucket)
        if top.expected <= {x.bucket for x in top.ready}:
            self.loop.after(POLL / 2, self._top_close, top)

    def _held_buckets(self, m: str, r: int) -> set[int]:
        """The buckets of round ``r`` of ``m`` that hold a live holder, whatever round it announces, of as
        many buckets as the holders key counts (``SplitRounds.plan``)."""
        k = group_buckets(self._holders(m), self.cfg.max_group_size)
        return {group_bucket(m, r, p.spec.peer_id, k) for p in self.peers.values()
                if p.alive and p.assignment is not None and m in p.assignment.module_ids}

    def _late_member(self, p: _Peer, m: str, g: _Group) -> None:
        """``p`` missed its bucket's group (``SplitRounds.average``): once the round's top group is
        through it fetches the average from a top member and applies it (its delta carried into its
        next round); if the top group failed, nobody applied the round and it averages it again."""
        top = self._top(m, g.round_no)
        if not top.closed:
            top.late.append(p)
            return
        now = self.loop.now()
        if math.isfinite(top.done_at):
            self._module_done(p, m, g, ok=True, at=max(now, top.done_at) + self.cfg.latency + self.wire[m] / p.spec.download_bps)
        else:
            self._module_done(p, m, g, ok=False, at=now, retry=True)

    def _delegate(self, g: _Group) -> _Peer:
        """The bucket's delegate: its smallest member that accepts connections (``hierarchy.delegate``)."""
        accepting = [p for p in g.members if not p.spec.natted]
        return min(accepting or g.members, key=lambda p: p.spec.peer_id)

    def _top_close(self, top: _Top) -> None:
        """The top group forms from the delegates that declared (more than half of the round's buckets
        with members, or nobody applies), all-reduces the bucket means, and each bucket's members get the
        average down their tree: ``hierarchy.tree_depth`` hops of the encoded average, each node
        uploading it to two children."""
        if top.closed:
            return
        top.closed = True
        now = self.loop.now()
        m = top.module
        t_key = top_group_key(self.run.run_id, m, top.round_no)
        for g in top.ready:  # each delegate polled the top key from its declaration until the close
            polls = int((now - top.arrived[id(g)]) / POLL) + 1
            self._add("dht_ops", polls)
            self._add("dht_bytes", self.dht.get_size(t_key, polls) * polls)
        self.loop.after(self.cfg.round_timeout, self.dht.drop_key, t_key)
        counts = split_levels(self._holders(m), self.cfg.max_group_size)
        held = len({b % counts[-1] for b in top.expected or ()})  # the top group's slots with holders
        ready = [g for g in top.ready if any(p.alive for p in g.members)]
        if len({g.bucket % counts[-1] for g in ready}) < held // 2 + 1:  # nobody applies the round: a
            self._add("top_minority")    # fresh attempt (new groups, a new top group) at its next round
            for key in [k for k in self.groups if k[0] == m and k[1] == top.round_no]:
                del self.groups[key]
            self.tops.pop((m, top.round_no), None)
            for g in ready:
                for p in g.members:
                    self._module_done(p, m, g, ok=False, at=now, retry=True)
            attempt = _Group(m, top.round_no, None)
            for p in top.late:
                self._module_done(p, m, attempt, ok=False, at=now, retry=True)
            return
        self.next_round[m] = max(self.next_round[m], top.round_no + 1)
        exchange, carriers = self._levels(m, top.round_no, counts, ready, now)
        self.levels_seen = max(self.levels_seen, len(counts) + 1)
        self._add("top_groups")
        self._add("top_group_members", len(carriers))
        self.upper_sizes.append(len(carriers))
        exchange += self._exchange_seconds(m, carriers) if len(carriers) > 1 else 0.0
        top.done_at = now + exchange
        # every member reads the top group's declarations once for the digest of the average the top
        # group agreed on (SplitRounds._agreement), and every top member states it there
        for d in carriers:
            self._add("dht_bytes", self.dht.store(t_key, d.spec.peer_id, self._records(d)[1],
                                                  now + self.cfg.round_timeout))
        members = sum(len(g.members) for g in ready) - len(ready)
        self._add("dht_ops", members + len(carriers))
        self._add("dht_bytes", self.dht.get_size(t_key) * members)
        for p in top.late:
            self._late_member(p, m, self._group(m, top.round_no, p.buckets.get(m)))
        part = self.wire[m] / (MAX_SEGMENTS * len(ready))  # the top group's parts, passed on one by one
        for g in ready:
            spread = self._tree_seconds(g, part)
            for p in g.members:
                self._module_done(p, m, g, ok=True, at=now + exchange + spread)

    def _levels(self, m: str, r: int, counts: tuple[int, ...], ready: list[_Group],
                now: float) -> tuple[float, list[_Peer]]:
        """The groups of delegates between the buckets and the top group (``split_levels``, real rule):
        at each level the carriers of the level below whose index agrees modulo the level's count meet
        (each declares under ``level_group_key`` and reads it once), all-reduce their means (the slowest
        group sets the level's time) and their smallest member carries the mean on (``hierarchy.delegate``);
        the average comes back down through each of them, a part and a round trip a level. Returns
        the seconds up and down and the carriers that form the top group."""
        carriers = {g.bucket: self._delegate(g) for g in ready}
        seconds = 0.0
        for level in range(2, len(counts) + 1):
            meet: dict[int, list[tuple[int, _Peer]]] = {}
            for slot, d in carriers.items():
                meet.setdefault(slot % counts[level - 1], []).append((slot, d))
            slowest = 0.0
            for index, group in meet.items():
                key = level_group_key(self.run.run_id, m, r, level, index)
                for _, d in group:
                    self._add("dht_bytes", self.dht.store(key, d.spec.peer_id, self._records(d)[1],
                                                          now + self.cfg.round_timeout))
                    self._add("dht_bytes", self.dht.get_size(key))
                    self._add("dht_ops", 2)
                self.loop.after(self.cfg.round_timeout, self.dht.drop_key, key)
                self.upper_sizes.append(len(group))
                peers = [d for _, d in group]
                if len(peers) > 1:
                    slowest = max(slowest, self._exchange_seconds(m, peers))
            # on the way down, a part of the average (the top group's parts, passed on one by one) per
            # hop, at the slowest carrier's upload, to its two children
            part = self.wire[m] / (MAX_SEGMENTS * max(1, len(meet)))
            seconds += POLL + slowest + self.cfg.latency + 2 * part / min(d.spec.upload_bps for d in carriers.values())
            carriers = {index: min((d for _, d in group), key=lambda p: p.spec.peer_id)
                        for index, group in meet.items()}
        return seconds, list(carriers.values())

    def _tree_seconds(self, g: _Group, part: float) -> float:
        """Seconds for the round's average to reach the last member of bucket ``g`` down the real tree:
        each inner node uploads it to its children as it arrives, the slowest of them sets the pace,
        and each hop adds a part's time (``part`` bytes) at that pace and a round trip."""
        group = Group("", tuple(p.spec.peer_id for p in g.members),
                      tuple(0.0 if p.spec.natted else p.spec.upload_bps for p in g.members), 1.0)
        root = self._delegate(g).spec.peer_id
        children = Counter(tree(group, root).values())
        if not children:
            return 0.0
        wire = self.wire[g.module]
        upload = {p.spec.peer_id: p.spec.upload_bps for p in g.members}
        pace = max(n * wire / upload[q] for q, n in children.items())
        return pace + tree_depth(group, root) * (self.cfg.latency + pace * part / wire)

    def _module_done(self, p: _Peer, m: str, g: _Group, ok: bool, at: float, retry: bool = False) -> None:
        """``p`` is done with ``m``'s round of ``g`` at ``at``: applied (``ok``), failed and re-synced to the
        holders ahead, or failed with nobody applying it (``retry``: it averages the same round again)."""
        if at > self.loop.now():
            self.loop.at(at, self._module_done, p, m, g, ok, at, retry)
            return
        if not p.alive or p.open == 0:
            return
        p.rounds[m] = g.round_no + 1 if ok else (g.round_no if retry else max(self.next_round[m], g.round_no))
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
            self.exchange_times.append(self.loop.now() - p.round_start - p.compute)
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
            "exchange_s_median": statistics.median(self.exchange_times) if self.exchange_times else None,
            "exchange_s_p90": _quantile(self.exchange_times, 0.9),
            "peer_rounds": peer_rounds,
            "group_size_mean": c["group_members"] / groups,
            "group_size_max": max(self.group_sizes, default=0),
            "max_group_members": max(self.group_sizes + self.upper_sizes, default=0),
            "upper_group_size_max": max(self.upper_sizes, default=0),
            "split_levels_max": self.levels_seen,
            "top_groups": c["top_groups"],
            "top_group_size_mean": c["top_group_members"] / max(1.0, c["top_groups"]),
            "top_groups_failed": c["top_minority"],
            "top_late_groups": c["top_late_groups"],
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
