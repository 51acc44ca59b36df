"""``NetAverager``: the :class:`peer.averaging.ModuleAverager` of real peers, over hivemind's DHT and P2P.

Per (module, round) it matchmakes a group among the module's live holders (:mod:`peer.averaging.matchmaking`)
and runs the bit-identical all-reduce (:mod:`peer.averaging.allreduce`): every member applies the same
decoded bytes, so replicas stay identical whatever the codec (DiLoCo, Douillard et al. 2023; DiPaCo,
Douillard et al. 2024). It also publishes this peer's :class:`~peer.network.records.HolderRecord` for each
module it holds (refreshed in the background) and serves module states to newcomers
(:mod:`peer.averaging.state_transfer`).

One ``NetAverager`` per process and run: it owns an asyncio loop on a background thread, on which
a replica of the DHT's p2p daemon handle serves the ``hivepath_{run_id}_*`` protocols.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import math
import threading
import time
from collections import Counter
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
from torch import Tensor

from peer.averaging.allreduce import ReductionServer
from peer.network.lanes import DirectLanes, lane_hosts
from peer.averaging.aggregation import MEAN, Aggregation
from peer.averaging.compat import wire_key
from peer.averaging.contract import LONE_HOLDER, AverageResult, SuspectHook, require_codec
from peer.compression import Codec
from peer.averaging.reducer import EventHook
from peer.averaging.memory import FlatBuffers, keep_freed_memory
from peer.averaging.vectors import flatten, unflatten
from peer.outer import ModuleState
from peer.network import unwrap_dht
from peer.averaging.hierarchy import (LyingPeer, ResultRelay, RoundResult, SplitPlan, bucket_weight, delegate,
                                      round_key, tree_parent)
from peer.averaging.matchmaking import LONE, Matchmaker
from peer.averaging.partition import Group
from peer.network import (
    STORE_TIMEOUT,
    ArchiveRecord,
    GroupDeclaration,
    HolderRecord,
    archive_key,
    group_bucket,
    group_key,
    holders_key,
    level_group_key,
    records_from_value,
    top_group_key,
    to_value,
    withdrawal,
)
from peer.averaging.state_transfer import StateProvider, StateServer, fetch_module_state

__all__ = ["NetAverager"]

log = logging.getLogger(__name__)

DEFAULT_BANDWIDTH = 100e6 / 8
"""Bytes/s assumed for the upload link when none was measured (100 Mbit/s)."""
RELAYED_SHARE = 1e-3
"""The fraction of its upload a peer dialled through a relay offers to reductions: next to a
reachable member it reduces (next to) nothing, so no part crosses its relay; in a group of relayed
members alone they share the work as their links allow."""
WAITING_POLL = 1.0
"""Seconds between the DHT checks behind :meth:`NetAverager.others_waiting`."""
SPLIT_BUCKET = 0.6
"""Share of a round's timeout by which a split round's bucket group has matchmade (as a whole module's
group does, within the same shares of the timeout) and all-reduced (:mod:`peer.averaging.hierarchy`) ..."""
SPLIT_TOP_GATHER = 0.7
"""... by when (a share of the timeout from the round's start) the buckets' delegates have declared the top group ..."""
SPLIT_TOP = 0.88
"""... by when the top group's all-reduce ends ..."""
SPLIT_END = 0.95
"""... and by when every holder has the average from its tree."""
LATE_POLL = 1.0
"""Seconds between a late member's reads of the top group's declarations (whom to ask for the average)."""
AGREED_POLL = 0.25
"""Seconds between a bucket member's reads of the top group's declarations while it waits for the
digest of the round's average most delegates state (:class:`_Agreement`)."""
WITHDRAW_TIMEOUT = 5.0
"""Seconds a release waits for the DHT to store its withdrawals (a drain must not hang on it)."""


CODEC_THREADS = 2
"""Threads of the averager's executor: encoding one part while another is decoded; the codec's passes
release the GIL, its glue between them does not."""


class _Agreement:
    """The digest of a split round's average that the top group agreed on, read from its declarations
    (:attr:`peer.network.records.GroupDeclaration.result`) once, the first time it is asked for: a digest
    stated by ``need`` delegates (more than half of the round's buckets). Raises when none is by
    ``deadline``; :meth:`close` stops the reads."""

    def __init__(self, read: Callable[[], Any], need: int, deadline: float):
        self.read, self.need, self.deadline = read, need, deadline
        self._task: Optional["asyncio.Future[str]"] = None

    async def __call__(self) -> str:
        if self._task is None:
            self._task = asyncio.ensure_future(self._wait())
        return await asyncio.shield(self._task)

    async def _wait(self) -> str:
        while True:
            stated = Counter(await self.read())
            best = stated.most_common(1)
            if best and best[0][1] >= self.need:
                return best[0][0]
            if time.monotonic() >= self.deadline:
                raise RuntimeError(f"no digest of the round's average stated by {self.need} delegates in time "
                                   f"({dict(stated) or 'none stated'})")
            await asyncio.sleep(min(AGREED_POLL, max(0.0, self.deadline - time.monotonic())))

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task.add_done_callback(lambda t: t.cancelled() or t.exception())


def level_shares(levels: int, level: int) -> tuple[float, float]:
    """The shares of a round's timeout (from its start) by which the delegates meeting at ``level``
    above the buckets (1 .. ``levels``; ``levels``: the top group) of a split round of ``levels``
    levels of groups below the top have declared, and by which that level's all-reduce ends: the span
    from ``SPLIT_BUCKET`` to ``SPLIT_TOP`` in equal slices, each gathering for the same share of its
    slice as a two-level round's top group (``SPLIT_TOP_GATHER``)."""
    step = (SPLIT_TOP - SPLIT_BUCKET) / levels
    start = SPLIT_BUCKET + (level - 1) * step
    return start + step * (SPLIT_TOP_GATHER - SPLIT_BUCKET) / (SPLIT_TOP - SPLIT_BUCKET), start + step


def _new_loop() -> asyncio.AbstractEventLoop:
    """uvloop where it is installed: the exchange moves every byte through asyncio streams to the p2p
    daemon, and uvloop's transports take far less CPU per byte than the default loop's."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class NetAverager:
    """Averages module pseudo-gradients with the other holders of each module over the network.

    Args:
        dht: this process's DHT (``peer.network.dht.PeerDHT`` or ``hivemind.dht.DHT``).
        run_id: the run's slug; prefixes DHT keys and protocol names.
        config_hash: the run config hash; peers of another hash are never grouped.
        data_hash: the dataset manifest hash ('' if none); peers of another dataset are never grouped.
        bandwidth: measured upload bandwidth in bytes/s; it sizes our share of each reduction.
            0 means client mode (we reduce nothing); default: 0 if the DHT is in client mode.
        throughput: measured tokens/s, published in our holder records.
        state_provider: ``module_id -> ModuleState`` to serve newcomers (see :meth:`serve_states`).
        holder_ttl: seconds a holder record lives without refresh (refreshed every third of it).
        startup_timeout: seconds to connect to the p2p daemon and register handlers.
        event_hook: called at named points of a round, for fault injection in tests and phase timing in
            benchmarks (see :data:`peer.averaging.reducer.EventHook`).
        relayed: we can be dialled only through a circuit relay (behind NAT, ``peer.network.relays``):
            the groups we are in say so, and parts between two relayed members go in small pieces.
        direct_lanes: carry the parts over direct TLS connections where the reducer offers one
            (:mod:`peer.network.lanes`: a third less CPU per byte than through the p2p daemons); off,
            every byte goes through the daemons (a benchmark's control run).
        lane_port: the lane's TCP port (0: an ephemeral one); :class:`peer.network.lanes.LanePortError`
            when it cannot be bound.
        lane_listen: the hosts the lane listens on (default: those of our visible addresses); it is
            offered at our visible (announced) addresses.
        aggregation: the run's reduction rule (``Aggregation.from_config(cfg.outer)``; the config hash
            keeps every group member on the same rule). ``DiLoCoOptimizer`` sets it through
            :meth:`use_aggregation`.
        on_suspect: ``(peer_id, module_id, round_no, why)``, called once per other peer whose
            contribution to a part we reduced was dropped (NaN/Inf, malformed) or clipped by the rule:
            the hook for reporting hostile peers to the coordinator. Runs on the calling exchange
            thread right after the round; keep it quick (queue the report, do not block on an RPC).
    """

    def __init__(self, dht: Any, run_id: str, config_hash: str, data_hash: str = "",
                 bandwidth: Optional[float] = None, throughput: float = 0.0,
                 state_provider: Optional[StateProvider] = None, holder_ttl: float = 30.0,
                 startup_timeout: float = 30.0, event_hook: Optional[EventHook] = None,
                 aggregation: Aggregation = MEAN, on_suspect: Optional[SuspectHook] = None,
                 credential: Optional[Callable[[], bytes]] = None, verifier: Optional[Any] = None,
                 relayed: bool = False, direct_lanes: bool = True, lane_port: int = 0,
                 lane_listen: Sequence[str] = ()):
        self.dht = unwrap_dht(dht)
        self.direct_lanes = direct_lanes
        self.lane_port = lane_port
        self.lane_listen = tuple(lane_listen)
        self.relayed = relayed
        self._credential = credential or (lambda: b"")
        self._verifier = verifier
        self.run_id = run_id
        self.config_hash = config_hash
        self.data_hash = data_hash
        if bandwidth is None:
            bandwidth = 0.0 if self.dht.client_mode else DEFAULT_BANDWIDTH
        if not (math.isfinite(bandwidth) and bandwidth >= 0):
            raise ValueError(f"bandwidth must be a finite number >= 0, got {bandwidth}")
        self.bandwidth = float(bandwidth)
        self.throughput = float(throughput)
        self.holder_ttl = holder_ttl
        self.wait_for_behind = True
        """Whether a member otherwise alone waits for holders behind it (:meth:`use_round_policy`)."""
        self.max_group_size = 0
        """Split a round of a module with more live holders into groups of about this size, averaged in
        levels of groups none larger than it (:mod:`peer.averaging.hierarchy`; 0: one group a module). :meth:`use_group_cap`."""
        self.peer_id: str = self.dht.peer_id.to_base58()
        self.prefix = f"hivepath_{run_id}"
        self._event_hook = event_hook
        self._aggregation = aggregation
        self.on_suspect = on_suspect
        self.on_isolated: Optional[Callable[[], None]] = None
        """Called when a round found no other holder to average with (a lone round, or declared
        holders that never joined): we may be cut off from part of the swarm. ``peer.node`` sets it to
        ``PeerDHT.poke`` so the DHT re-checks its routing table against the coordinator's peers."""
        self.coordinator_contact: Optional[Callable[[], Optional[float]]] = None
        """Since when (monotonic) the run's coordinator has answered every heartbeat, None while it
        does not. Holders whose records vanished after that are the ones cut off (or dead), and we
        may step alone as their only live holder; otherwise we may be the one cut off, and do not
        (see the matchmaker's ``_vanished``). ``peer.node`` sets it from the coordinator client."""
        self._flat_buffers = FlatBuffers()  # each round's flattened delta: no fresh round-sized vector
        # a round's decoded contribution and average, handed back by the caller (give_back)
        self._out_buffers = FlatBuffers(keep=2)
        keep_freed_memory()  # a round's temporaries stay in the heap for the next one
        self._held: dict[str, tuple[int, str]] = {}
        self._waiting_check: Optional[Any] = None
        self._waiting_checked = -math.inf
        self.last_waiting: Optional[tuple[str, int, str]] = None
        """(module, round, peer) of the last declaration :meth:`others_waiting` answered True for."""
        self._paced: dict[str, int] = {}
        """module -> the round :meth:`others_waiting` last answered True for: our declaration of
        that round says it was paced (:attr:`peer.network.records.GroupDeclaration.paced`)."""
        self._paced_sparse = False
        """That answer was for a peer whose steps are far apart (``paced_too``): our paced declaration
        says so too (:attr:`peer.network.records.GroupDeclaration.sparse`)."""
        self._archived: dict[str, int] = {}
        self._paused: set[str] = set()
        """Modules we announce as held but idle (:meth:`pause`)."""
        self._held_lock = threading.Lock()
        self._in_flight: set[Any] = set()
        """The rounds being averaged (futures on our loop): :meth:`abandon_rounds` cancels them."""
        self._abandoned = ""
        """Why rounds are refused from now on ('' while they are not)."""
        self._withdrawn: dict[str, float] = {}
        """module -> DHT expiration of our last withdrawal of its holder record."""
        self._expires: dict[str, float] = {}
        """module -> DHT expiration of the holder record we last stored."""
        self._stopping = threading.Event()
        self._loop = _new_loop()
        # the codec's work (encode, zstd, decode, reduce) runs in this pool, not in asyncio's default
        # one of up to cores + 4 threads: more threads than CODEC_THREADS only fight over the GIL and
        # the caches, for more CPU per MB and a lower link efficiency (measured by ``bench.comm``)
        self._codec_pool = concurrent.futures.ThreadPoolExecutor(CODEC_THREADS, thread_name_prefix="net-averager-codec")
        self._loop.set_default_executor(self._codec_pool)
        self._thread = threading.Thread(target=self._loop.run_forever, name="net-averager", daemon=True)
        self._thread.start()
        self._state_server: Optional[StateServer] = None
        try:
            self._call(self._start(state_provider), startup_timeout)
        except BaseException:
            self.shutdown()
            raise
        self._refresher = threading.Thread(target=self._refresh_loop, name="holder-refresh", daemon=True)
        self._refresher.start()

    async def _start(self, provider: Optional[StateProvider]) -> None:
        self._p2p = await self.dht.replicate_p2p()
        self._lanes = None
        if self.direct_lanes:
            # behind NAT (or in client mode) nobody can dial us directly: we offer no lane, but use theirs
            offer = not (self.relayed or self.dht.client_mode)
            self._lanes = DirectLanes(self._p2p, self.prefix, offer=offer)
            visible = lane_hosts(await self._p2p.get_visible_maddrs()) if offer else []
            await self._lanes.start(visible, list(self.lane_listen) or None, self.lane_port)
        self._server = ReductionServer(self._p2p, self.peer_id, self.prefix, event_hook=self._event_hook,
                                       aggregation=self._aggregation, lanes=self._lanes)
        self._state_server = StateServer(self._p2p, self.config_hash, self.prefix, provider, verifier=self._verifier)
        self._matchmaker = Matchmaker(self.dht, self._p2p, self.peer_id, self.run_id, self.config_hash,
                                      self.data_hash, self.bandwidth, self.prefix, credential=self._credential,
                                      verifier=self._verifier, joiners=self._state_server.joiners,
                                      relayed=self.relayed,
                                      in_touch_since=lambda: self.coordinator_contact and self.coordinator_contact())
        self._relay = ResultRelay(self._p2p, self.peer_id, self.prefix, credential=self._credential,
                                  verifier=self._verifier)
        await self._server.start()
        await self._matchmaker.start()
        await self._state_server.start()
        await self._relay.start()

    @property
    def lane_streams(self) -> int:
        """Streams we opened over direct lanes so far (:mod:`peer.network.lanes`); the rest went
        through the p2p daemon."""
        return self._lanes.opened if self._lanes is not None else 0

    @property
    def loop_thread_id(self) -> Optional[int]:
        """The native id of the thread running the averager's event loop (its CPU is the exchange's
        stream I/O to the p2p daemon; :mod:`peer.compression.phases` counts the rest)."""
        return self._thread.native_id

    def _call(self, coro: Any, timeout: Optional[float]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    @property
    def aggregation(self) -> Aggregation:
        """The reduction rule of the parts this peer reduces."""
        return self._aggregation

    def use_aggregation(self, rule: Aggregation) -> None:
        """Adopt the run's rule (``DiLoCoOptimizer`` calls this with its ``OuterConfig``); applies from
        the next reduction on."""
        self._aggregation = rule
        if getattr(self, "_server", None) is not None:
            self._server.aggregation = rule

    # -- holder records -----------------------------------------------------------------------

    def hold(self, module_id: str, round_no: int, wait: bool = True, digest: str = "") -> None:
        """Announce that we hold ``module_id`` and will average its round ``round_no`` next, with the
        state of ``digest`` when known (``wait``: until the DHT stored it, at most
        :data:`peer.network.records.STORE_TIMEOUT` seconds: a DHT process that stopped answering must not
        hang the training thread; the refresh loop stores the record again). Re-announcing the same
        round costs nothing; a digest is kept until the round changes."""
        with self._held_lock:
            held = self._held.get(module_id)
            if held is not None and held[0] == int(round_no) and (not digest or held[1] == digest):
                return
            self._held[module_id] = (int(round_no), digest)
        future = self._publish(module_id, int(round_no), digest)
        if wait:
            try:
                future.result(STORE_TIMEOUT)
            except TimeoutError:
                log.warning("announcing module %s round %d: the DHT did not store it within %.0fs (retried by "
                            "the refresh loop)", module_id, round_no, STORE_TIMEOUT)

    def pause(self, module_id: str) -> None:
        """Announce ``module_id`` as held but idle until :meth:`resume`: other holders neither wait for us
        to declare its rounds nor to catch up with them (:attr:`peer.network.records.HolderRecord.idle`).
        A stage server nobody drives, or a trainer whose pipeline lacks a level, pauses so that the
        module's other holders average without it; it re-syncs when it trains again and is behind."""
        with self._held_lock:
            if module_id in self._paused:
                return
            self._paused.add(module_id)
            held = self._held.get(module_id)
        if held is not None:
            self._publish(module_id, *held)

    def resume(self, module_id: str, round_no: int) -> None:
        """Hold ``module_id`` in its rounds again, at ``round_no``, after :meth:`pause` (announced in the
        background)."""
        with self._held_lock:
            was = module_id in self._paused
            self._paused.discard(module_id)
            held = self._held.get(module_id)
        if was and held is not None and held[0] == int(round_no):
            self._publish(module_id, *held)
        else:
            self.hold(module_id, round_no, wait=False)

    def holding(self, module_id: str) -> bool:
        """Whether we announce ``module_id`` as held and not idle now (:meth:`hold`; not paused or
        released since)."""
        with self._held_lock:
            return module_id in self._held and module_id not in self._paused

    def give_back(self, result: AverageResult) -> None:
        """The caller is done with ``result.averaged`` and ``result.own_decoded`` (it applied them and
        keeps no view of them): their vectors are reused by a later round of the same size, which then
        faults no fresh pages (two module-sized vectors a round)."""
        for buf in result.buffers:
            self._out_buffers.give(buf)

    def announce_archive(self, module_id: str, round_no: int) -> None:
        """Announce that we serve ``module_id``'s state at ``round_no`` without averaging it (an archive
        peer): newcomers may fetch from us, but groups never wait for us. Refreshed in the background."""
        with self._held_lock:
            self._archived[module_id] = int(round_no)
        self._publish_archive(module_id, int(round_no)).result()

    def _publish_archive(self, module_id: str, round_no: int) -> Any:
        from hivemind.utils import get_dht_time

        record = ArchiveRecord(self.config_hash, self.data_hash, round_no, self._credential())
        return self.dht.store(archive_key(self.run_id, module_id), to_value(record),
                              get_dht_time() + self.holder_ttl, subkey=self.peer_id, return_future=True)

    def release(self, module_id: str, timeout: float = WITHDRAW_TIMEOUT) -> None:
        """Stop announcing ``module_id`` and withdraw our records of it at once: the holder (or archive)
        record and our last group declaration are replaced by a
        :func:`peer.network.records.withdrawal`, so the other holders stop waiting for us now rather
        than when the records would have expired (``holder_ttl``). Waits up to ``timeout`` seconds for
        the DHT; a failure is logged (the records then expire as before)."""
        with self._held_lock:
            held = self._held.pop(module_id, None)
            archived = self._archived.pop(module_id, None)
        # each key's withdrawal says the round we left at: holders still behind it re-sync instead of
        # stepping alone into a second state at a round we already applied
        keys = ([(holders_key(self.run_id, module_id), held[0])] if held is not None else []) + \
               ([(archive_key(self.run_id, module_id), archived)] if archived is not None else [])
        if not keys or self._stopping.is_set() or not self._loop.is_running():
            return
        try:
            self._call(self._withdraw(module_id, keys), timeout)
        except Exception as e:  # a DHT shutting down or unreachable: the records expire within holder_ttl
            log.info("could not withdraw our records of %s (%r); they expire within %.0fs", module_id, e,
                     self.holder_ttl)

    async def _withdraw(self, module_id: str, keys: list[tuple[str, int]]) -> None:
        from hivemind.utils import get_dht_time

        # a later expiration than the record's own (refreshed to now + holder_ttl) replaces it on every node
        # later than the record's own expiration (the DHT keeps the value of the later one)
        expires = max(get_dht_time() + self.holder_ttl, self._expires.get(module_id, 0.0)) + 1.0
        self._withdrawn[module_id] = expires  # a later hold must outlive it (see _publish)
        credential = self._credential()
        await asyncio.gather(*(self.dht.store(k, withdrawal(credential, r, self.config_hash, self.data_hash), expires,
                                              subkey=self.peer_id, return_future=True) for k, r in keys),
                             self._matchmaker.withdraw(module_id))

    def release_all(self, timeout: float = WITHDRAW_TIMEOUT) -> None:
        """:meth:`release` every module we hold or archive (a drain, a leave, a shutdown)."""
        with self._held_lock:
            modules = sorted(set(self._held) | set(self._archived))
        for module_id in modules:
            self.release(module_id, timeout)

    def _publish(self, module_id: str, round_no: int, digest: str = "") -> Any:
        from hivemind.utils import get_dht_time

        record = HolderRecord(self.config_hash, self.data_hash, round_no, self.throughput, self.bandwidth,
                              self._credential(), digest, idle=module_id in self._paused, wire=wire_key())
        # held again soon after a withdrawal (a reassignment keeping a module): the DHT keeps the value
        # of the later expiration, so ours must expire after the withdrawal's
        expires = max(get_dht_time() + self.holder_ttl, self._withdrawn.get(module_id, 0.0) + 1.0)
        self._expires[module_id] = expires
        return self.dht.store(holders_key(self.run_id, module_id), to_value(record),
                              expires, subkey=self.peer_id, return_future=True)

    def _refresh_loop(self) -> None:
        while not self._stopping.wait(self.holder_ttl / 3):
            with self._held_lock:
                held, archived = dict(self._held), dict(self._archived)
            try:
                for module_id, (round_no, digest) in held.items():
                    self._publish(module_id, round_no, digest)
                for module_id, round_no in archived.items():
                    self._publish_archive(module_id, round_no)
            except Exception as e:  # the DHT may be shutting down
                log.debug("refreshing records failed: %r", e)

    # -- pacing -------------------------------------------------------------------------------

    def others_waiting(self, rounds: Mapping[str, int], paced_too: bool = False) -> bool:
        """True when another holder of our config already declared itself ready for the current round
        of one of these modules (``module_id -> round``) after computing its whole round (a declaration
        that was itself paced does not count, :attr:`peer.network.records.GroupDeclaration.paced`,
        unless ``paced_too``: for a peer whose steps are far apart, the one every round waits on, which
        counts a paced declaration too unless it came from another such peer,
        :attr:`peer.network.records.GroupDeclaration.sparse`): it
        waits in matchmaking, so ``DiLoCoOptimizer`` ends its round now with the tokens it has, and
        our declaration of it says so. Never blocks the training loop: it answers from the
        declarations holders pushed us (:meth:`peer.averaging.matchmaking.Matchmaker._push`), else from
        a DHT check at most ``WAITING_POLL`` seconds old, refreshed in the background (False until a
        check for exactly these rounds has come back)."""
        key = tuple(sorted(rounds.items()))
        matchmaker = getattr(self, "_matchmaker", None)
        for module_id, round_no in key if matchmaker is not None else ():  # declarations pushed to us
            told = sorted(p for p, d in matchmaker.pushed_to(group_key(self.run_id, module_id, round_no)).items()
                          if not d.paced or (paced_too and not d.sparse))
            if told:
                self.last_waiting = (module_id, round_no, told[0])
                self._paced, self._paced_sparse = dict(key), paced_too
                return True
        now = time.monotonic()
        pending = self._waiting_check
        if (pending is None or pending.done()) and now - self._waiting_checked >= WAITING_POLL:
            self._waiting_checked = now
            self._waiting_check = asyncio.run_coroutine_threadsafe(self._check_waiting(key), self._loop)
        if pending is not None and pending.done() and pending.exception() is None:
            checked_key, unpaced, dense = pending.result()
            waiting = (unpaced or dense) if paced_too else unpaced
            if waiting is not None and checked_key == key:
                self.last_waiting = waiting
                self._paced, self._paced_sparse = dict(key), paced_too
                return True
        return False

    async def _check_waiting(self, key: tuple) -> tuple[tuple, Optional[tuple[str, int, str]],
                                                       Optional[tuple[str, int, str]]]:
        """``key`` and the first holder waiting on one of its rounds whose declaration was not paced, and
        the first whose declaration was paced but not by a peer whose steps are far apart."""
        # every module's key at once: one DHT round trip, not one per module, before a slower peer
        # notices that the group waits for it
        # (in a split round the members that computed their whole round declare here too, whatever
        # their bucket: Matchmaker.announce_full_round)
        found = await asyncio.gather(*(self.dht.get(group_key(self.run_id, module_id, round_no), latest=True,
                                                    return_future=True) for module_id, round_no in key))
        dense: Optional[tuple[str, int, str]] = None
        for (module_id, round_no), value in zip(key, found):
            for peer, decl in records_from_value(value, GroupDeclaration).items():
                if peer != self.peer_id and decl.config_hash == self.config_hash and decl.data_hash == self.data_hash:
                    if not decl.paced:
                        return key, (module_id, round_no, peer), dense
                    if not decl.sparse:
                        dense = dense or (module_id, round_no, peer)
        return key, None, dense

    # -- averaging ----------------------------------------------------------------------------

    def abandon_rounds(self, reason: str) -> None:
        """Cancel the rounds in flight and refuse new ones (a drain past its deadline): each returns
        at once as not applied, so the trainer keeps its last global state and checkpoints it."""
        with self._held_lock:
            self._abandoned = reason or "abandoned"
            in_flight = list(self._in_flight)
        for future in in_flight:
            future.cancel()

    def use_round_policy(self, wait_for_behind: bool) -> None:
        """Called by :class:`peer.diloco.DiLoCoOptimizer`. A member that fails a round keeps its round
        number, so holders behind it can catch up while it waits for them; in overlap mode a round's
        exchange runs behind the next round's compute, and waiting would only fail rounds: such a member
        averages alone whenever nobody is at its round (:meth:`peer.averaging.matchmaking.Matchmaker.form_group`)."""
        self.wait_for_behind = bool(wait_for_behind)

    def use_group_cap(self, max_group_size: int) -> None:
        """Called by :class:`peer.diloco.DiLoCoOptimizer` with ``outer.max_group_size`` (the config hash
        keeps every holder on the same cap): a round of a module with more live holders than this splits
        into groups averaged in levels (:mod:`peer.averaging.hierarchy`); 0 keeps one group."""
        if not (isinstance(max_group_size, int) and max_group_size >= 0):
            raise ValueError(f"max_group_size must be an int >= 0, got {max_group_size!r}")
        self.max_group_size = max_group_size

    def average(self, module_id: str, round_no: int, tensors: list[Tensor], weight: float, codec: Codec,
                timeout: float, digest: str = "") -> AverageResult:
        """One round of ``module_id``'s group among the holders whose state has ``digest`` (see
        :class:`peer.averaging.ModuleAverager`)."""
        require_codec(codec)
        if not (math.isfinite(weight) and weight > 0):
            raise ValueError(f"weight must be a finite number > 0, got {weight}")
        if self._abandoned:
            return AverageResult(None, None, 0, [], 0, 0, reason=f"not sent: {self._abandoned}")
        flat = flatten(tensors, out=self._flat_buffers.take(sum(t.numel() for t in tensors)))  # (n,)
        # the extremes, not isfinite(flat): no round-sized temporary (NaN propagates, Inf is an extreme)
        if flat.numel() and not bool(torch.isfinite(torch.stack(torch.aminmax(flat))).all()):
            self._flat_buffers.give(flat)
            return AverageResult(None, None, 0, [], 0, 0, reason="not sent: the delta holds NaN or Inf")
        t0 = time.monotonic()
        self.hold(module_id, round_no)
        try:
            # the round's deadline bounds the whole exchange (matchmaking, all-reduce, a dial to a peer
            # cut off by a partition): the training loop never waits on a round for longer
            future = asyncio.run_coroutine_threadsafe(asyncio.wait_for(
                self._average(module_id, round_no, flat, tensors, float(weight), codec, timeout, digest), timeout),
                self._loop)
            with self._held_lock:
                self._in_flight.add(future)
            try:
                res = future.result(timeout + 2.0)
            finally:
                with self._held_lock:
                    self._in_flight.discard(future)
            # the round ran to its end, so nothing reads ``flat`` any more (a round cut off by its
            # deadline, or abandoned by a drain, may still have an encoder on it in a thread: that
            # buffer is not reused)
            self._flat_buffers.give(flat)
            self._report_suspects(module_id, round_no, res.suspects)
            return res
        except Exception as e:
            log.warning("module %s round %d failed: %r", module_id, round_no, e)
            return AverageResult(None, None, 0, [], 0, 0, reason=f"{type(e).__name__}: {e}")
        finally:
            try:  # a no-op when the round's group formed: we announced round + 1 then
                if not self._abandoned:  # a drain past its deadline: we are leaving, announce nothing
                    self.hold(module_id, round_no + 1)
            except Exception as e:
                log.debug("publishing holder record failed: %r", e)
            log.debug("module %s round %d took %.2fs", module_id, round_no, time.monotonic() - t0)

    async def _average(self, module_id: str, round_no: int, flat: Tensor, like: Sequence[Tensor], weight: float,
                       codec: Codec, timeout: float, digest: str) -> AverageResult:
        paced = self._paced.get(module_id) == round_no
        sparse = paced and self._paced_sparse
        if self.max_group_size > 0:
            plan = await self._plan(module_id, round_no)
            if plan.counts[0] > 1:
                return await self._average_split(module_id, round_no, flat, like, weight, codec, timeout, digest,
                                                 paced, plan, sparse)
        # our vector is encoded while the group forms (the codec pool's thread), so the exchange starts
        # on bytes that are ready and its CPU is spent while we wait on the network, not after
        prepared = codec.prepare(flat.numel())
        own_buf = self._out_buffers.take(flat.numel())  # what the group receives from us
        if prepared is not None:
            filling = asyncio.get_running_loop().run_in_executor(None, prepared.fill, flat, own_buf)
            filling.add_done_callback(lambda f: f.cancelled() or f.exception())  # raised where awaited
        match = await self._matchmaker.form_group(module_id, round_no, timeout, digest,
                                                  wait_for_behind=self.wait_for_behind, paced=paced, sparse=sparse)
        group, reason, adopt = match.group, match.reason, match.adopt
        # announce our next round now, in the background, so it is visible long before anyone's next round
        # (behind the group, our state stays at this round until we re-sync)
        self.hold(module_id, round_no if match.ahead > round_no else round_no + 1, wait=False)
        if (group is None and not adopt and match.ahead < 0) or (group is not None
                                                                                and group.group_id == LONE):
            self._isolated()
        if group is None:
            log.info("module %s round %d: no group (%s)", module_id, round_no, reason)
            if prepared is not None:  # the encoding is not needed: its vector is reused once it ended
                await asyncio.wait([filling])
            self._out_buffers.give(own_buf)
            return AverageResult(None, None, 0, [], 0, 0, reason=reason, adopt=adopt, ahead=match.ahead,
                                 ahead_left=match.ahead_left)
        if group.group_id == LONE:
            # alone because nobody else holds the module, or because the holders behind us did not catch
            # up: what the group would have received from us is what we apply
            if prepared is not None:
                await filling
            else:
                codec.roundtrip_into(flat, own_buf)
            mine = unflatten(own_buf, like)
            return AverageResult([t.clone() for t in mine], mine, 1, [self.peer_id], 0, 0,
                                 reason=reason or LONE_HOLDER, buffers=(own_buf,))
        self._server.event("group_formed")
        buffers = (own_buf, self._out_buffers.take(flat.numel()))
        formed = time.monotonic()
        out = await self._server.run(group, flat, weight, codec, out=buffers, prepared=prepared)
        transfer = time.monotonic() - formed
        suspicious = "; ".join(f"{p}: {why}" for p, why in sorted(out.suspects.items()))
        notes = "; ".join(r for r in (reason, out.reason, suspicious) if r)
        own = unflatten(out.own_decoded, like)
        if out.averaged is None:
            log.warning("module %s round %d failed: %s", module_id, round_no, notes)
            return AverageResult(None, own, 0, [], out.bytes_sent, out.bytes_received, reason=notes,
                                 suspects=out.suspects, transfer_seconds=transfer, link_times=out.link)
        return AverageResult(unflatten(out.averaged, like), own, len(out.contributors), out.contributors,
                             out.bytes_sent, out.bytes_received, reason=notes, suspects=out.suspects,
                             transfer_seconds=transfer, buffers=buffers, link_times=out.link)

    async def _live_holders(self, module_id: str) -> dict[str, HolderRecord]:
        """The module's other live holders of our config and dataset that train it now (one DHT read;
        an idle holder declares no round: :attr:`peer.network.records.HolderRecord.idle`)."""
        found = await self.dht.get(holders_key(self.run_id, module_id), latest=True, return_future=True)
        return {p: h for p, h in records_from_value(found, HolderRecord, self._verifier).items()
                if p != self.peer_id and h.config_hash == self.config_hash and h.data_hash == self.data_hash
                and not h.idle and h.wire == wire_key()}

    async def _plan(self, module_id: str, round_no: int) -> SplitPlan:
        """How this round of ``module_id`` splits (:class:`peer.averaging.hierarchy.SplitPlan` of its live
        holders, us included): the groups of each level, and which hold a live holder (the top group
        needs more than half of those of the last level). Every holder counts them from the same holder
        records, whatever round each announces, so all delegates of a round agree on the majority
        (counting only the holders at this round would let an early set of buckets and a late one each
        see a majority of its own)."""
        live = [*await self._live_holders(module_id), self.peer_id]
        return SplitPlan.of(module_id, round_no, live, self.max_group_size)

    async def _average_split(self, module_id: str, round_no: int, flat: Tensor, like: Sequence[Tensor], weight: float,
                             codec: Codec, timeout: float, digest: str, paced: bool, plan: SplitPlan,
                             sparse: bool = False) -> AverageResult:
        """A round averaged in levels (:mod:`peer.averaging.hierarchy`): our bucket's group, then its
        delegate up the groups of delegates to the top group, then the top group's average down each
        group's tree."""
        t0 = time.monotonic()
        buckets, held = plan.counts[0], plan.held(plan.levels)
        bucket = group_bucket(module_id, round_no, self.peer_id, buckets)
        if not paced:  # every holder's others_waiting reads the module's key, whatever its bucket
            self._matchmaker.announce_full_round(module_id, round_no, digest, timeout)
        match = await self._matchmaker.form_group(
            module_id, round_no, timeout, digest, wait_for_behind=self.wait_for_behind, paced=paced, sparse=sparse,
            bucket=(bucket, buckets), weight=weight, end_share=SPLIT_BUCKET)
        group, reason, adopt = match.group, match.reason, match.adopt
        self.hold(module_id, round_no if match.ahead > round_no else round_no + 1, wait=False)
        if group is None and not adopt and match.ahead < 0:
            # our bucket formed without us (or not at all): the round's average, if its top group gets
            # through, applied with nothing of ours in it (our delta carries into the next round)
            agreed = self._agreement(module_id, round_no, digest, held, t0 + SPLIT_END * timeout)
            late_suspects: dict[str, str] = {}
            try:
                late = await self._late_result(module_id, round_no, flat.numel(), codec, t0 + SPLIT_END * timeout,
                                               digest, agreed, late_suspects)
            finally:
                agreed.close()
            self._report_suspects(module_id, round_no, late_suspects)
            if late is not None:
                log.info("module %s round %d: missed group %d of %d (%s); applying the round's average",
                         module_id, round_no, bucket, buckets, reason)
                return AverageResult(unflatten(late.decode(codec, torch.empty_like(flat)), like),
                                     unflatten(torch.zeros_like(flat), like), len(late.contributors),
                                     list(late.contributors), 0, sum(len(d) for *_, d in late.parts),
                                     reason=f"late: missed group {bucket} of {buckets} ({reason}), our delta carries over")
        if group is None:
            log.info("module %s round %d: no group %d of %d (%s)", module_id, round_no, bucket, buckets, reason)
            return AverageResult(None, None, 0, [], 0, 0, reason=reason, adopt=adopt, ahead=match.ahead,
                                 ahead_left=match.ahead_left)
        # our place in the bucket's tree, before the all-reduce: children may ask as soon as theirs ends
        served = self._relay.expect(group, t0 + SPLIT_END * timeout) if group.group_id != LONE else None
        try:
            formed = time.monotonic()
            result = await self._split_levels(module_id, round_no, flat, like, weight, codec, timeout, digest, t0,
                                              bucket, plan, group, reason, served)
            return dataclasses.replace(result, transfer_seconds=time.monotonic() - formed)
        finally:
            if served is not None and not served.complete:
                self._relay.fail(group.group_id, "the round failed here")

    async def _split_levels(self, module_id: str, round_no: int, flat: Tensor, like: Sequence[Tensor], weight: float,
                            codec: Codec, timeout: float, digest: str, t0: float, bucket: int, plan: SplitPlan,
                            group: Group, reason: str, served: Optional[Any]) -> AverageResult:
        buckets, held = plan.counts[0], plan.held(plan.levels)
        sent = received = 0
        link = None  # our bucket's all-reduce, part by part (the levels above give totals only)
        suspects: dict[str, str] = {}
        deadline = t0 + SPLIT_END * timeout
        if group.group_id == LONE:  # alone in our bucket: our own delta goes to the top group
            own = codec.roundtrip(flat)  # (n,)
            if own.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr():
                own = own.clone()  # ``flat`` is reused next round
            mean, contributors, mean_weight, bucket_parts = own, [self.peer_id], float(weight), None
        else:
            self._server.event("group_formed")
            out = await self._server.run(group, flat, weight, codec)
            sent, received, suspects, link = out.bytes_sent, out.bytes_received, out.suspects, out.link
            own = out.own_decoded
            if out.averaged is None:
                log.warning("module %s round %d failed in group %d of %d: %s", module_id, round_no, bucket, buckets,
                            out.reason)
                return AverageResult(None, unflatten(own, like), 0, [], sent, received, reason=out.reason,
                                     suspects=out.suspects, link_times=link)
            mean, contributors, bucket_parts = out.averaged, out.contributors, out.parts
            mean_weight = bucket_weight(group, contributors, float(weight))
        root = delegate(group, contributors) if group.group_id != LONE else self.peer_id
        self._server.event("bucket_done")
        suspects = dict(suspects)
        if plan.levels == 1 and held <= 1 and bucket_parts is not None:
            # no top group: the round's average is our bucket's mean
            mine = RoundResult(codec.name, tuple(bucket_parts), ()).digest

            async def own_mean() -> str:
                return mine
            agreed: Any = own_mean
        else:
            agreed = self._agreement(module_id, round_no, digest, held, deadline)
        try:
            if root == self.peer_id:
                result, top_sent, top_received = await self._climb(
                    module_id, round_no, plan, 2, bucket, mean, mean_weight, bucket_parts, contributors, codec,
                    digest, t0, timeout, agreed, suspects)
                sent, received = sent + top_sent, received + top_received
            else:
                result = await self._fetch_result(group, root, flat.numel(), codec, deadline, served, agreed,
                                                  suspects)
                received += sum(len(d) for *_, d in result.parts)
        except Exception as e:
            if isinstance(e, LyingPeer):
                suspects[e.peer] = f"split round's tree: {e.why}"
            why = f"split round (group {bucket} of {buckets}): {type(e).__name__}: {e}"
            log.warning("module %s round %d failed: %s", module_id, round_no, why)
            if served is not None:  # our children fail at once (or ask the delegate)
                self._relay.fail(group.group_id, why)
            return AverageResult(None, unflatten(own, like), 0, [], sent, received, reason=why, suspects=suspects,
                                 link_times=link)
        finally:
            if isinstance(agreed, _Agreement):
                agreed.close()
        if served is not None and root == self.peer_id:  # our children in the bucket's tree ask us
            self._relay.publish(group.group_id, result)
        averaged = result.decode(codec, torch.empty_like(flat))
        if result.late:  # nothing of ours is in it: error feedback carries our whole delta into the next round
            own = torch.zeros_like(flat)
            reason = "; ".join(r for r in (reason, "late: our group missed the top group, our delta carries over") if r)
        notes = "; ".join(r for r in (reason, f"group {bucket} of {buckets}, {plan.levels + 1} levels") if r)
        # suspects: of the parts we reduced in our bucket (a top group's member is a bucket's mean, not a peer)
        return AverageResult(unflatten(averaged, like), unflatten(own, like), len(result.contributors),
                             list(result.contributors), sent, received, reason=notes, suspects=suspects,
                             link_times=link)

    def _agreement(self, module_id: str, round_no: int, digest: str, held: int, deadline: float) -> _Agreement:
        """The digest of ``module_id``'s round ``round_no`` average that more than half of the ``held``
        buckets' delegates (a top group's least size) state, for the state of ``digest``."""
        key = top_group_key(self.run_id, module_id, round_no)

        async def read() -> list[str]:
            found = await self.dht.get(key, latest=True, return_future=True)
            return [d.result for d in records_from_value(found, GroupDeclaration, self._verifier).values()
                    if d.result and d.digest == digest and d.config_hash == self.config_hash
                    and d.data_hash == self.data_hash]
        return _Agreement(read, held // 2 + 1, deadline)

    async def _climb(self, module_id: str, round_no: int, plan: SplitPlan, level: int, slot: int, mean: Tensor,
                     weight: float, parts: Optional[list[tuple[int, int, bytes]]], contributors: Sequence[str],
                     codec: Codec, digest: str, t0: float, timeout: float, agreed: Any,
                     suspects: dict[str, str]) -> tuple[RoundResult, int, int]:
        """As the delegate of our group of level ``level`` - 1 (group ``slot`` there), carrying its
        ``mean`` (the ``parts`` its members decoded; None: our own delta, alone in our bucket) with the
        tokens behind it (``weight``): the round's average, from the group of level ``level`` we meet
        the other delegates in (:func:`peer.network.records.level_group_key`), or from the top group
        above the last level. Returns it with the bytes sent and received here and above."""
        if level > plan.levels:
            return await self._top_round(module_id, round_no, mean, weight, codec, digest, t0, timeout, parts,
                                         plan.held(plan.levels), contributors, agreed, suspects, plan.levels)
        index = plan.slot(slot, level)
        gather_share, end_share = level_shares(plan.levels, level - 1)
        self._server.event("top_gather")
        key = level_group_key(self.run_id, module_id, round_no, level, index)
        group, reason, *_ = await self._matchmaker.form_top_group(
            module_id, round_no, digest, plan.held(level - 1, index), weight, t0 + gather_share * timeout,
            t0 + end_share * timeout, key=key, need=1)
        if group is None:  # it formed without us: the round's average from the top group, nothing of ours in it
            late = await self._late_result(module_id, round_no, mean.numel(), codec, t0 + SPLIT_END * timeout, digest,
                                           agreed, suspects)
            if late is None:
                raise RuntimeError(f"level {level}: {reason}")
            log.info("module %s round %d: our group missed level %d (%s); applying the round's average", module_id,
                     round_no, level, reason)
            return late, 0, sum(len(d) for *_, d in late.parts)
        if group.group_id == LONE:
            return await self._climb(module_id, round_no, plan, level + 1, index, mean, weight, parts, contributors,
                                     codec, digest, t0, timeout, agreed, suspects)
        served = self._relay.expect(group, t0 + SPLIT_END * timeout)
        try:
            out = await self._server.run(group, mean, weight, codec)
            if out.averaged is None:
                raise RuntimeError(f"level {level}'s all-reduce failed: {out.reason}")
            suspects.update(out.suspects)
            sent, received = out.bytes_sent, out.bytes_received
            root = delegate(group, out.contributors)
            if root == self.peer_id:
                result, up_sent, up_received = await self._climb(
                    module_id, round_no, plan, level + 1, index, out.averaged,
                    bucket_weight(group, out.contributors, weight), out.parts,
                    sorted(set(contributors) | set(out.contributors)), codec, digest, t0, timeout, agreed, suspects)
                self._relay.publish(group.group_id, result)
                return result, sent + up_sent, received + up_received
            result = await self._fetch_result(group, root, mean.numel(), codec, t0 + SPLIT_END * timeout, served,
                                              agreed, suspects)
            return result, sent, received + sum(len(d) for *_, d in result.parts)
        finally:
            if not served.complete:
                self._relay.fail(group.group_id, f"the round failed at level {level}")

    async def _top_round(self, module_id: str, round_no: int, mean: Tensor, weight: float, codec: Codec, digest: str,
                         t0: float, timeout: float, bucket_parts: Optional[list[tuple[int, int, bytes]]],
                         held: int, contributors: Sequence[str], agreed: Any,
                         suspects: dict[str, str], levels: int = 1) -> tuple[RoundResult, int, int]:
        """As our bucket's delegate: the top group's all-reduce of the bucket means (``held``: how many
        buckets hold a live holder; the top group needs more than half of them). Returns the round's
        average as the parts every holder decodes, and the bytes sent and received.

        When ours is the only bucket with live holders, its mean is the round's (``bucket_parts``, the
        bytes every member of the bucket decoded; a member alone in it fails the round instead of
        stepping alone while other holders live). When the top group formed without us (our bucket
        was late), the round's average from one of its members, marked ``late``, checked against the
        digest most delegates state (``agreed``; a member that sent another is added to ``suspects``).
        A member of the top group states the digest of its average (:meth:`Matchmaker.announce_result`)."""
        if held <= 1:
            if bucket_parts is None:
                raise RuntimeError("no other holder at this round (not stepping alone while others live)")
            result = RoundResult(codec.name, tuple(bucket_parts), tuple(contributors))
            # the members of groups below ours that did not compute these parts check them against this
            self._matchmaker.announce_result(module_id, round_no, digest, result.digest, (SPLIT_END + 0.1) * timeout)
            return result, 0, 0
        gather_share, end_share = level_shares(levels, levels)
        end = t0 + end_share * timeout
        self._server.event("top_gather")
        top, reason, *_ = await self._matchmaker.form_top_group(module_id, round_no, digest, held, weight,
                                                               t0 + gather_share * timeout, end)
        if top is None:
            late = await self._late_result(module_id, round_no, mean.numel(), codec, t0 + SPLIT_END * timeout, digest,
                                           agreed, suspects)
            if late is None:
                raise RuntimeError(reason)
            log.info("module %s round %d: our group missed the top group (%s); applying its average", module_id,
                     round_no, reason)
            return late, 0, sum(len(d) for *_, d in late.parts)
        self._relay.expect_round(module_id, round_no, t0 + SPLIT_END * timeout)  # for groups that come late
        out = await self._server.run(top, mean, weight, codec)
        if out.averaged is None:
            self._relay.fail(round_key(module_id, round_no), "the top group failed")
            raise RuntimeError(f"the top group's all-reduce failed: {out.reason}")
        result = RoundResult(codec.name, tuple(out.parts), tuple(sorted(set(contributors) | set(top.members))))
        self._matchmaker.announce_result(module_id, round_no, digest, result.digest, (SPLIT_END + 0.1) * timeout)
        self._relay.publish(round_key(module_id, round_no), result)
        return result, out.bytes_sent, out.bytes_received

    async def _late_result(self, module_id: str, round_no: int, numel: int, codec: Codec, deadline: float,
                           digest: str, agreed: Any, suspects: dict[str, str]) -> Optional[RoundResult]:
        """The round's average from a member of the top group that formed without us (None if none
        serves one by ``deadline``): only a top group of most buckets applies one, so it is the round's.
        Asked only of delegates that declared the state we hold (``digest``): the average is applied to it,
        once checked against the digest most of them state (``agreed``; one that sends another is added
        to ``suspects``)."""
        tried: set[str] = set()
        while time.monotonic() < deadline:
            found = await self.dht.get(top_group_key(self.run_id, module_id, round_no), latest=True, return_future=True)
            members = sorted(p for p, d in records_from_value(found, GroupDeclaration, self._verifier).items()
                             if p != self.peer_id and p not in tried and d.digest == digest
                             and d.config_hash == self.config_hash and d.data_hash == self.data_hash)
            tried.update(members)
            # all at once (one that never joined the top group answers only after UNKNOWN_WAIT); the
            # parts are the same bytes at every member of the top group, so the first answer is the one
            tasks = [asyncio.ensure_future(self._relay.fetch(peer, round_key(module_id, round_no), numel, codec,
                                                             deadline, late=True, agreed=agreed)) for peer in members]
            try:
                for next_done in asyncio.as_completed(tasks):
                    try:
                        return await next_done
                    except LyingPeer as e:
                        suspects[e.peer] = f"split round's average: {e.why}"
                    except Exception as e:
                        log.debug("the average of %s round %d: %r", module_id, round_no, e)
            finally:
                for task in tasks:
                    task.cancel()
            await asyncio.sleep(min(LATE_POLL, max(0.0, deadline - time.monotonic())))
        return None

    async def _fetch_result(self, group: Group, root: str, numel: int, codec: Codec, deadline: float,
                            place: Any, agreed: Any, suspects: dict[str, str]) -> RoundResult:
        """The round's average from our parent in the bucket's tree, or from the delegate itself if the
        parent has none (gone, or failed, or sent other bytes than the top group's: then it is added to
        ``suspects``); checked against ``agreed`` and passed on to our children as it arrives (``place``)."""
        parent = tree_parent(group, root, self.peer_id)
        try:
            return await self._relay.fetch(parent, group.group_id, numel, codec, deadline, place, agreed=agreed)
        except Exception as e:
            if isinstance(e, LyingPeer):
                suspects[e.peer] = f"split round's tree: {e.why}"
            if parent == root:
                raise
            log.log(logging.WARNING if isinstance(e, LyingPeer) else logging.INFO,
                    "the average of group %s from %s failed (%r); asking its delegate %s", group.group_id,
                    parent[-8:], e, root[-8:])
            return await self._relay.fetch(root, group.group_id, numel, codec, deadline, place, agreed=agreed)

    def _isolated(self) -> None:
        if self.on_isolated is not None:
            try:
                self.on_isolated()
            except Exception as e:  # a hint only
                log.debug("on_isolated hook failed: %r", e)

    def _report_suspects(self, module_id: str, round_no: int, suspects: Mapping[str, str]) -> None:
        for peer, why in sorted(suspects.items()):
            if peer == self.peer_id:
                continue
            log.warning("module %s round %d: suspect %s (%s)", module_id, round_no, peer, why)
            if self.on_suspect is not None:
                try:
                    self.on_suspect(peer, module_id, round_no, why)
                except Exception as e:  # a reporting failure must not fail the round
                    log.warning("on_suspect hook failed: %r", e)

    # -- state transfer -----------------------------------------------------------------------

    def serve_states(self, provider: StateProvider) -> None:
        """Serve newcomers the states ``provider(module_id)`` returns (e.g. ``DiLoCoOptimizer.module_state``)."""
        assert self._state_server is not None
        self._state_server.provider = provider

    def fetch_state(self, module_id: str, timeout: float, like: Optional[Sequence[Tensor]] = None,
                    accept: Optional[Callable[[ModuleState], str]] = None, min_round: int = -1,
                    joining: bool = True) -> ModuleState:
        """Fetch ``module_id``'s global params, outer momentum and round from a live holder of our
        config hash (``accept``, ``min_round``, ``joining``: see :func:`peer.averaging.state_transfer.fetch_module_state`);
        raises :class:`peer.averaging.state_transfer.StateTransferError` if none can send it."""
        state = self._call(fetch_module_state(self.dht, self._p2p, self.run_id, module_id, self.config_hash,
                                              self.prefix, self.peer_id, timeout, like, credential=self._credential,
                                              verifier=self._verifier, accept=accept, min_round=min_round,
                                              joining=joining),
                           timeout + 5.0)
        if joining:
            self._matchmaker.fetched(module_id, state.source, state.round_no)
        return state

    # -- life cycle ---------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Withdraw our records, stop refreshing them and stop the loop (the DHT itself belongs to the caller)."""
        if self._loop.is_running():
            self.release_all()
        self._stopping.set()
        if self._loop.is_running():
            try:
                self._call(self._stop(), 5.0)
            except Exception as e:
                log.debug("stopping the averager loop: %r", e)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
        self._codec_pool.shutdown(wait=False, cancel_futures=True)

    async def _stop(self) -> None:
        lanes = getattr(self, "_lanes", None)
        if lanes is not None:
            await lanes.close()
        p2p = getattr(self, "_p2p", None)
        if p2p is not None:
            await p2p.shutdown()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def __enter__(self) -> "NetAverager":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
