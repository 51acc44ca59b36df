"""The reducer's half of the all-reduce (:mod:`peer.averaging.allreduce`): the parts this peer reduces.

A member opens one :class:`PartSlot` per part it reduces (its own part of each segment, and the parts
it is the fallback reducer of), in the :class:`GroupState` of that group. :class:`PartReducer` serves
the ``{prefix}_part`` stream: it validates each contribution against the slot (sender, codec name,
size, weight, decodable; a bad one drops its sender and only its sender), waits for every member until
the deadline, applies the run's :class:`~peer.averaging.aggregation.Aggregation` in sorted peer-id
order, encodes the average ONCE with the group's codec, and answers every sender with those same
bytes. A part's header names its codec; the slot holds the codec this peer resolved for the round,
so a part in any other codec is refused without resolving the name it carries.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from torch import Tensor

from peer.averaging.aggregation import MEAN, Aggregation, aggregate, encode_aggregate
from peer.averaging.contract import LinkTimes
from peer.averaging.partition import Group
from peer.compression.phases import phase
from peer.compression import Codec
from peer.network.frames import handler_name, linger, read_message, read_payload, serve
from protos.hivepath.peer.v1.net_pb2 import DESCRIPTOR as NET, PartHeader, PartReply

PART = NET.services_by_name["Averaging"].methods_by_name["Part"]
"""The ``Part`` rpc of ``net.proto``: a member's encoded part to its reducer."""

__all__ = ["PartSlot", "GroupState", "PartReducer", "EventHook", "PROBE", "BENIGN", "CONTRIBUTIONS_AHEAD", "HOLD_SEGMENTS", "wait_event"]

log = logging.getLogger(__name__)


PROBE = 3
"""``PartHeader.attempt`` of a fallback reducer asking a member for the original average of a part."""


BENIGN = ("too late", "not a member", "duplicate")
"""Refusals that say nothing about a sender's honesty (late, another group, a retry)."""


@dataclass
class PartSlot:
    """One part being reduced here: contributions by peer id, then the encoded average."""

    numel: int
    codec: Codec
    """The group's codec, as this peer resolved it for the round: contributions must name it."""
    expected: set[str]
    decoded: dict[str, tuple[Tensor, float]] = field(default_factory=dict)
    accepted: set[str] = field(default_factory=set)
    """Senders whose contribution is in (kept after the reduction frees ``decoded``)."""
    dropped: dict[str, str] = field(default_factory=dict)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    result: "asyncio.Future[tuple[bytes, list[str]]]" = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    average_out: Optional[Tensor] = None
    """(numel,) where the reducer writes the decoded average as it encodes it (its own copy of the
    part's average, bit for bit what the members decode, there once ``result`` is), or None."""

    def check(self, sender: str, header: PartHeader, payload: bytes) -> str:
        """Why this contribution cannot be accepted ('' if it can be decoded and offered)."""
        if sender not in self.expected:
            return "sender is not a member of this group"
        if sender in self.decoded or sender in self.dropped:
            return "duplicate contribution"
        if self.result.done():
            return "the part was already reduced (too late)"
        if header.codec != self.codec.name or header.numel != self.numel:
            return f"part is {header.codec}/{header.numel} elements, expected {self.codec.name}/{self.numel}"
        if not self.codec.size_ok(len(payload), self.numel):
            return f"payload is {len(payload)} bytes, which cannot encode {self.numel} values with {self.codec.name}"
        if not (math.isfinite(header.weight) and header.weight > 0):
            return f"weight {header.weight} is not a finite number > 0"
        return ""

    def accept(self, sender: str, values: Tensor, weight: float) -> str:
        """Store a decoded contribution (numel,); '' if accepted."""
        if self.result.done():
            return "the part was already reduced (too late)"
        self.decoded[sender] = (values, float(weight))
        self.accepted.add(sender)
        self.changed.set()
        return ""

    def drop(self, sender: str, problem: str) -> None:
        """Exclude ``sender`` from this part (a bad contribution drops its sender)."""
        if sender in self.expected and sender not in self.decoded:
            self.dropped[sender] = problem
            self.changed.set()

    def complete(self) -> bool:
        return self.expected <= set(self.decoded) | set(self.dropped)


CONTRIBUTIONS_AHEAD = 1
"""A reducer sends a member the average of a part of segment s once its own contributions through
segment ``s + CONTRIBUTIONS_AHEAD`` are handed over (:meth:`GroupState.hold_average`). A member's
link carries both: its contributions to the other reducers, which each of them waits on, and the
averages it returns, which nobody waits on to go on. Shared evenly, as TCP shares them, a member
that fell behind with its contributions holds back every reducer of those segments while its own
averages take half its link; sending contributions a segment ahead lets the reducers go on, and
the averages fill the link behind them. ``bench.comm`` measures bare TCP both ways in its namespaces
(``tcp_ceiling``: ``paced`` without the rule, ``ahead`` with it, in ``bench/results/comm.json``). One average is held at most :data:`HOLD_SEGMENTS` times
the time our link takes to carry one segment of our contributions, and never past the round's
reduce deadline or our contributions' end (all went or failed): a reducer we cannot reach, or a
dial that hangs, must not hold back the averages everyone else needs. Groups with
relayed members hold nothing (their parts go one at a time, each after the last one's average:
two holds would wait on each other)."""
HOLD_SEGMENTS = 2.0
"""The longest an average is held, in segments of our contributions at our measured bandwidth."""


@dataclass
class GroupState:
    group: Group
    bounds: list[list[tuple[int, int]]]
    """Per segment, per member: the (start, end) of the part that member reduces."""
    codec: Codec
    """The codec every member encodes its parts with (the run's wire codec)."""
    slots: dict[tuple[int, int, int], PartSlot] = field(default_factory=dict)
    """(segment, part, attempt) -> a part we reduce."""
    finished: dict[tuple[int, int], tuple[bytes, list[str]]] = field(default_factory=dict)
    fallback: dict[tuple[int, int], "asyncio.Future[tuple[bytes, list[str], bool]]"] = field(default_factory=dict)
    """Parts we are the fallback reducer of: (average, contributors, reduced here rather than adopted)."""
    phase1_done: asyncio.Event = field(default_factory=asyncio.Event)
    bytes_sent: int = 0
    bytes_received: int = 0
    link: LinkTimes = field(default_factory=LinkTimes)
    """When our bytes of this group's all-reduce crossed our link, part by part."""
    sends_left: int = 0
    acked: set[tuple[int, int]] = field(default_factory=set)
    serving: int = 0
    """Accepted contributions whose average is not yet sent back."""
    served: asyncio.Event = field(default_factory=asyncio.Event)
    suspects: dict[str, str] = field(default_factory=dict)
    one_at_a_time: dict[str, asyncio.Lock] = field(default_factory=dict)
    """Member -> the lock our parts to it go under one at a time: when both of us are relayed, or once a
    stream to it was cut mid-way (``ReductionServer._one_at_a_time``)."""
    to_hand: dict[int, int] = field(default_factory=dict)
    """Segment -> our contributions of it not yet handed over (nor given up); empty: none are tracked
    and averages are never held (:meth:`hold_average`)."""
    handed_changed: asyncio.Event = field(default_factory=asyncio.Event)
    hold_until: float = 0.0
    """The latest an average of ours is held for our own contributions (``time.monotonic()``)."""
    hold_for: float = 0.0
    """The longest one average of ours is held (seconds)."""

    def contributions(self, me: int) -> dict[int, int]:
        """Segment -> the parts member ``me`` contributes to it (the others' non-empty parts)."""
        return {s: sum(1 for j, (a, b) in enumerate(parts) if j != me and b > a)
                for s, parts in enumerate(self.bounds)}

    def hold_averages(self, me: int, rate: float, until: float) -> None:
        """Have our averages (we are member ``me``, uploading ``rate`` bytes/s) wait for our own
        contributions a segment ahead (:meth:`hold_average`), each at most :data:`HOLD_SEGMENTS`
        segments of them at ``rate``, none past ``until``; no hold without a rate."""
        if rate <= 0:
            return
        self.to_hand = self.contributions(me)
        largest = max(sum(self.codec.encoded_size(b - a) for j, (a, b) in enumerate(parts) if j != me)
                      for parts in self.bounds)
        self.hold_for = HOLD_SEGMENTS * largest / rate
        self.hold_until = until

    def handed(self, segment: int) -> None:
        """One contribution of ours to ``segment`` was handed over (or given up)."""
        if self.to_hand.get(segment, 0) > 0:
            self.to_hand[segment] -= 1
            self.handed_changed.set()

    def release_averages(self) -> None:
        """Hold no average any longer: our contributions all went (or the round ends)."""
        self.to_hand.clear()
        self.handed_changed.set()

    def _holding(self, segment: int) -> bool:
        last = min(segment + CONTRIBUTIONS_AHEAD, max(self.to_hand, default=-1))
        return any(self.to_hand.get(s, 0) for s in range(last + 1))

    async def hold_average(self, segment: int) -> None:
        """Wait until our contributions through segment ``segment + CONTRIBUTIONS_AHEAD`` are handed
        over (at most :attr:`hold_for`, and until :attr:`hold_until`), before the average of a part of
        ``segment`` goes out."""
        until = min(self.hold_until, time.monotonic() + self.hold_for)
        while self._holding(segment) and time.monotonic() < until:
            self.handed_changed.clear()
            await wait_event(self.handed_changed, until)

    def max_part_bytes(self) -> int:
        """The most bytes an encoded part of this group can take (the largest part, in the group's codec)."""
        largest = max((b - a for parts in self.bounds for a, b in parts), default=0)
        return self.codec.encoded_size(largest)

    def suspect(self, key: tuple[int, int, int], peer: str, why: str) -> None:
        """Note a dropped or clipped contribution (the first reason per peer is kept)."""
        self.suspects.setdefault(peer, f"part {key[0]}.{key[1]}: {why}")


EventHook = Callable[[str], None]
"""Called on the averager's loop with a point name, so tests can inject a fault exactly there (e.g.
kill the process) and benchmarks can time phases: ``"group_formed"`` (matchmaking done, before
the reduction), ``"parts_sent"`` (every part we contribute was acknowledged by its reducer),
``"reduced"`` (a part we reduce is averaged and encoded, and about to be sent back),
``"part_accepted"`` (a contribution to a part we reduce is validated and added, about to be
acknowledged), ``"part_handed"`` / ``"part_acknowledged"`` (one part we contribute was handed over
to the daemon or lane / its reducer acknowledged it),
``"average_out"`` (the average of a part we reduce about to go to one member, after
:meth:`GroupState.hold_average`), ``"part_replied"`` (one member received, and closed the stream
of, the average of a part we reduce),
``"bucket_done"`` (a split round's bucket mean is ours, before the top group or the tree,
:mod:`peer.averaging.hierarchy`), ``"top_gather"`` (a delegate about to matchmake the level above its group: a group of delegates, or
the top group)."""


class PartReducer:
    """Serves the parts this peer reduces in the groups registered in ``_groups``.

    Lives on one asyncio loop with a ``hivemind.p2p.P2P`` handle; :meth:`start` registers the stream
    handler ``{prefix}_part``. ``aggregation`` is the run's rule for the parts reduced here. The
    member's side of the all-reduce (:class:`peer.averaging.allreduce.ReductionServer`) builds on it.
    """

    def __init__(self, p2p: Any, peer_id: str, prefix: str, wait_timeout: float = 60.0,
                 event_hook: Optional[EventHook] = None, aggregation: Aggregation = MEAN,
                 lanes: Optional[Any] = None):
        self.p2p = p2p
        self.lanes = lanes
        """:class:`peer.network.lanes.DirectLanes` carrying parts outside the p2p daemon where it can."""
        self.aggregation = aggregation
        self.event_hook = event_hook
        self.peer_id = peer_id
        self.prefix = prefix
        self.handler_name = handler_name(prefix, PART)
        self.wait_timeout = wait_timeout
        self._groups: dict[str, GroupState] = {}
        self._group_added = asyncio.Event()

    async def start(self) -> None:
        await serve(self.p2p, self.prefix, PART, self._handle, lanes=self.lanes)

    # -- serving side -------------------------------------------------------------------------

    async def _handle(self, stream_info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One contribution (or probe): its header, then, once its group is known here, the payload,
        read with the group's largest encoded part as the limit (a part of an unknown group is
        refused unread). Malformed frames and broken streams end in :func:`peer.network.frames.serve`."""
        from hivemind.p2p import P2P

        sender = stream_info.peer_id.to_base58()
        header = await read_message(reader, PartHeader)
        if header is None:
            return
        state = await self._wait_group(header.group_id, time.monotonic() + self.wait_timeout)
        if state is None:
            await P2P.send_protobuf(PartReply(ok=False, error="unknown group"), writer)
            await P2P.send_raw_data(b"", writer)
            return
        payload = await read_payload(reader, state.max_part_bytes())
        state.bytes_received += len(payload)  # not a moment of LinkTimes: see its docstring
        state.serving += 1
        try:
            reply, data = await self._serve(sender, header, payload, writer)
            await P2P.send_protobuf(reply, writer)
            await P2P.send_raw_data(data, writer)
            state.bytes_sent += len(data)
            if await linger(reader, self.wait_timeout):  # the sender hung up once it read the average
                state.link.went_up(len(data))
            if reply.ok and header.attempt == 0:
                self.event("part_replied")
        finally:
            state.serving -= 1
            state.served.set()

    async def _serve(self, sender: str, header: PartHeader, payload: bytes,
                     writer: asyncio.StreamWriter) -> tuple[PartReply, bytes]:
        from hivemind.p2p import P2P

        deadline = time.monotonic() + self.wait_timeout
        state = await self._wait_group(header.group_id, deadline)
        if state is None:
            return PartReply(ok=False, error="unknown group"), b""
        key = (header.segment, header.part_index, header.attempt)
        if header.attempt in (1, PROBE):
            # the fallback (1) or a fallback reducer's probe (PROBE): the original average if we have it
            await wait_event(state.phase1_done, deadline)
            if key[:2] in state.finished:
                data, contributors = state.finished[key[:2]]
                return PartReply(ok=True, contributors=contributors, payload_len=len(data)), data
            if header.attempt == PROBE:
                return PartReply(ok=False, error="no original average of this part here"), b""
            if key[:2] not in state.fallback:
                return PartReply(ok=False, error=f"not the fallback reducer of part {key[0]}.{key[1]}"), b""
            slot = state.slots[key]
            if sender not in slot.accepted and not slot.result.done():
                await self._offer(slot, sender, header, payload)
            await P2P.send_protobuf(PartReply(ok=True, received=True), writer)
            try:
                data, contributors, reduced_here = await asyncio.wait_for(
                    asyncio.shield(state.fallback[key[:2]]), max(0.0, deadline - time.monotonic()))
            except Exception as e:
                return PartReply(ok=False, error=f"fallback failed: {e!r}"), b""
            if reduced_here and sender not in contributors:
                return PartReply(ok=False, error="dropped from the part"), b""
            return PartReply(ok=True, contributors=contributors, payload_len=len(data)), data
        while key not in state.slots and time.monotonic() < deadline and not state.phase1_done.is_set():
            await wait_event(state.phase1_done, min(deadline, time.monotonic() + 0.05))
        slot = state.slots.get(key)
        if slot is None:
            return PartReply(ok=False, error=f"not reducing part {header.part_index} attempt {header.attempt}"), b""
        if sender in slot.accepted:  # asked again after a broken stream: serve, do not add twice
            problem = ""
        else:
            problem = await self._offer(slot, sender, header, payload)
        if problem:
            log.warning("dropped %s from part %d.%d of group %s: %s", sender, header.segment, header.part_index,
                        header.group_id, problem)
            return PartReply(ok=False, error=problem), b""
        self.event("part_accepted")
        await P2P.send_protobuf(PartReply(ok=True, received=True), writer)
        try:
            data, contributors = await asyncio.wait_for(asyncio.shield(slot.result), max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            return PartReply(ok=False, error="reduction timed out"), b""
        except Exception as e:  # the reduction itself failed (no contributions)
            return PartReply(ok=False, error=f"reduction failed: {e}"), b""
        if sender not in contributors:
            return PartReply(ok=False, error="dropped from the part"), b""
        await state.hold_average(header.segment)
        self.event("average_out")
        return PartReply(ok=True, contributors=contributors, payload_len=len(data)), data

    async def _offer(self, slot: PartSlot, sender: str, header: PartHeader, payload: bytes) -> str:
        """Validate, decode (off the loop) and add one contribution; returns why it was refused ('' if not)."""
        problem = slot.check(sender, header, payload)
        if not problem:
            try:
                values = await asyncio.get_running_loop().run_in_executor(
                    None, _timed, "decode", slot.codec.decode, payload, slot.numel)  # (numel,), always finite
            except ValueError as e:
                problem = f"undecodable: {e}"
        problem = problem or slot.accept(sender, values, header.weight)
        if problem:
            slot.drop(sender, problem)
        return problem

    async def _wait_group(self, group_id: str, deadline: float) -> Optional[GroupState]:
        while group_id not in self._groups:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            self._group_added.clear()
            await wait_event(self._group_added, time.monotonic() + min(left, 0.5))
        return self._groups[group_id]

    async def _reduce(self, state: GroupState, key: tuple[int, int, int], deadline: float) -> None:
        """Wait for the slot's contributions until ``deadline``, then publish the encoded mean."""
        slot = state.slots[key]
        while not slot.complete() and time.monotonic() < deadline:
            slot.changed.clear()
            await wait_event(slot.changed, deadline)
        for peer, problem in sorted(slot.dropped.items()):
            if not any(b in problem for b in BENIGN):
                state.suspect(key, peer, f"dropped: {problem}")
        absent = sorted(slot.expected - set(slot.decoded) - set(slot.dropped))
        if absent:
            log.info("part %d.%d of group %s: dropped %s (no contribution by the deadline)", key[0], key[1],
                     state.group.group_id, ", ".join(absent))
        if not slot.decoded:
            slot.result.set_exception(RuntimeError("no contributions"))
            return
        codec = slot.codec
        contributions, rule = dict(slot.decoded), self.aggregation
        loop = asyncio.get_running_loop()
        try:
            reduced = await loop.run_in_executor(None, _timed, "reduce", aggregate, contributions, rule)
        except ValueError as e:
            slot.result.set_exception(RuntimeError(f"aggregation failed: {e}"))
            return
        data = await loop.run_in_executor(None, _timed, "encode", encode_aggregate, codec, reduced, contributions, rule,
                                          slot.average_out)
        contributors = reduced.used
        for peer, why in sorted(reduced.suspects.items()):
            state.suspect(key, peer, why)
        if reduced.suspects:
            log.warning("part %d.%d of group %s (%s): %s", key[0], key[1], state.group.group_id, rule.rule,
                        "; ".join(f"{p[-8:]} {why}" for p, why in sorted(reduced.suspects.items())))
        slot.decoded.clear()
        if key[2] == 0:
            self.event("reduced")
        slot.result.set_result((data, contributors))

    def event(self, point: str) -> None:
        """Report reaching ``point`` to the event hook, if any."""
        if self.event_hook is not None:
            self.event_hook(point)


def _timed(name: str, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, its CPU seconds counted as phase ``name`` (:mod:`peer.compression.phases`)."""
    with phase(name):
        return fn(*args)


async def wait_event(event: asyncio.Event, deadline: float) -> None:
    """Wait for ``event`` until ``deadline`` (a ``time.monotonic()`` time); returns either way."""
    try:
        await asyncio.wait_for(event.wait(), max(0.0, deadline - time.monotonic()))
    except asyncio.TimeoutError:
        pass
