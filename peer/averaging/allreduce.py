"""The all-reduce of one averaging group over hivemind's P2P, giving every member the same bytes.

A group's flat fp32 delta is cut into one part per member, at multiples of
:data:`models.codec_spec.BLOCK` and sized by the members' measured upload bandwidth (client-mode
members, bandwidth 0, reduce nothing; see :mod:`peer.averaging.partition`). Member ``i`` reduces part ``i``:

1. every member encodes each of its parts with the run's wire codec (e.g. ``int8+zstd``, the codec
   and its lossless entropy stage), the :class:`~peer.compression.Codec` its optimizer
   resolved once, and streams part ``i`` to member ``i`` (header
   :class:`protos.hivepath.peer.v1.net_pb2.PartHeader`, naming the codec, then the payload); the reducer
   acknowledges it at once;
2. the reducer (:mod:`peer.averaging.reducer`) validates each contribution (size, codec, finite
   weight, decodable; a bad one drops its sender), waits for every member until its deadline (a slow
   or gone member is dropped), takes the weighted fp32 mean in sorted peer-id order (or the run's
   robust rule, :func:`peer.averaging.aggregate`) and encodes it ONCE;
3. it replies to every sender with those same bytes (:class:`protos.hivepath.peer.v1.net_pb2.PartReply` + payload), and
   decodes them itself: member and reducer apply identical bits.

The vector is first cut into at most :data:`~peer.averaging.partition.MAX_SEGMENTS` block-aligned
segments, each reduced this way, as a pipeline: a member sends its parts to each reducer segment
after segment, so a reducer averages segment s while s+1 is on the wire and the link carries the
averages of early segments beside the contributions of later ones (sending every segment at once
made them all finish together: the link idled while each reducer waited for its last bytes, then
carried only averages). The next segment goes once the last one is handed over AND the reducer
acknowledged the one before it (:data:`IN_FLIGHT`): a socket's buffer or a p2p daemon takes a
whole segment at once, so "handed over" alone let every segment into the kernel together, where
the link is shared among them all and a reducer's early segments could come last. A reducer returns
the average of segment s once its own contributions through segment s+1 are handed over
(:data:`~peer.averaging.reducer.CONTRIBUTIONS_AHEAD`): the other reducers wait on those, nobody
waits on the averages.
The vector is encoded while the group forms (:meth:`~peer.compression.Codec.prepare`: the
averager starts it in a thread before matchmaking, so the first part goes out as soon as the group
is known and the encoding's CPU is spent while we wait on the network); a part's bytes are then cut
from it and entropy-coded just before they go out (the next one of a reducer while the last one is
on its way). A codec whose parts cannot be cut from the whole (the sparse one) encodes each part
then. Each average is decoded as it arrives, straight into the round's vector, and a sender's
encoder hands back the decoded values its bytes carry (no second decode of what we sent).

A stream that breaks at a live reducer is asked again (an accepted contribution is served its
average, never added twice); a stream cut mid-way, as a relay's reset cuts it, up to
:data:`RESUMES` times. When two members can be dialled only through relays (``Group.relayed``),
the vector is cut finer so that their parts fit what a relayed connection carries
(:func:`~peer.averaging.partition.relayed_segment_bounds`), and the parts between them go one at a
time. A part whose reducer is gone (or refuses, or misses the deadline) goes
to a fallback reducer, the first other member in sorted order that reduces anything: it serves the
original average if it received one, else asks the other members for it
(:data:`~peer.averaging.reducer.PROBE`) and adopts
it, so members the dead reducer answered and those it did not still agree; only if nobody has it
does it reduce the contributions of the members that ask, and only if another member asks (our
own part alone, applied, could fork us from a reducer that is alive but cut off from us, e.g. by a
relay's reset: the round is lost instead, and the next one re-syncs). Not covered: a second fault in the same
round (the fallback reducer dying as well), after which members may differ for that round.

Moving each byte once up and once down the sender's link, this is bandwidth-optimal:
``2 (n - 1) / n * size`` per member, as in hivemind's butterfly all-reduce (Ryabinin et al. 2021).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import Tensor

from peer.averaging.contract import LinkTimes
from peer.compression.phases import phase
from peer.averaging.partition import (Group, fallback_reducer, part_bounds, relayed_segment_bounds,
                                      segment_bounds)
from peer.compression import Codec, Prepared
from peer.averaging.reducer import PROBE, GroupState, PartReducer, PartSlot, wait_event
from peer.network.frames import STREAM_CUT
from protos.hivepath.peer.v1.net_pb2 import PartHeader, PartReply

__all__ = ["AllReduceOutcome", "ReductionServer", "RESUMES"]

log = logging.getLogger(__name__)

IN_FLIGHT = 2
"""Most of our segments at one reducer that it has not acknowledged: the next one goes once the last
one is handed over and the one before it acknowledged, so one is always queued behind the one on the
wire (the link never waits on the acknowledgement's round trip) and no more. ``bench.comm``'s
``tcp_ceiling`` compares this schedule (``paced``) with waiting only for the handing-over
(``per_segment``) on bare TCP; more segments than :data:`~peer.averaging.partition.MAX_SEGMENTS`
cost CPU for little link efficiency."""

RESUMES = 24
"""Most times a part whose stream was cut mid-way is asked again of its reducer within one round.
A relay between private addresses resets a relayed connection after 128 KiB each way
(``peer.network.relays``), so two relayed members exchanging a demo-preset module meet a few resets
a round; a reducer that is gone fails to dial instead, and is not asked more than once more."""


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



class ReductionServer(PartReducer):
    """Serves the parts this peer reduces (:class:`~peer.averaging.reducer.PartReducer`), and runs this
    peer's side of each group's all-reduce (:meth:`run`), falling back to another reducer for a part
    whose reducer failed."""

    async def run(self, group: Group, flat: Tensor, weight: float, codec: Codec,
                  out: Optional[tuple[Tensor, Tensor]] = None, prepared: Optional[Prepared] = None) -> AllReduceOutcome:
        """This member's side of the group's all-reduce of ``flat`` (numel,) with ``weight``; ``out``:
        two vectors like ``flat`` to write what the group receives from us and the average into
        (fresh ones when None). ``prepared``: ``flat`` encoded by ``codec`` while the group formed
        (:meth:`~peer.compression.Codec.prepare`), filled or being filled in a thread, its
        decoded values going into ``out[0]``: parts are then cut from it rather than encoded here.

        The vector is cut into segments reduced as a pipeline (see the module's docstring), so
        encoding, the upload of contributions and the download of averages overlap; the round's
        state and steps are a :class:`_GroupRound`."""
        return await _GroupRound(self, group, flat, weight, codec, out, prepared).run()

    async def _first_exchange(self, state: GroupState, s: int, j: int, payload: bytes, weight: float,
                              deadline: float, sent: Optional[asyncio.Event] = None,
                              acked: Optional[asyncio.Event] = None) -> tuple[bytes, list[str]]:
        """Part ``j`` of segment ``s`` to its reducer; between two members behind relays, one part at a
        time (as :meth:`_ask_again`): all of them at once would be cut together by the relay's reset."""
        async with self._one_at_a_time(state, j, cut=False):
            return await self._exchange(state, state.group.members[j], s, j, 0, payload, weight, deadline, sent, acked)

    def _one_at_a_time(self, state: GroupState, j: int, cut: bool) -> Any:
        """The lock our parts to member ``j`` go under when they must go one at a time (the two of us
        behind relays, or a stream to it already ``cut``), else a no-op."""
        group = state.group
        if cut or group.relayed_between(group.members.index(self.peer_id), j):
            return state.one_at_a_time.setdefault(group.members[j], asyncio.Lock())
        return contextlib.nullcontext()

    async def _ask_again(self, state: GroupState, s: int, j: int, payload: bytes, weight: float, error: Exception,
                         deadline: float) -> tuple[bytes, list[str]]:
        """Part ``j`` of segment ``s`` after its exchange with its reducer failed with ``error``: asked again
        (the reducer serves an accepted contribution its average without adding it twice). A stream cut
        mid-way (a relay's reset: a relayed connection carries 128 KiB, ``peer.network.relays``) is asked
        again until ``deadline``, at most :data:`RESUMES` times, each over a connection the daemon dials
        anew; anything else (a refusal, a reducer that cannot be dialled) is asked once more.

        Parts asked again of one member go one at a time: a relayed connection's 128 KiB is shared by
        every stream on it, and all the parts in flight restarted together on each new connection would
        use it up before any of them got through (a round between two relayed peers could then never
        complete), while one part at a time gets whole parts through on each connection."""
        peer = state.group.members[j]
        for attempt in range(RESUMES):
            log.info("part %d.%d of group %s: %r; asking %s again", s, j, state.group.group_id, error, peer[-8:])
            try:
                async with self._one_at_a_time(state, j, cut=True):
                    return await self._exchange(state, peer, s, j, 0, payload, weight, deadline)
            except Exception as e:
                if not (isinstance(error, STREAM_CUT) and isinstance(e, STREAM_CUT)) or time.monotonic() >= deadline:
                    raise
                error = e
            await asyncio.sleep(min(0.5, 0.05 * 2 ** attempt, max(0.0, deadline - time.monotonic())))
        raise RuntimeError(f"the stream to {peer[-8:]} was cut {RESUMES + 1} times: {error!r}")

    async def _fallback(self, state: GroupState, s: int, j: int, deadline: float) -> tuple[bytes, list[str]]:
        """As the fallback reducer of part ``j`` of segment ``s``: adopt the original average if any
        member received it (so every member applies the same bytes), else reduce what the members
        send. The decision is served to every member that asks."""
        future = state.fallback[(s, j)]
        try:
            found = await self._probe(state, s, j, deadline)
            if found is not None:
                log.info("part %d.%d of group %s: adopting the original average another member received",
                         s, j, state.group.group_id)
                future.set_result((*found, False))
                return found
            task = asyncio.create_task(self._reduce(state, (s, j, 1), deadline))
            result = await self._own_result(state, (s, j, 1), task)
            if set(result[1]) <= {self.peer_id}:
                # nobody else asked and nobody had the original: the part's reducer may be alive and have
                # answered the others (a relay's reset cuts us off from a live member), so our own part
                # applied alone could fork us from them; the round is lost instead, and we re-sync
                raise RuntimeError("no other member reached the fallback and none had the original average "
                                   "(applying our own part alone could fork us from its reducer)")
            future.set_result((*result, True))
            return result
        except BaseException as e:
            if not future.done():
                future.set_exception(RuntimeError(f"fallback failed: {e!r}"))
                future.exception()  # retrieved: askers get it through the handler
            raise

    async def _probe(self, state: GroupState, s: int, j: int, deadline: float) -> Optional[tuple[bytes, list[str]]]:
        """The original average of part ``j`` of segment ``s`` from any other member that received it."""
        others = [m for i, m in enumerate(state.group.members) if i != j and m != self.peer_id]
        tasks = [asyncio.create_task(self._exchange(state, m, s, j, PROBE, b"", 0.0, deadline)) for m in others]
        try:
            for next_done in asyncio.as_completed(tasks):
                try:
                    return await next_done
                except Exception:
                    continue
            return None
        finally:
            for task in tasks:
                task.cancel()

    async def _own_result(self, state: GroupState, key: tuple[int, int, int],
                          task: "asyncio.Task") -> tuple[bytes, list[str]]:
        await task
        return state.slots[key].result.result()

    async def _exchange(self, state: GroupState, peer: str, segment: int, part: int, attempt: int,
                        payload: bytes, weight: float, deadline: float, sent: Optional[asyncio.Event] = None,
                        acked: Optional[asyncio.Event] = None) -> tuple[bytes, list[str]]:
        """Send our part ``part`` of ``segment`` to ``peer`` and return the average it sends back;
        ``sent`` is set once the payload is handed over (to the daemon or the lane's socket),
        ``acked`` once the reducer acknowledged it."""
        return await asyncio.wait_for(
            self._exchange_unbounded(state, peer, segment, part, attempt, payload, weight, sent, acked),
            max(0.01, deadline - time.monotonic()))

    async def _exchange_unbounded(self, state: GroupState, peer: str, segment: int, part: int, attempt: int,
                                  payload: bytes, weight: float, sent: Optional[asyncio.Event] = None,
                                  acked: Optional[asyncio.Event] = None) -> tuple[bytes, list[str]]:
        from hivemind.p2p import P2P, PeerID

        a, b = state.bounds[segment][part]
        header = PartHeader(group_id=state.group.group_id, segment=segment, part_index=part, attempt=attempt,
                            weight=weight, numel=b - a, codec=state.codec.name, payload_len=len(payload))
        # a member dialled through a relay (behind NAT) offers no lane: not even asked, through its relay
        relayed = state.group.relayed and state.group.relayed[state.group.members.index(peer)]
        opened = await self.lanes.open(peer, self.handler_name) if self.lanes is not None and not relayed else None
        if opened is None:
            _, reader, writer = await self.p2p.call_binary_stream_handler(PeerID.from_base58(peer), self.handler_name)
        else:
            reader, writer = opened
        try:
            await P2P.send_protobuf(header, writer)
            await P2P.send_raw_data(payload, writer)
            state.bytes_sent += len(payload)
            self.event("part_handed")
            if sent is not None:
                sent.set()
            reply, err = await P2P.receive_protobuf(PartReply, reader)
            acknowledged = reply is not None and reply.ok and reply.received
            if acknowledged:
                state.link.went_up(len(payload))  # through our link: the reducer has read it
                self.event("part_acknowledged")
                if acked is not None:
                    acked.set()
                if attempt == 0 and (segment, part) not in state.acked:
                    state.acked.add((segment, part))
                    state.sends_left -= 1
                    if state.sends_left == 0:
                        self.event("parts_sent")
                reply, err = await P2P.receive_protobuf(PartReply, reader)
            data = await P2P.receive_raw_data(reader)
        finally:
            writer.close()
        if reply is None or not reply.ok:
            raise RuntimeError(reply.error if reply is not None else err.message)
        if not state.codec.average_size_ok(len(data), b - a) or reply.payload_len != len(data):
            raise RuntimeError(f"average is {len(data)} bytes (announced {reply.payload_len}), which cannot encode "
                               f"{b - a} values with {state.codec.name}")
        state.bytes_received += len(data)
        if not acknowledged:  # answered without an acknowledgement first: read by now at the latest
            state.link.went_up(len(payload))
        state.link.came_down(len(data))
        return bytes(data), list(reply.contributors)


class _GroupRound:
    """This member's side of one group's all-reduce (:meth:`ReductionServer.run`), as an object that
    holds the round's state: the cut of the vector, our parts' encodings and exchanges, the averages
    we got back, the parts that failed, and the deadlines every step waits on.

    The round goes in two phases. In the first, every part of ours goes to its reducer
    (:meth:`_to_reducer`, :meth:`_contribute`) while we reduce our own parts (:meth:`_own`); in the
    second, each part that failed goes to its fallback reducer (:meth:`_retry_failed`). The parts we
    reduce are served by the :class:`ReductionServer` from :attr:`state`, the same
    :class:`~peer.averaging.reducer.GroupState` it finds under the group's id."""

    def __init__(self, server: ReductionServer, group: Group, flat: Tensor, weight: float, codec: Codec,
                 out: Optional[tuple[Tensor, Tensor]], prepared: Optional[Prepared]):
        self.server = server
        """Serves the parts we reduce and carries our exchanges with the other members."""
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
        A failed exchange is asked again (:meth:`ReductionServer._ask_again`); a part that fails again
        is left in :attr:`errors` for its fallback reducer."""
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
        when that is us (:meth:`ReductionServer._fallback`), else sent there (our own part encoded now
        if its bytes were not needed so far); a part that fails there too stays in :attr:`errors`."""
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
