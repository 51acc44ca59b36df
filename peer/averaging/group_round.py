"""``GroupRound``: one member's round of a group's all-reduce, as an object with a state.

:mod:`peer.averaging.allreduce` describes the protocol and holds the exchanges with the reducers (asked
again, or at a fallback reducer); this module holds the round that drives them: the cut of the vector
into segments and parts, the pipeline that paces our parts to each reducer (:data:`IN_FLIGHT`), the
reductions of our own parts, the averages decoded as they arrive, and the outcome
(:class:`AllReduceOutcome`). It is separate because the round's state and steps are one concern, the
wire exchanges another.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import Tensor

from peer.averaging.contract import LinkTimes
from peer.averaging.partition import Group, fallback_reducer, part_bounds, relayed_segment_bounds, segment_bounds
from peer.averaging.reducer import GroupState, PartSlot, wait_event
from peer.compression import Codec, Prepared
from peer.compression.phases import phase

__all__ = ["GroupRound", "AllReduceOutcome", "IN_FLIGHT"]

log = logging.getLogger(__name__)

IN_FLIGHT = 2
"""Most of our segments at one reducer that it has not acknowledged: the next one goes once the last
one is handed over and the one before it acknowledged, so one is always queued behind the one on the
wire (the link never waits on the acknowledgement's round trip) and no more. ``bench.comm``'s
``tcp_ceiling`` compares this schedule (``paced``) with waiting only for the handing-over
(``per_segment``) on bare TCP; more segments than :data:`~peer.averaging.partition.MAX_SEGMENTS`
cost CPU for little link efficiency."""


@dataclass
class AllReduceOutcome:
    averaged: Optional[Tensor]
    """(numel,) decoded average, identical on every member; None if a part failed."""
    own_decoded: Tensor
    """(numel,) what the group received from us after the codec."""
    contributors: list[str]
    """Peers whose contributions are in every part."""
    bytes_sent: int
    bytes_received: int
    reason: str = ""
    suspects: dict[str, str] = field(default_factory=dict)
    """Peer id -> why its contribution to a part reduced here was dropped or clipped."""
    parts: list[tuple[int, int, bytes]] = field(default_factory=list)
    """(start, end, encoded average) of every part, in vector order: the bytes ``averaged`` was decoded
    from, the same on every member (a split round's top group passes them on to the other holders,
    :mod:`peer.averaging.hierarchy`); empty when a part failed."""
    link: Optional[LinkTimes] = None
    """When ``bytes_sent`` and ``bytes_received`` crossed our link, part by part."""


class GroupRound:
    """This member's side of one group's all-reduce (:meth:`peer.averaging.allreduce.ReductionServer.run`),
    as an object that holds the round's state: the cut of the vector, our parts' encodings and
    exchanges, the averages we got back, the parts that failed, and the deadlines every step waits on.

    The round goes in two phases. In the first, every part of ours goes to its reducer
    (:meth:`_to_reducer`, :meth:`_contribute`) while we reduce our own parts (:meth:`_own`); in the
    second, each part that failed goes to its fallback reducer (:meth:`_retry_failed`). The parts we
    reduce are served by the :class:`~peer.averaging.allreduce.ReductionServer` from :attr:`state`, the
    same :class:`~peer.averaging.reducer.GroupState` it finds under the group's id."""

    def __init__(self, server: Any, group: Group, flat: Tensor, weight: float, codec: Codec,
                 out: Optional[tuple[Tensor, Tensor]], prepared: Optional[Prepared]):
        self.server = server
        """Serves the parts we reduce and carries our exchanges with the other members (the
        :class:`peer.averaging.allreduce.ReductionServer` whose :meth:`run` this round is)."""
        self.group = group
        self.flat = flat
        """(numel,) our contribution, before the codec."""
        self.weight = weight
        self.codec = codec
        self.prepared = prepared
        """``flat`` encoded while the group formed (or being encoded in a thread), our parts cut from it;
        None: each part is encoded here."""
        t0 = time.monotonic()
        # reducers close their parts well before members stop waiting for the averages
        self.reduce_deadline = t0 + 0.5 * group.allreduce_timeout
        """Our own parts are reduced with what arrived by then."""
        self.phase1_deadline = t0 + 0.7 * group.allreduce_timeout
        """Our parts' exchanges with their reducers end by then (the rest goes to fallback reducers)."""
        self.fallback_reduce_deadline = t0 + 0.85 * group.allreduce_timeout
        """A part we are the fallback reducer of is reduced with what arrived by then."""
        self.final_deadline = t0 + group.allreduce_timeout
        """The round ends by then: fallback exchanges, and the averages we still send out."""
        self.me = group.members.index(server.peer_id)
        # two members behind relays: their parts go in pieces a relayed connection carries whole
        segments = (relayed_segment_bounds(flat.numel(), group, codec.encoded_size) if group.relayed_pairs()
                    else segment_bounds(flat.numel()))
        self.bounds = [[(s0 + a, s0 + b) for a, b in part_bounds(s1 - s0, group.bandwidths)] for s0, s1 in segments]
        """Per segment, per member: the (start, end) of the part that member reduces."""
        self.state = GroupState(group, self.bounds, codec, link=LinkTimes.starting(t0))
        """What the serving side shares with us: our slots, the bytes and link counters, the suspects."""
        self.loop = asyncio.get_running_loop()
        self.members = set(group.members)
        # (numel,) each: what the group receives from us, filled as we encode; the group's average,
        # decoded segment by segment (our own parts' averages written as we encode them)
        self.own_decoded, self.averaged = out if out is not None else (torch.empty_like(flat), torch.empty_like(flat))
        self.encoded: dict[tuple[int, int], bytes] = {}
        """(segment, part) -> our encoded part, once encoded."""
        self.reducers: dict[int, asyncio.Task] = {}
        """Segment -> the reduction of our own part of it (segments where our part is empty have none)."""
        self.results: dict[tuple[int, int], tuple[bytes, list[str]]] = {}
        """(segment, part) -> the encoded average and its contributors."""
        self.errors: dict[tuple[int, int], str] = {}
        """(segment, part) -> why the part failed (at its reducer, then at its fallback reducer)."""
        n = len(group.members)
        self.order = [(self.me + k) % n for k in range(1, n)]  # start after us so reducers are hit evenly
        """The other members, in the order our parts go to them."""
        self.pending = dict(self.state.contributions(self.me))
        """Segment -> our parts of it that go out and are not encoded yet."""
        self.others_encoded = {s: asyncio.Event() for s in range(len(self.bounds))}
        """Segment -> set once our parts of it that go out are encoded (or their encoding failed)."""
        for s, left in self.pending.items():
            if left == 0:
                self.others_encoded[s].set()
        self.encodes: dict[tuple[int, int], asyncio.Task] = {}
        """(segment, part) -> the encoding of our part, started once needed."""
        self.tasks: list[asyncio.Task] = []
        """Every part's exchange, cancelled if the round ends early."""

    async def run(self) -> AllReduceOutcome:
        """The whole round: our parts to their reducers and our own parts reduced, then the failed
        parts at their fallback reducers; whatever way it ends, nothing of it keeps running."""
        self._open()
        try:
            await asyncio.gather(*(self._to_reducer(j) for j in self.order), *(self._own(s) for s in self.reducers))
            self._end_first_phase()
            await self._retry_failed()
            return await self._outcome()
        finally:
            self._close()

    def _open(self) -> None:
        """Open the slots of the parts we reduce and start reducing them, and make the group known to
        the serving side, before anything of ours is encoded: other members may send to us first."""
        state, me = self.state, self.me
        for s, parts in enumerate(self.bounds):  # open our slots first: others may send before we encoded
            a, b = parts[me]
            if b > a:
                state.slots[(s, me, 0)] = PartSlot(b - a, self.codec, self.members, average_out=self.averaged[a:b])
                self.reducers[s] = asyncio.create_task(self.server._reduce(state, (s, me, 0), self.reduce_deadline))
        if not self.group.relayed_pairs():
            # our averages wait for our own contributions a segment ahead (reducer.CONTRIBUTIONS_AHEAD).
            # Not between relayed members: a part to one goes only once the last one's average came back
            # (one at a time), so each of two such members would hold its average for a contribution
            # the other's held average holds back
            bandwidths = self.group.bandwidths
            state.hold_averages(me, bandwidths[me] if me < len(bandwidths) else 0.0, self.reduce_deadline)
        self.server._groups[self.group.group_id] = state
        self.server._group_added.set()
        state.sends_left = sum(self.pending.values())
        if state.sends_left == 0:
            self.server.event("parts_sent")

    def _encode(self, a: int, b: int) -> bytes:
        """Our part ``[a, b)`` encoded, its decoded values written into :attr:`own_decoded` (what the
        group receives from us, without a copy). Runs in a thread."""
        with phase("encode"):  # the decoded values straight into the round's vector: no copy
            if self.prepared is not None:  # encoded already (or being encoded): cut and entropy-coded
                return self.prepared.part(a, b)
            return self.codec.encode_roundtrip_into(self.flat[a:b], self.own_decoded[a:b])

    def _own_values(self, a: int, b: int) -> None:
        """The values the codec gives our own part ``[a, b)``, in :attr:`own_decoded`, without its bytes:
        that part is never sent. Runs in a thread."""
        with phase("encode"):  # our own part is never sent: its values without the bytes
            if self.prepared is not None:
                self.prepared.wait(b)  # its values are in own_decoded once the encoding got past it
            else:
                self.codec.roundtrip_into(self.flat[a:b], self.own_decoded[a:b])

    def _decode(self, s: int, j: int) -> None:
        """The average of part ``j`` of segment ``s``, decoded straight into :attr:`averaged`. Runs in a
        thread."""
        a, b = self.bounds[s][j]
        with phase("decode"):
            self.codec.decode_average_into(self.results[(s, j)][0], self.averaged[a:b])  # straight into the average

    def _has(self, s: int, j: int) -> bool:
        """Whether part ``j`` of segment ``s`` holds any values."""
        return self.bounds[s][j][1] > self.bounds[s][j][0]

    async def _encode_part(self, s: int, j: int) -> bytes:
        """Part ``j`` of segment ``s`` encoded off the loop, kept in :attr:`encoded`; once the last part
        of ``s`` that goes out is done (encoded or failed), our own part of ``s`` may be encoded
        (:meth:`_own`)."""
        try:
            self.encoded[(s, j)] = await self.loop.run_in_executor(None, self._encode, *self.bounds[s][j])
            return self.encoded[(s, j)]
        finally:
            if j != self.me:
                self.pending[s] -= 1
                if self.pending[s] == 0:
                    self.others_encoded[s].set()

    def _encoding(self, s: int, j: int) -> asyncio.Task:
        """The encoding of part ``j`` of segment ``s``, started on first need. Each part is encoded (or,
        prepared, cut and entropy-coded) just before it is needed (the next one of a reducer while the
        last one is on its way), not all at the start, where every member encoding at once would
        starve the slowest."""
        if (s, j) not in self.encodes:
            self.encodes[(s, j)] = asyncio.create_task(self._encode_part(s, j))
        return self.encodes[(s, j)]

    async def _contribute(self, s: int, j: int, after: Optional[int], sent: asyncio.Event,
                          acked: asyncio.Event) -> None:
        """Our part ``j`` of segment ``s`` to its reducer and its average back, decoded as it comes;
        segment ``after`` of the same reducer is encoded meanwhile. ``sent`` is set once the part is
        handed over, ``acked`` once the reducer acknowledged it (each at the latest when this ends).
        A failed exchange is asked again (:meth:`peer.averaging.allreduce.ReductionServer._ask_again`); a
        part that fails again is left in :attr:`errors` for its fallback reducer."""
        try:
            payload = await self._encoding(s, j)
            if after is not None:
                self._encoding(after, j)
            try:
                self.results[(s, j)] = await self.server._first_exchange(
                    self.state, s, j, payload, self.weight, self.phase1_deadline, sent, acked)
            except Exception as e:
                sent.set()
                acked.set()
                try:
                    self.results[(s, j)] = await self.server._ask_again(self.state, s, j, payload, self.weight, e,
                                                                        self.phase1_deadline)
                except Exception as e2:
                    self.errors[(s, j)] = f"{type(e).__name__}: {e}; again: {type(e2).__name__}: {e2}"
                    return
        finally:
            sent.set()
            acked.set()
        await self.loop.run_in_executor(None, self._decode, s, j)

    async def _to_reducer(self, j: int) -> None:
        """Our parts for member ``j``, segment after segment: the next one goes once the last one is
        handed over and the reducer acknowledged the one before it (:data:`IN_FLIGHT`), so segment s
        is reduced while s+1 is on the wire, and the link carries the averages of early segments
        beside the contributions of later ones (all segments at once would all finish together, the
        link idle while every reducer waits for its last bytes)."""
        segs = [s for s in range(len(self.bounds)) if self._has(s, j)]
        parts: list[asyncio.Task] = []
        acks: list[asyncio.Event] = []
        for k, s in enumerate(segs):
            sent = asyncio.Event()
            acks.append(asyncio.Event())
            parts.append(asyncio.create_task(
                self._contribute(s, j, segs[k + 1] if k + 1 < len(segs) else None, sent, acks[-1])))
            self.tasks.append(parts[-1])
            await sent.wait()  # set by the part's task at the latest when it ends
            self.state.handed(s)
            if k + 1 >= IN_FLIGHT:
                await acks[k + 1 - IN_FLIGHT].wait()  # likewise
        await asyncio.gather(*parts)

    async def _own(self, s: int) -> None:
        """Our own part of segment ``s``: into our slot as soon as encoded, then its average. It is
        encoded after the parts of ``s`` that go out (those are needed first), or once we reduced an
        earlier segment, whichever comes first: a send stalled at a reducer (until the deadline)
        holds up that reducer's later encodes, never our own reductions."""
        a, b = self.bounds[s][self.me]
        try:
            earlier = [r for r in self.reducers if r < s]
            cue = ([asyncio.ensure_future(self.others_encoded[s].wait())]
                   + ([self.reducers[max(earlier)]] if earlier else []))
            try:
                await asyncio.wait(cue, return_when=asyncio.FIRST_COMPLETED)
            finally:
                cue[0].cancel()
            await self.loop.run_in_executor(None, self._own_values, a, b)
            slot = self.state.slots[(s, self.me, 0)]
            slot.decoded[self.server.peer_id] = (self.own_decoded[a:b], float(self.weight))
            slot.changed.set()
            self.results[(s, self.me)] = await self.server._own_result(self.state, (s, self.me, 0), self.reducers[s])
        except Exception as e:
            self.errors[(s, self.me)] = f"{type(e).__name__}: {e}"
            return
        # the average is in ``averaged`` already: the slot's average_out, written as it was encoded

    def _end_first_phase(self) -> None:
        """Once every part went to its reducer (or failed): hold no average any longer, publish the
        averages we got (served to members that ask us for them at a fallback, and to fallback
        reducers' probes), open a slot, holding our own contribution, for each failed part we are the
        fallback reducer of, and only then let the serving side answer those requests."""
        state = self.state
        state.release_averages()
        state.finished.update(self.results)
        own_parts = {key: self.own_decoded[self.bounds[key[0]][key[1]][0]:self.bounds[key[0]][key[1]][1]]
                     for key in self.errors}
        for s, j in self.errors:
            if fallback_reducer(j, self.bounds[s]) == self.me:
                slot = state.slots[(s, j, 1)] = PartSlot(own_parts[(s, j)].numel(), self.codec,
                                                         self.members - {self.group.members[j]})
                slot.accept(self.server.peer_id, own_parts[(s, j)], self.weight)
                state.fallback[(s, j)] = self.loop.create_future()
        state.phase1_done.set()

    async def _retry_failed(self) -> None:
        """Each failed part at its fallback reducer, in (segment, part) order: reduced or adopted here
        when that is us (:meth:`peer.averaging.allreduce.ReductionServer._fallback`), else sent there (our own
        part encoded now if its bytes were not needed so far); a part that fails there too stays in
        :attr:`errors`."""
        for (s, j), why in sorted(self.errors.items()):
            log.warning("part %d.%d of group %s failed at %s (%s); retrying at the fallback reducer",
                        s, j, self.group.group_id, self.group.members[j][-8:], why)
            f = fallback_reducer(j, self.bounds[s])
            try:
                if f is None:
                    raise RuntimeError("no fallback reducer")
                if f == self.me:
                    self.results[(s, j)] = await self.server._fallback(self.state, s, j, self.fallback_reduce_deadline)
                else:
                    if (s, j) not in self.encoded:  # our own part, whose bytes were not needed so far
                        self.encoded[(s, j)] = await self.loop.run_in_executor(None, self._encode, *self.bounds[s][j])
                    self.results[(s, j)] = await self.server._exchange(
                        self.state, self.group.members[f], s, j, 1, self.encoded[(s, j)], self.weight,
                        self.final_deadline)
                await self.loop.run_in_executor(None, self._decode, s, j)
                self.errors.pop((s, j))
            except Exception as e:
                self.errors[(s, j)] = f"{self.errors[(s, j)]}; fallback: {type(e).__name__}: {e}"

    async def _outcome(self) -> AllReduceOutcome:
        """What the round gave: no average if a part failed even at its fallback reducer; else the
        average and the members whose contributions are in every part, once the averages we reduced
        went out to the members (or the round's time is up)."""
        state = self.state
        if self.errors:
            reason = "; ".join(f"part {s}.{j} failed ({why})" for (s, j), why in sorted(self.errors.items()))
            return AllReduceOutcome(None, self.own_decoded, [], state.bytes_sent, state.bytes_received, reason,
                                    dict(state.suspects), link=state.link)
        contributors = set(self.group.members)
        for data_and_peers in self.results.values():
            contributors &= set(data_and_peers[1])
        dropped = sorted(self.members - contributors)
        reason = f"dropped {', '.join(dropped)}" if dropped else ""
        while state.serving > 0 and time.monotonic() < self.final_deadline:  # our averages still going out
            state.served.clear()
            await wait_event(state.served, self.final_deadline)
        parts = sorted((*self.bounds[s][j], data) for (s, j), (data, _) in self.results.items())
        return AllReduceOutcome(self.averaged, self.own_decoded, sorted(contributors), state.bytes_sent,
                                state.bytes_received, reason, dict(state.suspects), parts, state.link)

    def _close(self) -> None:
        """However the round ended: hold no average, cancel what still runs (reductions, exchanges,
        encodings), and forget the group once members asking late can no longer need it."""
        self.state.release_averages()
        for task in [*self.reducers.values(), *self.tasks, *self.encodes.values()]:
            if not task.done():
                task.cancel()
        self.loop.call_later(max(0.0, self.final_deadline - time.monotonic()) + 5.0,
                             self.server._groups.pop, self.group.group_id, None)
