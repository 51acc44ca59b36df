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
acknowledged the one before it (:data:`~peer.averaging.group_round.IN_FLIGHT`): a socket's buffer or
a p2p daemon takes a whole segment at once, so "handed over" alone let every segment into the kernel
together, where the link is shared among them all and a reducer's early segments could come last. A reducer returns
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

This module holds a member's exchanges with the reducers (:class:`ReductionServer`: sent, asked again,
at a fallback reducer); the round that drives them, its cut, pipeline and outcome, is
:class:`peer.averaging.group_round.GroupRound`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any, Optional

from torch import Tensor

from peer.averaging.group_round import AllReduceOutcome, GroupRound
from peer.averaging.partition import Group
from peer.averaging.reducer import PROBE, GroupState, PartReducer
from peer.compression import Codec, Prepared
from peer.network.frames import STREAM_CUT
from protos.hivepath.peer.v1.net_pb2 import PartHeader, PartReply

__all__ = ["AllReduceOutcome", "ReductionServer", "RESUMES"]

log = logging.getLogger(__name__)

RESUMES = 24
"""Most times a part whose stream was cut mid-way is asked again of its reducer within one round.
A relay between private addresses resets a relayed connection after 128 KiB each way
(``peer.network.relays``), so two relayed members exchanging a demo-preset module meet a few resets
a round; a reducer that is gone fails to dial instead, and is not asked more than once more."""

DIALS_AFTER_CUT = 4
"""Most failed dials in a row a part is asked again after its stream was cut: the relay a cut
came through takes a moment to take the next connection (the daemon then answers "connect failed"
though the reducer is alive); a reducer that is gone costs these few dials, about 3 s, before its
fallback."""


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
        state and steps are a :class:`peer.averaging.group_round.GroupRound`."""
        return await GroupRound(self, group, flat, weight, codec, out, prepared).run()

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
        anew, a dial that fails after a cut at most :data:`DIALS_AFTER_CUT` times in a row; anything
        else (a refusal, a reducer that cannot be dialled) is asked once more.

        Parts asked again of one member go one at a time: a relayed connection's 128 KiB is shared by
        every stream on it, and all the parts in flight restarted together on each new connection would
        use it up before any of them got through (a round between two relayed peers could then never
        complete), while one part at a time gets whole parts through on each connection."""
        from hivemind.p2p.p2p_daemon_bindings.utils import ControlFailure

        peer = state.group.members[j]
        was_cut = isinstance(error, STREAM_CUT)
        dials = 0  # failed dials in a row since the last cut
        for attempt in range(RESUMES):
            log.info("part %d.%d of group %s: %r; asking %s again", s, j, state.group.group_id, error, peer[-8:])
            try:
                async with self._one_at_a_time(state, j, cut=True):
                    return await self._exchange(state, peer, s, j, 0, payload, weight, deadline)
            except Exception as e:
                dials = dials + 1 if isinstance(e, ControlFailure) else 0
                retry = was_cut and (isinstance(e, STREAM_CUT) or 0 < dials <= DIALS_AFTER_CUT)
                if not retry or time.monotonic() >= deadline:
                    raise
                error = e
            pause = 0.125 * 2 ** dials if dials else 0.05 * 2 ** attempt
            await asyncio.sleep(min(1.0 if dials else 0.5, pause, max(0.0, deadline - time.monotonic())))
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
