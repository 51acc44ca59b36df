"""``NetAverager``: the :class:`peer.averaging.ModuleAverager` of real peers, over hivemind's DHT and P2P.

Per (module, round) it matchmakes a group among the module's live holders (:mod:`peer.averaging.matchmaking`)
and runs the bit-identical all-reduce (:mod:`peer.averaging.allreduce`): every member applies the same
decoded bytes, so replicas stay identical whatever the codec (DiLoCo, Douillard et al. 2023; DiPaCo,
Douillard et al. 2024); a round of a module with more live holders than ``outer.max_group_size`` is handed
to :mod:`peer.averaging.split_round`. It also publishes this peer's
:class:`~peer.network.records.HolderRecord` for each module it holds (:mod:`peer.averaging.holder_records`),
tells the training loop when others wait for it (:mod:`peer.averaging.pacing`) and serves module states to
newcomers (:mod:`peer.averaging.state_transfer`).

One ``NetAverager`` per process and run: it owns an asyncio loop on a background thread, on which
a replica of the DHT's p2p daemon handle serves the ``hivepath_{run_id}_*`` protocols.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import threading
import time
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
from torch import Tensor

from peer.averaging.aggregation import MEAN, Aggregation
from peer.averaging.allreduce import ReductionServer
from peer.averaging.contract import LONE_HOLDER, AverageResult, SuspectHook, require_codec
from peer.averaging.holder_records import HolderRecords
from peer.averaging.matchmaking import LONE, Matchmaker
from peer.averaging.memory import FlatBuffers, keep_freed_memory
from peer.averaging.pacing import WaitingCheck
from peer.averaging.reducer import EventHook
from peer.averaging.result_relay import ResultRelay
from peer.averaging.split_round import SplitRounds
from peer.averaging.state_transfer import StateProvider, StateServer, fetch_module_state
from peer.averaging.vectors import flatten, unflatten
from peer.compression import Codec
from peer.network import unwrap_dht
from peer.network.lanes import DirectLanes, lane_hosts
from peer.outer import ModuleState

__all__ = ["NetAverager"]

log = logging.getLogger(__name__)

DEFAULT_BANDWIDTH = 100e6 / 8
"""Bytes/s assumed for the upload link when none was measured (100 Mbit/s)."""
RELAYED_SHARE = 1e-3
"""The fraction of its upload a peer dialled through a relay offers to reductions: next to a
reachable member it reduces (next to) nothing, so no part crosses its relay; in a group of relayed
members alone they share the work as their links allow."""
WITHDRAW_TIMEOUT = 5.0
"""Seconds a release waits for the DHT to store its withdrawals (a drain must not hang on it)."""
SPARSE_ROUNDS = 3
"""Rounds after which a module whose gathers read no declaration of a peer whose steps are far apart
no longer counts as shared with one (:meth:`NetAverager.shares_with_sparse`): such a peer's round
sometimes ends at its own step, and then its declaration does not say so."""


CODEC_THREADS = 2
"""Threads of the averager's executor: encoding one part while another is decoded; the codec's passes
release the GIL, its glue between them does not."""


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
        (see :meth:`peer.averaging.holder_memory.HolderMemory.vanished`). ``peer.node`` sets it from the
        coordinator client."""
        self._flat_buffers = FlatBuffers()  # each round's flattened delta: no fresh round-sized vector
        # a round's decoded contribution and average, handed back by the caller (give_back)
        self._out_buffers = FlatBuffers(keep=2)
        keep_freed_memory()  # a round's temporaries stay in the heap for the next one
        self._records = HolderRecords(self.dht, run_id, self.peer_id, config_hash, data_hash, self.throughput,
                                      self.bandwidth, self._credential, holder_ttl)
        self._rounds_lock = threading.Lock()
        self._in_flight: set[Any] = set()
        """The rounds being averaged (futures on our loop): :meth:`abandon_rounds` cancels them."""
        self._abandoned = ""
        """Why rounds are refused from now on ('' while they are not)."""
        self._loop = _new_loop()
        self._pacing = WaitingCheck(self.dht, run_id, self.peer_id, config_hash, data_hash, self._loop)
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
        self._records.start()

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
        self._pacing.matchmaker = self._matchmaker
        self._relay = ResultRelay(self._p2p, self.peer_id, self.prefix, credential=self._credential,
                                  verifier=self._verifier)
        self._split = SplitRounds(self.dht, self.run_id, self.peer_id, self.config_hash, self.data_hash,
                                  self._matchmaker, self._server, self._relay, self._verifier,
                                  hold=self.hold, report=self._report_suspects)
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

    # -- holder records (peer.averaging.holder_records) -----------------------------------------

    def hold(self, module_id: str, round_no: int, wait: bool = True, digest: str = "") -> None:
        """Announce that we hold ``module_id`` and will average its round ``round_no`` next, with the
        state of ``digest`` when known (:meth:`peer.averaging.holder_records.HolderRecords.hold`)."""
        self._records.hold(module_id, round_no, wait, digest)

    def pause(self, module_id: str) -> None:
        """Announce ``module_id`` as held but idle until :meth:`resume`: other holders average it without
        us (:meth:`peer.averaging.holder_records.HolderRecords.pause`)."""
        self._records.pause(module_id)

    def resume(self, module_id: str, round_no: int) -> None:
        """Hold ``module_id`` in its rounds again, at ``round_no``, after :meth:`pause` (announced in the
        background)."""
        self._records.resume(module_id, round_no)

    def holding(self, module_id: str) -> bool:
        """Whether we announce ``module_id`` as held and not idle now (:meth:`hold`; not paused or
        released since)."""
        return self._records.holding(module_id)

    def give_back(self, result: AverageResult) -> None:
        """The caller is done with ``result.averaged`` and ``result.own_decoded`` (it applied them and
        keeps no view of them): their vectors are reused by a later round of the same size, which then
        faults no fresh pages (two module-sized vectors a round)."""
        for buf in result.buffers:
            self._out_buffers.give(buf)

    def announce_archive(self, module_id: str, round_no: int) -> None:
        """Announce that we serve ``module_id``'s state at ``round_no`` without averaging it (an archive
        peer): newcomers may fetch from us, but groups never wait for us. Refreshed in the background."""
        self._records.announce_archive(module_id, round_no)

    def release(self, module_id: str, timeout: float = WITHDRAW_TIMEOUT) -> None:
        """Stop announcing ``module_id`` and withdraw our records of it at once: the holder (or archive)
        record and our last group declaration are replaced by a
        :func:`peer.network.records.withdrawal`, so the other holders stop waiting for us now rather
        than when the records would have expired (``holder_ttl``). Waits up to ``timeout`` seconds for
        the DHT; a failure is logged (the records then expire as before)."""
        keys = self._records.forget(module_id)
        if not keys or self._records.stopped or not self._loop.is_running():
            return
        try:
            self._call(self._withdraw(module_id, keys), timeout)
        except Exception as e:  # a DHT shutting down or unreachable: the records expire within holder_ttl
            log.info("could not withdraw our records of %s (%r); they expire within %.0fs", module_id, e,
                     self.holder_ttl)

    async def _withdraw(self, module_id: str, keys: list[tuple[str, int]]) -> None:
        await asyncio.gather(self._records.withdraw(module_id, keys), self._matchmaker.withdraw(module_id))

    def release_all(self, timeout: float = WITHDRAW_TIMEOUT) -> None:
        """:meth:`release` every module we hold or archive (a drain, a leave, a shutdown)."""
        for module_id in self._records.modules():
            self.release(module_id, timeout)

    # -- pacing -------------------------------------------------------------------------------

    def shares_with_sparse(self, module_id: str, round_no: int, within: int = SPARSE_ROUNDS) -> bool:
        """Whether a gather of ``module_id`` in the ``within`` rounds before ``round_no`` read the
        declaration of a peer whose steps are far apart (a pipeline trainer or stage server): such a
        member's group forms once it noticed the others waiting (``DiLoCoOptimizer(overlap_beside_sparse)``
        reads it). Never blocks: a dict read."""
        matchmaker = self._pacing.matchmaker  # None until the averager started
        seen = matchmaker.sparse_seen.get(module_id) if matchmaker is not None else None
        return seen is not None and round_no - seen <= within

    def others_waiting(self, rounds: Mapping[str, int], paced_too: bool = False) -> bool:
        """True when another holder of our config already waits in matchmaking for the current round of
        one of these modules (``module_id -> round``), so ``DiLoCoOptimizer`` ends its round now; never
        blocks (:meth:`peer.averaging.pacing.WaitingCheck.others_waiting`)."""
        return self._pacing.others_waiting(rounds, paced_too)

    def gathering(self, module_id: str, round_no: int, digest: str, timeout: float = 5.0) -> bool:
        """Whether other holders at state ``digest`` still gather ``module_id``'s round ``round_no``
        (declared it, and no group of it began): a declaration of ours now would join their group
        (:meth:`peer.averaging.matchmaking.Matchmaker.gathering`). Blocks for one DHT read."""
        return bool(self._call(self._matchmaker.gathering(module_id, round_no, digest), timeout))

    @property
    def last_waiting(self) -> Optional[tuple[str, int, str]]:
        """(module, round, peer) of the last declaration :meth:`others_waiting` answered True for."""
        return self._pacing.last_waiting

    # -- averaging ----------------------------------------------------------------------------

    def abandon_rounds(self, reason: str) -> None:
        """Cancel the rounds in flight and refuse new ones (a drain past its deadline): each returns
        at once as not applied, so the trainer keeps its last global state and checkpoints it."""
        with self._rounds_lock:
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
            with self._rounds_lock:
                self._in_flight.add(future)
            try:
                res = future.result(timeout + 2.0)
            finally:
                with self._rounds_lock:
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
        paced, sparse = self._pacing.paced(module_id, round_no), self._pacing.sparse(module_id, round_no)
        if self.max_group_size > 0:
            plan = await self._split.plan(module_id, round_no, self.max_group_size)
            if plan.counts[0] > 1:
                return await self._split.average(module_id, round_no, flat, like, weight, codec, timeout, digest,
                                                 paced, plan, self.wait_for_behind, sparse)
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
        # announce our next round in the background, visible long before anyone's next round (behind the
        # group, our state stays at this round until we re-sync); a trainer announces that round's digest
        # once it applied the round, within the round's budget: one store then carries both
        self._records.hold(module_id, round_no if match.ahead > round_no else round_no + 1, wait=False,
                           digest_wait=timeout)
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
        self._records.stop()
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
