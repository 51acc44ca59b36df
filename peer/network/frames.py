"""The peers' p2p doors: every handler reads its frames with a limit and refuses malformed ones quietly.

A peer answers other peers over hivemind's P2P streams (not gRPC). The protocols are declared as
services in ``protos/hivepath/peer/v1`` (``Averaging``: Join, Part, State; ``Stage``: Stage): each rpc
is one stream handler named ``hivepath_{run_id}_{rpc name in lower case}`` (:func:`handler_name`).
The framing is hivemind's: a marker byte (``0``: a message; ``1``: an error, or with an empty error
the end of the caller's requests), an 8-byte big-endian length, then the message.

hivemind's own reader trusts that length (a caller announcing 2**60 bytes gets a buffer that grows as
long as it sends) and lets protobuf's ``DecodeError`` escape into its stream handler, which logs a
traceback per frame; a handler of ours that raised did the same through asyncio. Anyone who can dial
a peer could fill its memory or its operator's disk. Here:

- :func:`read_message` and :func:`read_payload` read one frame with a byte limit and raise
  :class:`MalformedFrame` for a bad marker, an oversized length or bytes that are not the message
  (:func:`read_payload_into` keeps what arrived of a payload whose stream ended early);
- :func:`serve` registers a handler for one rpc of a service descriptor, guarded: a malformed frame
  is answered with an error frame saying exactly :data:`MALFORMED`, the stream closes, nothing else
  happens, and the log gets at most one line per rpc per :data:`models.log_limit.LOG_INTERVAL`
  (saying how many more were refused); a broken stream is a debug line; a handler that fails is one
  rate-limited warning line (the traceback at debug level) and an error frame naming only its class;
- :func:`serve_messages` is the request-reply form (one request message, a stream of replies), wire
  compatible with hivemind's ``P2P.iterate_protobuf_handler`` on the calling side.

:data:`REFUSED` counts the refused frames per rpc (for status pages and tests).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from typing import Any, AsyncIterator, Awaitable, Callable, Optional, Type, TypeVar

from google.protobuf.descriptor import MethodDescriptor
from google.protobuf.message import DecodeError, Message

from models.log_limit import LogLimiter
from protos import versions

__all__ = ["MALFORMED", "MalformedFrame", "REFUSED", "read_message", "read_payload", "read_payload_into", "handler_name", "serve",
           "serve_messages", "send_error", "log_limited", "linger", "MESSAGE_LIMIT", "ERROR_LINGER", "STREAM_CUT"]

log = logging.getLogger(__name__)

STREAM_CUT = (EOFError, ConnectionError)
"""What a stream cut mid-way raises (``asyncio.IncompleteReadError`` is an ``EOFError``), e.g. by a
relay's reset (``peer.network.relays``): worth asking again over the next connection."""

MALFORMED = "malformed request"
"""The whole error text sent back for a refused frame: it tells a prober nothing about the parser."""

MESSAGE_LIMIT = 64 * 1024
"""Default byte limit of one request message (headers and requests; a stage request sets its own)."""

END_GRACE = 5.0
"""Seconds a request-reply handler waits, once it has answered, for the caller's end of requests."""
ERROR_LINGER = 5.0
"""Seconds a handler that sent an error frame waits for the caller to hang up before it closes (see
:func:`linger`)."""

_MESSAGE, _ERROR = b"\x00", b"\x01"
_LENGTH_BYTES = 8

REFUSED: Counter[str] = Counter()
"""Malformed frames refused so far in this process, per handler name."""

_limiter = LogLimiter()

M = TypeVar("M", bound=Message)
StreamHandler = Callable[[Any, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class MalformedFrame(ValueError):
    """A frame that is not what the protocol expects here (its text is for our log, never sent)."""


def handler_name(prefix: str, method: MethodDescriptor) -> str:
    """The P2P protocol name of ``method`` for a run whose handlers share ``prefix`` (``hivepath_{run_id}``)."""
    return f"{prefix}_{method.name.lower()}"


async def _read_frame(reader: asyncio.StreamReader, limit: int, what: str) -> tuple[bytes, bytes]:
    marker = await reader.readexactly(1)
    if marker not in (_MESSAGE, _ERROR):
        raise MalformedFrame(f"{what}: marker byte {marker[0]:#04x} is neither a message nor an error")
    size = int.from_bytes(await reader.readexactly(_LENGTH_BYTES), "big")
    if size > limit:
        raise MalformedFrame(f"{what}: {size} bytes announced, more than the {limit} accepted")
    return marker, await reader.readexactly(size)


async def read_message(reader: asyncio.StreamReader, cls: Type[M], limit: int = MESSAGE_LIMIT) -> Optional[M]:
    """One message of type ``cls``, or None where the caller ended its requests (an empty error frame).

    Raises :class:`MalformedFrame` for anything else, and ``asyncio.IncompleteReadError`` when the
    stream ends mid-frame or before one.
    """
    marker, data = await _read_frame(reader, limit, cls.__name__)
    if marker == _ERROR:
        if data:
            raise MalformedFrame(f"{cls.__name__}: an error frame where a request was expected")
        return None
    try:
        message = cls.FromString(data)
    except DecodeError as e:  # protobuf reports invalid UTF-8 in a string field this way too
        raise MalformedFrame(f"{cls.__name__}: {e}") from None
    versions.unknown_proto_fields(message)  # a later minor's fields: read past, counted
    return message


async def read_payload(reader: asyncio.StreamReader, limit: int) -> bytes:
    """The raw bytes that follow a header on the stream (hivemind's length-prefixed blob), at most ``limit``."""
    size = int.from_bytes(await reader.readexactly(_LENGTH_BYTES), "big")
    if size > limit:
        raise MalformedFrame(f"payload: {size} bytes announced, more than the {limit} accepted")
    return await reader.readexactly(size)


async def read_payload_into(reader: asyncio.StreamReader, buf: bytearray, expected: int) -> bool:
    """Append the payload that follows a header to ``buf`` as it arrives; it must announce exactly
    ``expected`` bytes. True when all of it came; False when the stream ended or broke first (what
    came is in ``buf``: a transfer through a relay that resets connections resumes from there)."""
    try:
        size = int.from_bytes(await reader.readexactly(_LENGTH_BYTES), "big")
    except (asyncio.IncompleteReadError, ConnectionError):
        return False
    if size != expected:
        raise MalformedFrame(f"payload: {size} bytes announced, {expected} expected")
    end = len(buf) + size
    while len(buf) < end:
        try:
            chunk = await reader.read(min(end - len(buf), 1 << 20))
        except ConnectionError:
            return False
        if not chunk:
            return False
        buf += chunk
    return True


async def send_message(message: Message, writer: asyncio.StreamWriter) -> None:
    data = message.SerializeToString()
    writer.write(_MESSAGE + len(data).to_bytes(_LENGTH_BYTES, "big") + data)
    await writer.drain()


async def send_error(writer: asyncio.StreamWriter, text: str) -> None:
    """An error frame (hivemind's ``RPCError``): the caller's ``iterate_protobuf_handler`` raises with ``text``."""
    from hivemind.proto.p2pd_pb2 import RPCError

    data = RPCError(message=text).SerializeToString()
    writer.write(_ERROR + len(data).to_bytes(_LENGTH_BYTES, "big") + data)
    await writer.drain()


async def linger(reader: asyncio.StreamReader, timeout: float) -> bool:
    """Wait (at most ``timeout`` s) until the other side closes the stream, before we close ours:
    closing right after a write can cut the stream before the daemon forwarded all of it (a caller
    then reads the end of the stream where our last frame should be). True when the other side
    closed it in time (it read what we wrote)."""
    with contextlib.suppress(asyncio.TimeoutError, ConnectionError, asyncio.IncompleteReadError):
        await asyncio.wait_for(reader.read(), timeout)
        return True
    return False


def log_limited(logger: logging.Logger, key: str, message: str, *args: Any) -> None:
    """``logger.warning(message, *args)`` at most once per ``key`` per interval (a refusal of a
    well-formed request that anyone could repeat), saying how many were held back since the last line."""
    held = _limiter.admit(key)
    if held is not None:
        logger.warning(message + (f" ({held} more since the last line)" if held else ""), *args)


def _refused(name: str, caller: str, problem: MalformedFrame) -> None:
    REFUSED[name] += 1
    held = _limiter.admit(f"malformed:{name}")
    if held is not None:
        more = f" ({held} more refused since the last line)" if held else ""
        log.warning("refused a malformed frame from %s on %s: %s%s", caller, name, problem, more)


def _failed(name: str, caller: str, error: BaseException) -> None:
    held = _limiter.admit(f"failed:{name}")
    if held is not None:
        more = f" ({held} more since the last line)" if held else ""
        log.warning("the %s handler failed on a request from %s: %r%s", name, caller, error, more)
    log.debug("the %s handler failed", name, exc_info=error)


async def serve(p2p: Any, prefix: str, method: MethodDescriptor, handler: StreamHandler,
                lanes: Optional[Any] = None) -> str:
    """Register ``handler(stream_info, reader, writer)`` for ``method``, guarded (see the module);
    the stream is closed when it returns. ``lanes``: a :class:`peer.network.lanes.DirectLanes` that
    serves it too, outside the p2p daemon. Returns the protocol name."""
    name = handler_name(prefix, method)

    async def guarded(stream_info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        caller = stream_info.peer_id.to_base58()
        try:
            await handler(stream_info, reader, writer)
        except MalformedFrame as e:
            _refused(name, caller, e)
            with contextlib.suppress(Exception):
                await send_error(writer, MALFORMED)
                await linger(reader, ERROR_LINGER)
        except (asyncio.IncompleteReadError, ConnectionError) as e:
            log.debug("%s stream from %s broke: %r", name, caller, e)
        except asyncio.CancelledError:  # the peer is shutting down: nothing awaits this task
            log.debug("%s stream from %s cancelled", name, caller)
        except Exception as e:
            _failed(name, caller, e)
            with contextlib.suppress(Exception):
                await send_error(writer, f"the handler failed: {type(e).__name__}")
                await linger(reader, ERROR_LINGER)
        finally:
            writer.close()

    await p2p.add_binary_stream_handler(name, guarded)
    if lanes is not None:
        lanes.serve(name, guarded)
    return name


async def serve_messages(p2p: Any, prefix: str, method: MethodDescriptor,
                         handler: Callable[[Any, Any], AsyncIterator[Message]], limit: int = MESSAGE_LIMIT) -> str:
    """Register ``handler(request, context)``, an async generator of replies, for ``method``: one
    request message of ``method``'s input type (at most ``limit`` bytes), then the end of the
    caller's requests; the replies are streamed back. The handler is cancelled when the caller hangs
    up. Returns the protocol name."""
    from google.protobuf.message_factory import GetMessageClass
    from hivemind.p2p import P2PContext

    cls = GetMessageClass(method.input_type)
    name = handler_name(prefix, method)

    async def respond(stream_info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        request = await read_message(reader, cls, limit)
        if request is None:
            return  # the caller ended its requests without one
        context = P2PContext(handle_name=name, local_id=p2p.peer_id, remote_id=stream_info.peer_id)

        async def replies() -> None:
            async for reply in handler(request, context):
                await send_message(reply, writer)

        ended = asyncio.Event()

        async def rest() -> None:
            """The end of the caller's requests, then nothing until it hangs up."""
            if await read_message(reader, cls, limit) is not None:
                raise MalformedFrame(f"{cls.__name__}: a second request on a one-request stream")
            ended.set()
            if await reader.read(1):
                raise MalformedFrame(f"{cls.__name__}: bytes after the end of the requests")

        answering, listening = asyncio.ensure_future(replies()), asyncio.ensure_future(rest())
        try:
            await asyncio.wait({answering, listening}, return_when=asyncio.FIRST_COMPLETED)
            if answering.done():
                answering.result()
                # hivemind's caller writes its end-of-requests frame while we answer: closing before it
                # arrived would break its write (BrokenPipeError on the caller's side), so read it first
                waiter = asyncio.ensure_future(ended.wait())
                await asyncio.wait({waiter, listening}, timeout=END_GRACE, return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
                return
            error = listening.exception()  # the caller hung up (None) or sent more than it should
            if error is not None and not isinstance(error, asyncio.IncompleteReadError):
                raise error
        finally:
            for task in (answering, listening):
                task.cancel()
            await asyncio.gather(answering, listening, return_exceptions=True)

    return await serve(p2p, prefix, method, respond)
