"""A user-space TCP relay that delays every byte by a fixed one-way time, in both directions.

This kernel has no ``netem``, so benchmarks that need a wide-area round-trip time put this relay in
front of each peer's listening port: the peer's p2p daemon listens on ``127.0.0.1`` inside its network
namespace only, and the relay, running in the same namespace, listens on the namespace's public
address and forwards to it. The relay's address is the one the peer announces, so it is the only way
in; every connection between two peers crosses exactly one relay (the callee's), which holds each
chunk it reads for ``delay`` seconds before writing it on, in both directions: a round trip gains
``2 * delay``.

What it is not: the relay terminates TCP, so each side's congestion control sees a short path and the
delay applies to application bytes (a delay line with a bounded buffer that keeps back-pressure),
not to TCP's own acknowledgements. Bandwidth limits are left to the sender's ``tbf`` qdisc.

Run as ``python -m bench.delay_relay --map LISTEN_HOST:PORT=TARGET_HOST:PORT --delay-ms 20``; in code
use :class:`DelayRelay` (``start()`` runs it on a background thread).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from models import strict_json
from models.durable import atomic_write_text

__all__ = ["DelayRelay", "RelayStats"]

log = logging.getLogger(__name__)

CHUNK = 64 * 1024
MAX_QUEUED_CHUNKS = 64
"""Chunks held per direction: at most 4 MiB in flight, then the relay stops reading (back-pressure)."""


@dataclass
class RelayStats:
    """Bytes the relay forwarded, summed over connections."""

    connections: int = 0
    bytes_to_target: int = 0
    """Client -> target bytes (what callers sent to the relayed peer)."""
    bytes_to_client: int = 0
    """Target -> client bytes."""


def _nodelay(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class DelayRelay:
    """Forward ``listen`` to ``target``, holding every chunk ``delay`` seconds in each direction."""

    def __init__(self, listen: tuple[str, int], target: tuple[str, int], delay: float,
                 sock: Optional[socket.socket] = None):
        """``sock``: a TCP socket already bound to ``listen`` to serve on (it keeps the port ours
        before the relay starts: bound but not listening, it refuses connections)."""
        if delay < 0:
            raise ValueError(f"delay must be >= 0 seconds, not {delay}")
        self.listen, self.target, self.delay = listen, target, delay
        self._sock = sock
        self.stats = RelayStats()
        self.port: int = listen[1]
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._server: Optional[asyncio.base_events.Server] = None
        self._thread: Optional[threading.Thread] = None
        self._tasks: set[asyncio.Task] = set()

    # -- serving ---------------------------------------------------------------------------------

    async def serve(self) -> None:
        """Bind the listening socket (``self.port`` is then the real port)."""
        if self._sock is not None:
            self._server = await asyncio.start_server(self._accept, sock=self._sock)
        else:
            self._server = await asyncio.start_server(self._accept, self.listen[0], self.listen[1], reuse_address=True)
        self.port = self._server.sockets[0].getsockname()[1]
        log.info("relay %s:%d -> %s:%d, %.1f ms each way", self.listen[0], self.port, *self.target, self.delay * 1e3)

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _accept(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        self._tasks.add(asyncio.current_task())
        try:
            try:
                t_reader, t_writer = await asyncio.open_connection(*self.target)
            except OSError as e:
                log.warning("relay cannot reach %s:%d: %r", *self.target, e)
                c_writer.close()
                return
            self.stats.connections += 1
            _nodelay(c_writer)
            _nodelay(t_writer)
            up = asyncio.ensure_future(self._pipe(c_reader, t_writer, "bytes_to_target"))
            down = asyncio.ensure_future(self._pipe(t_reader, c_writer, "bytes_to_client"))
            try:
                done, pending = await asyncio.wait({up, down}, return_when=asyncio.FIRST_EXCEPTION)
                if any(t.exception() for t in done):  # a reset on one side ends the other too
                    for t in pending:
                        t.cancel()
                await asyncio.gather(up, down, return_exceptions=True)
            finally:
                up.cancel()
                down.cancel()
                for w in (c_writer, t_writer):
                    w.close()
        finally:
            self._tasks.discard(asyncio.current_task())

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, counter: str) -> None:
        """Read chunks as they come, write each one ``delay`` seconds after it was read (EOF too)."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue(maxsize=MAX_QUEUED_CHUNKS)

        async def pump_in() -> None:
            while True:
                data = await reader.read(CHUNK)
                await queue.put((loop.time() + self.delay, data))
                if not data:
                    return

        feeder = asyncio.ensure_future(pump_in())
        try:
            while True:
                due, data = await queue.get()
                wait = due - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                if not data:
                    if writer.can_write_eof():
                        writer.write_eof()
                    return
                setattr(self.stats, counter, getattr(self.stats, counter) + len(data))  # counted once handed on
                writer.write(data)
                await writer.drain()
        finally:
            feeder.cancel()
            await asyncio.gather(feeder, return_exceptions=True)

    # -- on a background thread (tests) ----------------------------------------------------------

    def start(self, start_timeout: float = 10.0) -> "DelayRelay":
        """Run on a daemon thread with its own event loop; returns once the port is bound."""
        ready = threading.Event()
        failure: list[BaseException] = []

        def main() -> None:
            self._loop = asyncio.new_event_loop()
            try:
                self._loop.run_until_complete(self.serve())
            except BaseException as e:  # reported to start()
                failure.append(e)
                ready.set()
                return
            ready.set()
            self._loop.run_forever()
            self._loop.run_until_complete(self.aclose())
            self._loop.close()

        self._thread = threading.Thread(target=main, name="delay-relay", daemon=True)
        self._thread.start()
        if not ready.wait(start_timeout):
            raise TimeoutError(f"relay did not bind within {start_timeout:.0f}s")
        if failure:
            raise failure[0]
        return self

    def stop(self, stop_timeout: float = 10.0) -> None:
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(stop_timeout)

    def __enter__(self) -> "DelayRelay":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _addr(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


async def _run(maps: list[str], delay: float, stats_path: Optional[Path]) -> None:
    relays = [DelayRelay(_addr(m.split("=")[0]), _addr(m.split("=")[1]), delay) for m in maps]
    for r in relays:
        await r.serve()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        loop.add_signal_handler(sig, stop.set)

    def dump() -> None:
        if stats_path is None:
            return
        atomic_write_text(stats_path, strict_json.dumps({f"{r.listen[0]}:{r.port}": vars(r.stats) for r in relays}),
                          temp_name=stats_path.with_suffix(".tmp").name)

    dump()  # its existence tells the caller that every port is bound
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), 1.0)
        except asyncio.TimeoutError:
            pass
        dump()
    for r in relays:
        await r.aclose()
    dump()


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.delay_relay", description=__doc__.split("\n")[0])
    parser.add_argument("--map", action="append", required=True, help="LISTEN_HOST:PORT=TARGET_HOST:PORT (repeatable)")
    parser.add_argument("--delay-ms", type=float, default=20.0, help="one-way delay added in each direction")
    parser.add_argument("--stats", type=Path, default=None, help="JSON file of forwarded bytes, rewritten every second")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    t0 = time.monotonic()
    asyncio.run(_run(args.map, args.delay_ms / 1e3, args.stats))
    log.info("relay stopped after %.0fs", time.monotonic() - t0)


if __name__ == "__main__":
    main()
