"""The wire of a direct lane (:mod:`peer.network.lanes`): one TLS connection carrying streams.

A connection carries streams one after another, each a named handler's request and reply as over
P2P; the handlers do not know which carried them. Frames: a kind byte, a 4-byte length, the data.
The caller's first frame is ``HELLO`` with the token the lane's owner issued to it over P2P; then
each stream is ``OPEN`` (the handler's name), ``DATA`` frames both ways, and ``END`` from each side.
A stream both sides ended leaves the connection idle for the next one.

:class:`LaneConnection` is an asyncio protocol: the frames are cut from what TLS decrypted without
copying, a stream's reader (:class:`LaneReader`) keeps those pieces until a read joins them, and its
writer (:class:`LaneWriter`) hands views of what it is given to TLS. Reading stops while a stream
holds :data:`READ_AHEAD` bytes nobody asked for (TCP then holds the sender), and inside a long frame
the kernel wakes us per :data:`LOW_WATER` bytes rather than per segment.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import socket
import struct
import time
from dataclasses import dataclass
from typing import Any, Optional

__all__ = ["LaneConnection", "LaneError", "LaneReader", "LaneWriter", "LaneStreamInfo", "MAX_FRAME", "READ_AHEAD",
           "LOW_WATER", "MAX_CONNECTIONS", "IDLE_TIMEOUT", "HELLO_TIMEOUT", "TOKEN_BYTES"]

log = logging.getLogger(__name__)

IDLE_TIMEOUT = 60.0
"""Seconds an idle connection is kept for the next stream; also the longest a stream's other side
may take to end once ours ended."""
HELLO_TIMEOUT = 5.0
"""Seconds an accepted connection has to finish its handshake and send a known token."""
MAX_FRAME = 1 << 20
"""Largest DATA frame either side accepts (and sends)."""
READ_AHEAD = 4 << 20
"""Bytes a stream buffers before its connection stops reading (the TCP window then holds the sender)."""
MAX_CONNECTIONS = 256
"""Most connections a peer's lane serves at once; more are closed on arrival."""
LOW_WATER = 32 * 1024
"""Bytes the kernel gathers before waking us inside a long frame (see ``LaneConnection._set_low_water``)."""
TOKEN_BYTES = 32
"""Bytes of a token (``HELLO``'s data)."""

_HEADER = struct.Struct(">BI")
_HELLO, _OPEN, _DATA, _END = 1, 2, 3, 4
_SMALL_FRAME = 1024
"""Largest frame of any kind but DATA (a token, a handler's name)."""
_TLS_RECORD = 16 * 1024 + 256
"""A TLS record's most bytes, with its overhead: what TLS may hold undecrypted at a time."""


class LaneError(ConnectionError):
    """A lane connection broke or broke the protocol: for callers, a stream cut like any other."""


class LaneReader:
    """One stream's incoming bytes: ``readexactly`` and ``read`` as ``asyncio.StreamReader``'s. It
    keeps the pieces the TLS layer decrypted (views, no copy) until a read joins what it returns."""

    def __init__(self, connection: "LaneConnection") -> None:
        self._connection = connection
        self._pieces: collections.deque[memoryview] = collections.deque()
        self._size = 0
        self._eof = False
        self._error: Optional[BaseException] = None
        self._discard = False
        self._arrived = asyncio.Event()
        self._wanted = 1
        """Bytes the waiting read needs: it is woken once they are here, not for every TLS record."""

    def _feed(self, piece: memoryview) -> None:
        if self._discard:
            return
        self._pieces.append(piece)
        self._size += len(piece)
        if self._size >= self._wanted:
            self._arrived.set()
            if self._size > READ_AHEAD:  # nobody needs more now: the TCP window holds the sender
                self._connection.pause_reading()

    def _end(self, error: Optional[BaseException] = None) -> None:
        if error is not None and not self._eof:
            self._error = error
        self._eof = True
        self._arrived.set()

    def _stop_reading(self) -> None:
        """Nobody reads this stream any more: what still arrives is dropped."""
        self._discard = True
        self._pieces.clear()
        self._size = 0
        self._connection.resume_reading()

    def _take(self, n: int) -> bytes:
        out = []
        left = n
        while left:
            piece = self._pieces[0]
            if len(piece) <= left:
                out.append(self._pieces.popleft())
                left -= len(piece)
            else:
                out.append(piece[:left])
                self._pieces[0] = piece[left:]
                left = 0
        self._size -= n
        if self._size <= READ_AHEAD // 2:
            self._connection.resume_reading()
        return out[0].tobytes() if len(out) == 1 else b"".join(out)

    async def _wait(self, wanted: int = 1) -> None:
        self._wanted = wanted
        self._connection.resume_reading()  # a read of more than READ_AHEAD bytes needs them all here
        self._arrived.clear()
        try:
            await self._arrived.wait()
        finally:
            self._wanted = 1

    async def readexactly(self, n: int) -> bytes:
        while self._size < n:
            if self._eof:
                if self._error is not None:
                    raise self._error
                raise asyncio.IncompleteReadError(self._take(self._size), n)
            await self._wait(n)
        return self._take(n)

    async def read(self, n: int = -1) -> bytes:
        while not self._size:
            if self._eof:
                if self._error is not None:
                    raise self._error
                return b""
            await self._wait()
        if n < 0:
            while not self._eof:  # everything up to the end, as StreamReader.read() does
                await self._wait()
            if self._error is not None:
                raise self._error
            return self._take(self._size)
        return self._take(min(n, self._size))


class LaneWriter:
    """One stream's outgoing side: ``write``, ``drain``, ``close`` as ``asyncio.StreamWriter``'s.
    Writes are gathered into frames of up to :data:`MAX_FRAME` bytes, handed to TLS as they are."""

    def __init__(self, connection: "LaneConnection", stream: "_Stream") -> None:
        self._connection = connection
        self._stream = stream
        self._pending: list[memoryview] = []
        self._pending_bytes = 0
        self._closed = False

    def write(self, data: Any) -> None:
        if self._closed:
            raise LaneError("write to a closed lane stream")
        view = memoryview(data).cast("B")
        if not view.readonly:  # a buffer its owner may change before TLS took it
            view = memoryview(view.tobytes())
        while len(view):
            room = MAX_FRAME - self._pending_bytes
            self._pending.append(view[:room])
            self._pending_bytes += len(self._pending[-1])
            view = view[room:]
            if self._pending_bytes >= MAX_FRAME:
                self._flush()

    def _flush(self) -> None:
        if self._pending_bytes:
            self._connection.send(_DATA, *self._pending)
            self._pending, self._pending_bytes = [], 0

    async def drain(self) -> None:
        self._flush()
        await self._connection.drain()

    def close(self) -> None:
        """End our side of the stream (what is written is sent first); further incoming bytes are dropped."""
        if self._closed:
            return
        self._closed = True
        self._stream.reader._stop_reading()
        with contextlib.suppress(Exception):
            self._flush()
            self._connection.send(_END)
        self._stream.sent_end = True
        self._connection.stream_changed()


class _Stream:
    def __init__(self, connection: "LaneConnection") -> None:
        self.reader = LaneReader(connection)
        self.writer = LaneWriter(connection, self)
        self.sent_end = False
        self.got_end = False


@dataclass
class LaneStreamInfo:
    """What a handler learns of its caller (as hivemind's ``StreamInfo``): ``peer_id``, a ``PeerID``."""
    peer_id: Any


class LaneConnection(asyncio.Protocol):
    """One TLS connection (an asyncio protocol: the frames are cut from what TLS decrypted, without
    copying), carrying at most one stream at a time. A served connection knows its caller once the
    first frame, ``HELLO`` with a token we issued, arrived within :data:`HELLO_TIMEOUT`.

    ``lanes``: the :class:`peer.network.lanes.DirectLanes` it belongs to (its tokens, handlers, pool
    and pauses)."""

    def __init__(self, lanes: Any, serving: bool, peer: str = "") -> None:
        self.lanes = lanes
        self.serving = serving
        self.peer = peer
        self.transport: Optional[asyncio.Transport] = None
        self.stream: Optional[_Stream] = None
        self.closed = False
        self.idle_since = time.monotonic()
        self._linger: Optional[asyncio.TimerHandle] = None
        self._hello_timer: Optional[asyncio.TimerHandle] = None
        self._header = bytearray()
        self._kind = 0
        self._left = 0
        self._small = bytearray()
        self._reading_paused = False
        self._socket: Any = None
        self._low_water = 1
        self._writable = asyncio.Event()
        self._writable.set()

    # -- asyncio.Protocol -------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self._socket = transport.get_extra_info("socket")
        if self.serving:
            if len(self.lanes._connections) >= MAX_CONNECTIONS:
                transport.abort()
                return
            self._hello_timer = asyncio.get_running_loop().call_later(
                HELLO_TIMEOUT, self.close, LaneError("no token in time"))
        self.lanes._connections.add(self)

    def connection_lost(self, exc: Optional[BaseException]) -> None:
        self.close(LaneError(f"the lane to {self.peer[-8:] or 'an unknown caller'} closed: {exc!r}"))

    def pause_writing(self) -> None:
        self._writable.clear()

    def resume_writing(self) -> None:
        self._writable.set()

    def data_received(self, data: bytes) -> None:
        try:
            self._cut(memoryview(data))
        except LaneError as e:
            log.debug("lane connection from %s closed: %s", self.peer[-8:] or "an unknown caller", e)
            self.close(e)
            return
        self._set_low_water()

    def _set_low_water(self) -> None:
        """Within a long DATA frame, have the kernel wake us once :data:`LOW_WATER` bytes are in
        (``SO_RCVLOWAT``) rather than for each segment: at 25 Mbit/s a wake per segment, each a TLS
        read, cost the loop more than the bytes did. Only bytes certain to come are waited for: the
        frame's rest, less what TLS may hold back undecrypted (one record)."""
        low = LOW_WATER if self._kind == _DATA and self._left > LOW_WATER + _TLS_RECORD else 1
        if low != self._low_water and self._socket is not None:
            try:
                self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, low)
            except OSError:  # not TCP, or not allowed here: woken per segment as before
                self._socket = None
                return
            self._low_water = low

    def _cut(self, view: memoryview) -> None:
        while len(view) and not self.closed:
            if self._left == 0 and self._kind == 0:  # a frame header
                take = min(len(view), _HEADER.size - len(self._header))
                self._header += view[:take]
                view = view[take:]
                if len(self._header) < _HEADER.size:
                    return
                self._kind, self._left = _HEADER.unpack(self._header)
                self._header.clear()
                if self._left > (MAX_FRAME if self._kind == _DATA else _SMALL_FRAME):
                    raise LaneError(f"a {self._left}-byte frame of kind {self._kind}: too large")
                if self._left == 0:
                    self._frame(b"")
                continue
            take = min(len(view), self._left)
            piece, view = view[:take], view[take:]
            self._left -= take
            if self._kind == _DATA:
                stream = self.stream
                if stream is None or stream.got_end or not self.peer:
                    raise LaneError("data outside a stream")
                stream.reader._feed(piece)
                if self._left == 0:
                    self._kind = 0
            else:
                self._small += piece
                if self._left == 0:
                    self._frame(bytes(self._small))
                    self._small.clear()

    def _frame(self, data: bytes) -> None:
        kind, self._kind = self._kind, 0
        stream = self.stream
        if kind == _HELLO and self.serving and not self.peer:
            issued = self.lanes._tokens.get(data)
            if len(data) != TOKEN_BYTES or issued is None or issued[1] <= time.monotonic():
                raise LaneError("not a token we issued")
            self.peer = issued[0]
            if self._hello_timer is not None:
                self._hello_timer.cancel()
        elif not self.peer:
            raise LaneError("a frame before the token")
        elif kind == _OPEN and self.serving and stream is None:
            self._open(data)
        elif kind == _DATA and stream is not None and not stream.got_end:  # an empty one
            pass
        elif kind == _END and stream is not None and not stream.got_end:
            stream.got_end = True
            stream.reader._end()
            self.stream_changed()
        else:
            raise LaneError(f"frame kind {kind} out of place")

    # -- for the streams --------------------------------------------------------------------------

    def pause_reading(self) -> None:
        if not self._reading_paused and self.transport is not None and not self.closed:
            self._reading_paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self._reading_paused and self.transport is not None and not self.closed:
            self._reading_paused = False
            self.transport.resume_reading()

    def send(self, kind: int, *chunks: Any) -> None:
        if self.closed or self.transport is None:
            raise LaneError(f"the lane to {self.peer[-8:]} is closed")
        self.transport.write(_HEADER.pack(kind, sum(len(c) for c in chunks)))
        for chunk in chunks:  # one by one: writelines would join them into a copy first
            self.transport.write(chunk)

    async def drain(self) -> None:
        while not self._writable.is_set():
            if self.closed:
                break
            await self._writable.wait()
        if self.closed:
            raise LaneError(f"the lane to {self.peer[-8:]} is closed")

    def begin(self, name: str) -> _Stream:
        """A stream to the handler ``name`` (we are the caller)."""
        self.stream = _Stream(self)
        self.send(_OPEN, name.encode())
        return self.stream

    def stream_changed(self) -> None:
        """Once both sides ended the stream, the connection is idle: pooled (caller) or ready for the
        next OPEN (server). While only ours ended, the other side has :data:`IDLE_TIMEOUT` to end it."""
        stream = self.stream
        if stream is None or self.closed:
            return
        if stream.sent_end and stream.got_end:
            self.stream = None
            if self._linger is not None:
                self._linger.cancel()
                self._linger = None
            self.idle_since = time.monotonic()
            if not self.serving:
                self.lanes._idle_connection(self)
        elif stream.sent_end and self._linger is None:
            self._linger = asyncio.get_running_loop().call_later(
                IDLE_TIMEOUT, self.close, LaneError("the other side never ended its stream"))

    def _open(self, data: bytes) -> None:
        name = data.decode("utf-8", errors="replace")
        handler = self.lanes._handlers.get(name)
        if handler is None:
            raise LaneError(f"no handler {name!r}")
        stream = self.stream = _Stream(self)
        info = LaneStreamInfo(self.lanes._peer_id_type.from_base58(self.peer))

        async def run() -> None:
            try:
                await handler(info, stream.reader, stream.writer)
            finally:
                stream.writer.close()

        self.lanes._track(asyncio.ensure_future(run()))

    def close(self, error: Optional[BaseException] = None) -> None:
        if self.closed:
            return
        self.closed = True
        self._writable.set()
        for timer in (self._linger, self._hello_timer):
            if timer is not None:
                timer.cancel()
        stream = self.stream
        if stream is not None and not stream.got_end:
            stream.reader._end(error or LaneError(f"the lane to {self.peer[-8:]} closed"))
        if not self.serving and stream is not None:  # a stream of ours cut: P2P for a while
            self.lanes._pause(self.peer, f"a connection broke: {error!r}")
        if self.transport is not None:
            self.transport.abort() if error is not None and stream is not None else self.transport.close()
        self.lanes._forget(self)
