"""The stage protocol's one handler per p2p daemon: :func:`attach` a :class:`peer.stage.StageServer`
to it, :func:`detach` it when it stops.

A process serves one stage at a time, but it may serve several in turn (the coordinator moves a
server to another module). The p2p daemon of hivemind 1.1.12 keeps routing a protocol to the client
that first registered it, even after that client removed the handler and another registered it
again: the second server would never see a request. So the handler is registered once per daemon,
on a P2P replica and event loop that live as long as the process, and it hands each request to the
server attached now (none attached: a ``NOT_HELD`` reply, so the trainer tries another server).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any, AsyncIterator

from peer.network.dht import own_p2p
from peer.network.frames import MESSAGE_LIMIT, serve_messages
from peer.stage.wire import STAGE_RPC, stage_prefix
from protos.hivepath.peer.v1.stage_pb2 import StageReply, StageRequest

__all__ = ["attach", "detach"]

log = logging.getLogger(__name__)


class _Endpoint:
    """The handler of one daemon (one DHT), its replica and its event loop's thread."""

    def __init__(self, dht: Any, run_id: str, limit: int, startup_timeout: float):
        self.server: Any = None
        self.run_id = run_id
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="stage-endpoint", daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._register(dht, limit), self.loop).result(startup_timeout)

    async def _register(self, dht: Any, limit: int) -> None:
        self.p2p = await own_p2p(dht)  # not the shared handle: whoever shuts that down would cut us off
        # a stream handler: unary handlers on a second replica of the daemon hang in hivemind 1.1.12
        await serve_messages(self.p2p, stage_prefix(self.run_id), STAGE_RPC, self._handle, limit=limit)

    async def _handle(self, request: StageRequest, context: Any) -> AsyncIterator[StageReply]:
        server = self.server
        if server is None:
            yield StageReply(code=StageReply.NOT_HELD, error="this peer serves no stage now")
            return
        yield await server.handle(request, context)


_ENDPOINTS: dict[str, _Endpoint] = {}
_LOCK = threading.Lock()


def attach(server: Any, dht: Any, run_id: str, max_elements: int, startup_timeout: float = 30.0) -> None:
    """Route the daemon's stage requests to ``server`` (its ``handle(request, context)`` coroutine);
    registers the handler the first time a server of this daemon attaches. A request frame may carry
    ``max_elements`` fp32 values and little else."""
    key = dht.peer_id.to_base58()
    with _LOCK:
        endpoint = _ENDPOINTS.get(key)
        if endpoint is not None and endpoint.run_id != run_id:
            raise RuntimeError(f"this p2p daemon serves stages of run {endpoint.run_id}, not {run_id}")
        if endpoint is None:
            endpoint = _ENDPOINTS[key] = _Endpoint(dht, run_id, 4 * max_elements + MESSAGE_LIMIT, startup_timeout)
        if endpoint.server is not None and endpoint.server is not server:
            raise RuntimeError("another stage server of this process is still serving; close it first")
        endpoint.server = server


def detach(server: Any, dht: Any) -> None:
    """Stop routing requests to ``server`` (they are answered ``NOT_HELD`` until another attaches)."""
    with _LOCK:
        endpoint = _ENDPOINTS.get(dht.peer_id.to_base58())
        if endpoint is not None and endpoint.server is server:
            endpoint.server = None
