"""Real hivemind DHT nodes on loopback with their p2p replicas on one asyncio loop: the fixture behind
the in-process matchmaking, state-transfer and admission tests."""

from __future__ import annotations

import asyncio
import concurrent.futures
import faulthandler
import os
import signal
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from typing import Any, Awaitable, Callable, Iterator, TypeVar

T = TypeVar("T")

__all__ = ["loopback_swarm", "run"]

_STACKS = tempfile.TemporaryFile()
"""Where this process and the DHT processes it forks write their threads' stacks on SIGUSR2
(``faulthandler``, registered before any fork, so the children inherit it)."""
faulthandler.register(signal.SIGUSR2, file=_STACKS, all_threads=True)
_DHT_PIDS: set[int] = set()
"""The DHT processes of the swarms now open."""


def run(loop: asyncio.AbstractEventLoop, coro: Awaitable[T], timeout: float = 60.0) -> T:
    """Run ``coro`` on the swarm's loop from the test thread; its result, or its exception. One that
    does not end within ``timeout`` raises ``TimeoutError`` with the stacks of this process's threads
    and of every open swarm's DHT processes (a wedged DHT process is otherwise silent)."""
    future = asyncio.run_coroutine_threadsafe(coro, loop)
    try:
        return future.result(timeout)
    except concurrent.futures.TimeoutError:
        future.cancel()
        raise TimeoutError(f"no result within {timeout:.0f}s; stacks:\n{_stacks()}") from None


def _stacks(limit: int = 60_000) -> str:
    """The stacks of this process's threads and of the open swarms' DHT processes (SIGUSR2)."""
    start = _STACKS.seek(0, os.SEEK_END)
    os.kill(os.getpid(), signal.SIGUSR2)
    for pid in sorted(_DHT_PIDS):
        try:
            os.kill(pid, signal.SIGUSR2)
        except ProcessLookupError:
            pass
    deadline, size = time.monotonic() + 5.0, -1
    while time.monotonic() < deadline:  # the children write asynchronously: until the file stops growing
        time.sleep(0.5)
        now = _STACKS.seek(0, os.SEEK_END)
        if now == size:
            break
        size = now
    _STACKS.seek(start)
    text = _STACKS.read().decode(errors="replace")
    header = f"(this process {os.getpid()}, DHT processes {sorted(_DHT_PIDS)}, python {sys.version.split()[0]})\n"
    return header + (text if len(text) <= limit else text[:limit] + "\n[...]")


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
        _DHT_PIDS.update(d.dht.pid for d in dhts)
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

        try:
            run(loop, close(), 30)
        finally:
            _DHT_PIDS.difference_update(d.dht.pid for d in dhts)
            for d in dhts:
                d.shutdown()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
