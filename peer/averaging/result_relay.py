"""``ResultRelay``: the ``Result`` rpc, by which a split round's average goes down each group's tree.

A member of a split round asks its parent in its group's tree (:func:`peer.averaging.hierarchy.tree`) for
the round's average and passes each part on to its own children as it arrives; a top group member serves
the round's average to the delegates of groups that came late (:func:`round_key`). Every average is
checked before a byte of it is passed on or applied: its head against the module
(:func:`~peer.averaging.hierarchy.check_head`)
and the digest the top group agreed on, each part against its digest (a parent that sent other bytes is
a :class:`~peer.averaging.hierarchy.LyingPeer`). Separate from :mod:`peer.averaging.hierarchy`, which
holds the split round's plan, trees and digests: this is the wire that carries the average.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Optional

from peer.averaging.hierarchy import (PART_DIGEST_BYTES, LyingPeer, RoundResult, check_head, part_digest,
                                      result_digest)
from peer.averaging.partition import Group
from peer.compression import Codec
from peer.network.frames import MESSAGE_LIMIT, handler_name, linger, read_message, read_payload, serve
from protos.hivepath.peer.v1.net_pb2 import DESCRIPTOR as NET, ResultReply, ResultRequest
from protos.versions import writes

RESULT = NET.services_by_name["Averaging"].methods_by_name["Result"]
"""The ``Result`` rpc of ``net.proto``: a bucket member asks its parent for the round's average."""

__all__ = ["ResultRelay", "round_key", "Agreed", "RESULT"]

log = logging.getLogger(__name__)

UNKNOWN_WAIT = 5.0
"""Seconds a request for a group we do not know yet waits for it (every member learns its group at
the same BEGIN, but a child may ask before its parent registered it)."""
KEEP = 30.0
"""Seconds a served result stays after its round's deadline (a slow child still gets it)."""

Agreed = Callable[[], Awaitable[str]]
"""Returns the :func:`result_digest` the top group agreed on (raises when none is by the deadline)."""


@dataclass
class _Place:
    """A bucket group's average at this member, filled as it arrives: its head (codec, bounds, blob
    lengths, contributors), then its parts one by one; children are served each part as it comes."""

    members: Optional[frozenset[str]]
    """Who may ask (None: any admitted peer; the round's average a top group member serves to late groups)."""
    head: Optional[tuple[str, tuple[int, ...], tuple[int, ...], tuple[str, ...], bool, tuple[bytes, ...]]] = None
    """(codec, bounds, lengths, contributors, late, part digests)."""
    payloads: list[bytes] = field(default_factory=list)
    error: str = ""
    complete: bool = False
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def bump(self) -> None:
        """Wake every waiter (each waits on the event it read before checking)."""
        event, self.changed = self.changed, asyncio.Event()
        event.set()

    async def until(self, ready: Callable[[], bool], deadline: float) -> bool:
        """Wait until ``ready()`` or a failure or ``deadline``; whether ``ready()`` holds."""
        while not ready() and not self.error and time.monotonic() < deadline:
            event = self.changed
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(event.wait(), max(0.0, deadline - time.monotonic()))
        return ready()


def round_key(module_id: str, round_no: int) -> str:
    """The name under which a top group's members serve a round's average to late groups."""
    return f"{module_id}/r{round_no}"


class ResultRelay:
    """Serves the averages of split rounds down each bucket's tree and fetches ours from our parent.

    Lives on the averager's loop; :meth:`start` registers the ``{prefix}_result`` handler. A bucket's
    result is served only to members of the bucket's group it is kept for, a round's (to late groups,
    :meth:`expect_round`) to any peer, and both (with a ``verifier``) to admitted peers only. It is
    passed on as it arrives (each part to our children as soon as we have it), so the
    tree's depth adds a part's time per hop, not the whole average's."""

    def __init__(self, p2p: Any, peer_id: str, prefix: str, credential: Optional[Callable[[], bytes]] = None,
                 verifier: Optional[Any] = None):
        self.p2p = p2p
        self.peer_id = peer_id
        self.prefix = prefix
        self.handler_name = handler_name(prefix, RESULT)
        self.credential = credential or (lambda: b"")
        self.verifier = verifier
        self._kept: dict[str, _Place] = {}
        self._added = asyncio.Event()

    async def start(self) -> None:
        await serve(self.p2p, self.prefix, RESULT, self._handle)

    def expect(self, group: Group, until: float) -> _Place:
        """Keep a place for ``group``'s average (served to its members as :meth:`publish` or
        :meth:`fetch` fills it) until ``until`` (``time.monotonic()``) plus :data:`KEEP`."""
        return self._expect(group.group_id, frozenset(group.members), until)

    def expect_round(self, module_id: str, round_no: int, until: float) -> _Place:
        """As a member of a round's top group: keep a place for the round's average, served to any
        admitted peer that asks (the delegate of a group that missed the top group, :func:`round_key`)."""
        return self._expect(round_key(module_id, round_no), None, until)

    def _expect(self, key: str, members: Optional[frozenset[str]], until: float) -> _Place:
        place = self._kept[key] = _Place(members)
        self._added.set()
        asyncio.get_running_loop().call_later(max(0.0, until - time.monotonic()) + KEEP, self._forget, key, place)
        return place

    def publish(self, group_id: str, result: RoundResult) -> None:
        """Fill the place of ``group_id`` with a whole average (the delegate's, from the top group)."""
        place = self._kept.get(group_id)
        if place is None or place.complete or place.error:
            return
        place.head = (result.codec, tuple(x for a, b, _ in result.parts for x in (a, b)),
                      tuple(len(d) for *_, d in result.parts), result.contributors, result.late,
                      result.part_digests)
        place.payloads = [d for *_, d in result.parts]
        place.complete = True
        place.bump()

    def fail(self, group_id: str, error: str) -> None:
        """No average of ``group_id`` here (askers are told why, or see the stream end)."""
        place = self._kept.get(group_id)
        if place is None or place.complete or place.error:
            return
        place.error = error or "no average"
        place.bump()

    def _forget(self, key: str, place: _Place) -> None:
        if self._kept.get(key) is place:  # not a later place under the same key (a round tried again)
            del self._kept[key]
        if not place.complete and not place.error:
            place.error = "expired"
            place.bump()

    async def _handle(self, stream_info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        from hivemind.p2p import P2P

        sender = stream_info.peer_id.to_base58()
        request = await read_message(reader, ResultRequest)
        if request is None:
            return
        reply, place = await self._answer(sender, request)
        await P2P.send_protobuf(reply, writer)
        if place is None:
            return
        deadline = time.monotonic() + KEEP
        for i in range(len(reply.payload_lens)):  # each part as soon as we have it
            if not await place.until(lambda: len(place.payloads) > i, deadline):
                log.debug("average of a group for %s ended at part %d: %s", sender[-8:], i, place.error or "timeout")
                return  # the stream ends short: the child asks the delegate instead
            await P2P.send_raw_data(place.payloads[i], writer)
        await linger(reader, KEEP)

    async def _answer(self, sender: str, request: ResultRequest) -> tuple[ResultReply, Optional[_Place]]:
        mine = self.credential()
        if self.verifier is not None:
            problem = self.verifier.check(request.credential, sender)
            if problem:
                self.verifier.log_refusal(sender, "a round's average", problem)
                return ResultReply(ok=False, error=f"not admitted: {problem}", credential=mine), None
        deadline = time.monotonic() + UNKNOWN_WAIT  # a child may ask before we have the group ourselves
        while request.group_id not in self._kept and time.monotonic() < deadline:
            self._added.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._added.wait(), max(0.0, deadline - time.monotonic()))
        place = self._kept.get(request.group_id)
        if place is None or (place.members is not None and sender not in place.members):
            return ResultReply(ok=False, error="no average of that group here for you", credential=mine), None
        if not await place.until(lambda: place.head is not None, time.monotonic() + KEEP):
            return ResultReply(ok=False, error=place.error or "no average in time", credential=mine), None
        codec, bounds, lengths, contributors, late, digests = place.head
        reply = ResultReply(ok=True, codec=codec, bounds=bounds, payload_lens=lengths, contributors=contributors,
                            late=late, credential=mine)
        if writes("averaging", "ResultReply.part_digests"):
            reply.part_digests.extend(digests)
        return reply, place

    async def fetch(self, peer: str, group_id: str, numel: int, codec: Codec, deadline: float,
                    place: Optional[_Place] = None, late: bool = False, agreed: Optional[Agreed] = None) -> RoundResult:
        """The average of ``group_id``'s round from ``peer`` (our parent or the delegate), checked to be
        ``numel`` values in ``codec``; raises if ``peer`` has none by ``deadline`` or sends a bad one.
        With ``agreed`` (the digest the top group states, :data:`Agreed`), the head is checked against it
        before anything is passed on and each part against its digest as it arrives: :class:`LyingPeer`
        when ``peer`` sent other bytes.
        With our ``place`` (:meth:`expect`), each part is passed on to our children as it arrives; a
        second fetch (from the delegate, after our parent failed) adds only the parts after those.
        ``late``: the round's average fetched by a group that missed the top group (passed on so)."""
        return await asyncio.wait_for(self._fetch(peer, group_id, numel, codec, place, late, agreed),
                                      max(0.01, deadline - time.monotonic()))

    async def _fetch(self, peer: str, group_id: str, numel: int, codec: Codec, place: Optional[_Place],
                     late: bool, agreed: Optional[Agreed]) -> RoundResult:
        from hivemind.p2p import P2P, PeerID

        _, reader, writer = await self.p2p.call_binary_stream_handler(PeerID.from_base58(peer), self.handler_name)
        try:
            await P2P.send_protobuf(ResultRequest(group_id=group_id, credential=self.credential()), writer)
            reply = await read_message(reader, ResultReply, MESSAGE_LIMIT)
            if reply is None:
                raise RuntimeError(f"{peer[-8:]} ended the stream")
            if self.verifier is not None:
                problem = self.verifier.check(reply.credential, peer)
                if problem:
                    raise RuntimeError(f"{peer[-8:]} is not admitted: {problem}")
            if not reply.ok:
                raise RuntimeError(f"{peer[-8:]}: {reply.error}")
            problem = check_head(reply.codec, reply.bounds, reply.payload_lens, numel, codec)
            if problem:
                raise RuntimeError(f"{peer[-8:]} sent a bad average: {problem}")
            digests = tuple(bytes(d) for d in reply.part_digests)
            if digests and (len(digests) != len(reply.payload_lens)
                            or any(len(d) != PART_DIGEST_BYTES for d in digests)):
                raise LyingPeer(peer, f"{len(digests)} part digests for {len(reply.payload_lens)} parts")
            if agreed is not None and digests:
                want = await agreed()
                got = result_digest(reply.codec, reply.bounds, reply.payload_lens, digests)
                if got != want:
                    raise LyingPeer(peer, f"its average's digest {got[:12]} is not the top group's {want[:12]}")
            head = (reply.codec, tuple(reply.bounds), tuple(reply.payload_lens), tuple(sorted(reply.contributors)),
                    bool(reply.late) or late, digests)
            # a parent of an older minor sends no part digests: the parts are checked once all are here,
            # and only then passed on
            streamed = bool(digests) or agreed is None
            if place is not None and streamed:
                if place.head is None:
                    place.head = head
                    place.bump()
                elif place.head[:3] + place.head[5:] != head[:3] + head[5:]:
                    raise RuntimeError(f"{peer[-8:]} sent another average than the one we began to pass on")
            parts = []
            for i, length in enumerate(reply.payload_lens):
                a, b = int(reply.bounds[2 * i]), int(reply.bounds[2 * i + 1])
                data = bytes(await read_payload(reader, length))
                if len(data) != length:
                    raise RuntimeError(f"{peer[-8:]} announced {length} bytes and sent {len(data)}")
                if digests and part_digest(data) != digests[i]:
                    raise LyingPeer(peer, f"part {i} ({a}, {b}) does not match its digest")
                if place is not None and streamed:
                    if len(place.payloads) == i:
                        place.payloads.append(data)
                        place.bump()
                    elif place.payloads[i] != data:
                        raise RuntimeError(f"{peer[-8:]} sent other bytes than the ones we began to pass on")
                parts.append((a, b, data))
        finally:
            writer.close()
        result = RoundResult(reply.codec, tuple(parts), head[3], head[4])
        if not streamed:
            want = await agreed()
            if result.digest != want:
                raise LyingPeer(peer, f"its average's digest {result.digest[:12]} is not the top group's {want[:12]}")
            if place is not None:
                if place.head is not None and place.head[:3] + place.head[5:] != head[:3] + (result.part_digests,):
                    raise RuntimeError(f"{peer[-8:]} sent another average than the one we began to pass on")
                place.head = place.head or head[:5] + (result.part_digests,)
                place.payloads[len(place.payloads):] = [d for *_, d in parts][len(place.payloads):]
        if place is not None:
            place.complete = True
            place.bump()
        return result
