"""Real hivemind DHT nodes on loopback with their p2p replicas on one asyncio loop: the fixture behind
the in-process matchmaking, state-transfer and admission tests."""

from __future__ import annotations

import asyncio
import threading
from contextlib import contextmanager
from typing import Any, Awaitable, Callable, Iterator, TypeVar

T = TypeVar("T")

__all__ = ["loopback_swarm", "run"]


def run(loop: asyncio.AbstractEventLoop, coro: Awaitable[T], timeout: float = 60.0) -> T:
    """Run ``coro`` on the swarm's loop from the test thread; its result, or its exception."""
    return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)


@contextmanager
def loopback_swarm(size: int, setup: Callable[[int, Any, Any], Awaitable[T]]
                   ) -> Iterator[tuple[list[Any], list[T], asyncio.AbstractEventLoop]]:
    """Start ``size`` DHT nodes (``peer.network.dht.start_dht``) bootstrapped from the first and a loop on a
    thread; run ``setup(i, node, p2p)`` there for each node with its p2p replica. Yields ``(nodes,
    setup results, loop)``; shuts the replicas, the DHTs and the loop down on exit."""
    from peer.network import DHTOptions, start_dht

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    opts = DHTOptions(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    dhts = [start_dht(opts)]
    p2ps: list[Any] = []
    try:
        dhts += [start_dht(DHTOptions(host_maddrs=opts.host_maddrs, initial_peers=dhts[0].maddrs()))
                 for _ in range(size - 1)]
        results = []
        for i, d in enumerate(dhts):
            p2p = run(loop, d.dht.replicate_p2p())
            p2ps.append(p2p)
            results.append(run(loop, setup(i, d, p2p)))
        yield dhts, results, loop
    finally:
        async def close() -> None:
            for p2p in p2ps:
                await p2p.shutdown()

        run(loop, close(), 30)
        for d in dhts:
            d.shutdown()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
