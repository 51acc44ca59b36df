"""Frames that are not messages: refused with INVALID_ARGUMENT at the wire, before any servicer runs.

gRPC's generated handlers parse each request with ``Message.FromString``. Bytes that are not a valid
message (random bytes, a truncated field, an overlong varint, invalid UTF-8 in a string field, a
stray end-group tag) make protobuf raise ``DecodeError``; left alone, grpc answers UNKNOWN with the
exception's class and text, or the servicer's own mapping answers INTERNAL on streams, and each call
logs a traceback: anyone who can reach the port could fill the operator's disk without a token.

:class:`MalformedFrameGuard` is a server interceptor that re-registers every method's handler, of
every service the server hosts, with a parser that turns ``DecodeError`` into a refusal:

- a unary request: the parser returns a marker and the wrapped behaviour answers
  ``INVALID_ARGUMENT: malformed request`` before the servicer sees anything;
- a streamed request: ``context.read()`` raises :class:`MalformedRequest` (a
  :class:`coordinator.errors.RequestError`), which the servicer maps like any invalid argument, and
  the wrapped behaviour maps for a servicer that does not.

The reply names no parser detail. Each refusal calls ``on_malformed(method)`` (the coordinator counts
them for ``/metrics``) and the log gets at most one line per method per ``log_interval`` seconds,
saying how many more were refused since the last line. Well-formed requests pass through unchanged:
a message that parses (an empty frame, unknown fields) is the servicer's to judge.

Only asyncio behaviours are wrapped (the coordinator's servicers all are); a synchronous one is
left as grpc registered it.
"""

from __future__ import annotations

import functools
import inspect
import logging
import time
from typing import Any, Awaitable, Callable, Optional

import grpc
from google.protobuf.message import DecodeError

from coordinator.errors import RequestError
from models.log_limit import LOG_INTERVAL, LogLimiter

__all__ = ["MALFORMED", "MalformedRequest", "MalformedFrameGuard"]

log = logging.getLogger(__name__)

MALFORMED = "malformed request"
"""The whole reply detail of a refused frame: neutral, it tells a prober nothing about the parser."""

class MalformedRequest(RequestError):
    """A streamed request frame that is not a valid message (raised by ``context.read()``)."""

    code = "INVALID_ARGUMENT"

    def __init__(self) -> None:
        super().__init__(MALFORMED)


_MARKER = object()
"""What a unary request's parser returns for a malformed frame; the wrapped behaviour refuses it."""

_FACTORIES = {
    (False, False): ("unary_unary", grpc.unary_unary_rpc_method_handler),
    (False, True): ("unary_stream", grpc.unary_stream_rpc_method_handler),
    (True, False): ("stream_unary", grpc.stream_unary_rpc_method_handler),
    (True, True): ("stream_stream", grpc.stream_stream_rpc_method_handler),
}


async def _refuse(context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, MALFORMED)


def _refusing(behavior: Callable[..., Any]) -> Callable[..., Any]:
    """``behavior`` that refuses the marker (unary) or :class:`MalformedRequest` (streamed), of the
    same kind (coroutine or async generator) so that grpc drives it the same way."""
    if inspect.isasyncgenfunction(behavior):
        @functools.wraps(behavior)
        async def stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if request is _MARKER:
                await _refuse(context)
            try:
                async for response in behavior(request, context):
                    yield response
            except MalformedRequest:
                await _refuse(context)

        return stream

    @functools.wraps(behavior)
    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if request is _MARKER:
            await _refuse(context)
        try:
            return await behavior(request, context)
        except MalformedRequest:
            await _refuse(context)

    return call


class MalformedFrameGuard(grpc.aio.ServerInterceptor):
    """Refuses request frames that do not parse, for every method the server hosts (see the module).

    ``on_malformed(method)`` is called once per refused frame, on the event loop.
    """

    def __init__(self, on_malformed: Callable[[str], None] = lambda method: None,
                 log_interval: float = LOG_INTERVAL, clock: Callable[[], float] = time.monotonic):
        self._on_malformed = on_malformed
        self._limiter = LogLimiter(log_interval, clock)
        self._guarded: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Optional[grpc.RpcMethodHandler]]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Optional[grpc.RpcMethodHandler]:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        method = handler_call_details.method
        cached = self._guarded.get(method)  # only methods the server hosts: bounded
        if cached is not None and cached[0] is handler:
            return cached[1]
        guarded = self.guard(method, handler)
        self._guarded[method] = (handler, guarded)
        return guarded

    def guard(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        """``handler`` with a parser that refuses malformed frames (itself where it is synchronous)."""
        kind, factory = _FACTORIES[(handler.request_streaming, handler.response_streaming)]
        behavior = getattr(handler, kind)
        if not (inspect.iscoroutinefunction(behavior) or inspect.isasyncgenfunction(behavior)):
            return handler
        parse = self._parser(method, handler.request_deserializer, handler.request_streaming)
        return factory(_refusing(behavior), request_deserializer=parse,
                       response_serializer=handler.response_serializer)

    def _parser(self, method: str, deserialize: Callable[[bytes], Any], streaming: bool) -> Callable[[bytes], Any]:
        def parse(raw: bytes) -> Any:
            try:
                return deserialize(raw)
            except DecodeError as e:  # protobuf reports invalid UTF-8 in a string field this way too
                self._refused(method, e)
                if streaming:
                    raise MalformedRequest() from None
                return _MARKER

        return parse

    def _refused(self, method: str, error: DecodeError) -> None:
        self._on_malformed(method)
        held = self._limiter.admit(method)
        if held is not None:
            more = f"; {held} more since the last such line" if held else ""
            log.warning("refused a malformed request to %s (%s)%s", method, " ".join(str(error).split()), more)
