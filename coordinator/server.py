"""Running the coordinator: gRPC (grpc.aio on uvloop) with the health service, the HTTP status
server, the lease/rebalance ticker, the group-commit flusher and the history sampler, shut down
cleanly on SIGTERM/SIGINT.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import signal
import socket
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from coordinator.committer import GroupCommitter
from coordinator.core import Coordinator
from coordinator.credentials import CredentialIssuer, default_key_path, load_or_create_key
from coordinator.servicer import CoordinatorServicer
from coordinator.settings import CoordinatorSettings
from coordinator.status import snapshot
from coordinator.sqlite_store import open_store
from coordinator.web import StatusServer
from coordinator.wire import MalformedFrameGuard
from models.config import RunConfig
from models.errors import HivepathError
from protos.hivepath.coordinator.v1 import coordinator_pb2 as pb
from protos.hivepath.coordinator.v1 import coordinator_pb2_grpc as pb_grpc
from protos import transport

__all__ = ["ServeOptions", "serve", "run_server", "BackgroundServer", "SERVICE_NAME"]

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Coordinator"].full_name
MAX_MESSAGE_BYTES = transport.MAX_REQUEST_BYTES
KEEPALIVE_MIN_INTERVAL_MS = transport.MIN_PING_INTERVAL_MS
"""Peers may ping this often (they ping every 10 s to notice dead links); pings more frequent than
this are answered with GOAWAY, as gRPC does by default for anything under 5 minutes."""


@dataclass(frozen=True)
class ServeOptions:
    """Where and how ``hivepath coordinator serve`` listens."""

    db: str
    """SQLite state file (``:memory:`` keeps state in memory only)."""
    port: int
    """gRPC port (0: any free port)."""
    http_port: int
    """Status page, JSON and metrics port (0: any free port)."""
    token: str
    """The run token peers present at join."""
    host: str = "0.0.0.0"
    tls_cert: Optional[str] = None
    """PEM certificate chain; with ``tls_key`` the gRPC port speaks TLS."""
    tls_key: Optional[str] = None
    key: Optional[str] = None
    """Ed25519 key file that signs credentials (default ``<db>.key``; created on first start)."""


def _cannot_listen(flag: str, host: str, port: int, why: str) -> HivepathError:
    """The one line a port we cannot listen on gets: the flag, the address, why, and the fix."""
    return HivepathError(f"--{flag} {port}: cannot listen on {host}:{port} ({why}); pass a free --{flag}")


def _check_free(flag: str, host: str, port: int) -> None:
    """Raise :class:`HivepathError` naming ``--flag`` when ``host:port`` cannot be bound now.

    gRPC reports a failed bind with a RuntimeError and a C-level log line of its own; trying a plain
    socket first (SO_REUSEADDR, as gRPC binds, so a port in TIME_WAIT still counts as free) gives the
    operator one line instead. The check races with other processes; the bind itself stays checked.
    """
    if port == 0:
        return
    try:
        addresses = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise _cannot_listen(flag, host, port, f"cannot resolve {host}: {e.strerror}") from None
    for family, kind, proto, _, sockaddr in addresses:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(sockaddr)
            except OSError as e:
                why = "in use: another coordinator?" if e.errno == errno.EADDRINUSE else e.strerror or str(e)
                raise _cannot_listen(flag, host, port, why) from None


class _Health(health_aio.HealthServicer):
    """grpc's asyncio health service, whose ``List`` raises NotImplementedError (a traceback in the
    log per call, from anyone): answered UNIMPLEMENTED here instead."""

    async def List(self, request: health_pb2.HealthListRequest,  # noqa: N802 (the RPC's name)
                   context: grpc.aio.ServicerContext) -> health_pb2.HealthListResponse:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Health.List is not served; use Check or Watch")


def _credentials(opts: ServeOptions) -> Optional[grpc.ServerCredentials]:
    if not opts.tls_cert and not opts.tls_key:
        return None
    if not (opts.tls_cert and opts.tls_key):
        raise HivepathError("--tls-cert and --tls-key go together; pass both or neither")
    try:
        cert = Path(opts.tls_cert).read_bytes()
        key = Path(opts.tls_key).read_bytes()
    except OSError as e:
        raise HivepathError(f"cannot read the TLS certificate or key: {e}") from None
    return grpc.ssl_server_credentials([(key, cert)])


async def serve(run: RunConfig, settings: CoordinatorSettings, opts: ServeOptions,
                stop: Optional[asyncio.Event] = None,
                on_ready: Optional[Callable[[Coordinator, int, int], None]] = None) -> None:
    """Serve until ``stop`` is set (or SIGTERM/SIGINT); state is flushed before returning.
    ``on_ready(coordinator, grpc_port, http_port)`` is called once both ports listen."""
    loop = asyncio.get_running_loop()
    stop = stop or asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread (tests)
            pass
    _check_free("port", opts.host, opts.port)  # before the key and the store: a refused start leaves nothing
    _check_free("http-port", opts.host, opts.http_port)
    creds = _credentials(opts)  # a TLS pair that is not one is refused before the key is created
    key = load_or_create_key(opts.key or default_key_path(opts.db))
    issuer = CredentialIssuer(key, run.run_id, settings.credential_timeout)
    store = open_store(opts.db, settings.sqlite_synchronous)
    committer = GroupCommitter(store)
    executor = ThreadPoolExecutor(max_workers=8, thread_name_prefix="coordinator")
    http: Optional[StatusServer] = None
    server: Optional[grpc.aio.Server] = None
    try:
        coord = Coordinator(run, settings, store, durable=committer.commit, issuer=issuer)
        guard = MalformedFrameGuard(on_malformed=lambda method: coord.count("malformed_requests"))
        server = grpc.aio.server(interceptors=[guard], options=[
            # gRPC sets SO_REUSEPORT by default: a second coordinator on a busy port would share it
            # and split the peers between the two; refuse to bind instead
            ("grpc.so_reuseport", 0),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", transport.MAX_REPLY_BYTES),
            # peers ping every 10 s (peer.coordinator_client.transport.KEEPALIVE_OPTIONS) to notice a dead link
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_MIN_INTERVAL_MS),
            ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_MIN_INTERVAL_MS),
            ("grpc.http2.max_ping_strikes", 0),
        ])
        pb_grpc.add_CoordinatorServicer_to_server(CoordinatorServicer(coord, opts.token, executor), server)
        health = _Health()
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
        address = f"{opts.host}:{opts.port}"
        try:
            port = server.add_secure_port(address, creds) if creds else server.add_insecure_port(address)
        except RuntimeError:  # taken since the check above
            raise _cannot_listen("port", opts.host, opts.port, "gRPC could not bind it") from None
        try:
            http = StatusServer(lambda max_peers: snapshot(coord, max_peers), opts.host, opts.http_port,
                                get_history=coord.history_series).start()
        except OSError as e:
            raise _cannot_listen("http-port", opts.host, opts.http_port, e.strerror or str(e)) from None
        await server.start()
        for name in ("", SERVICE_NAME):
            await health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("coordinator for run %s (config %s, key %s) serving gRPC%s on port %d, status on http://%s:%d/",
                 run.run_id, coord.run_hash, issuer.fingerprint, " with TLS" if creds else "", port, opts.host,
                 http.port)
        if on_ready is not None:
            on_ready(coord, port, http.port)

        async def every(interval: float, fn) -> None:
            while not stop.is_set():
                try:
                    await asyncio.wait_for(stop.wait(), timeout=interval)
                except asyncio.TimeoutError:
                    pass
                try:
                    await fn()
                except Exception:
                    log.exception("background task failed")

        async def tick() -> None:
            await loop.run_in_executor(executor, coord.tick)

        async def flush() -> None:
            await loop.run_in_executor(executor, lambda: committer.submit(coord.take_dirty()))

        async def sample() -> None:
            await loop.run_in_executor(executor, lambda: committer.submit(coord.sample_history()))

        tasks = [asyncio.create_task(every(settings.tick_interval, tick)),
                 asyncio.create_task(every(settings.flush_interval, flush)),
                 asyncio.create_task(every(settings.history_interval, sample))]
        await stop.wait()
        log.info("shutting down")
        for name in ("", SERVICE_NAME):
            await health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        await server.stop(grace=2.0)
        server = None
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        committer.submit(coord.take_dirty())
    finally:
        if server is not None:
            await server.stop(grace=None)
        if http is not None:
            http.stop()
        executor.shutdown(wait=True)
        committer.close()
        store.close()


def run_server(run: RunConfig, settings: CoordinatorSettings, opts: ServeOptions) -> int:
    """Run :func:`serve` on uvloop (asyncio's loop where uvloop is missing); returns an exit code."""
    try:
        import uvloop

        factory = uvloop.new_event_loop
    except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
        factory = None
    if sys.version_info >= (3, 11):
        with asyncio.Runner(loop_factory=factory) as runner:
            runner.run(serve(run, settings, opts))
    else:  # pragma: no cover - Python 3.10
        if factory is not None:
            asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
        asyncio.run(serve(run, settings, opts))
    return 0


class BackgroundServer:
    """The coordinator serving from a thread of this process (tests, benchmarks, embedding).

    ``with BackgroundServer(run, settings, opts) as srv:`` gives ``srv.port``, ``srv.http_port`` and
    ``srv.coordinator`` once both ports listen; leaving the block shuts it down and flushes state.
    """

    def __init__(self, run: RunConfig, settings: CoordinatorSettings, opts: ServeOptions,
                 start_timeout: float = 30.0):
        import threading

        self._args = (run, settings, opts)
        self._ready = threading.Event()
        self._error: Optional[BaseException] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._stop: Optional[asyncio.Event] = None
        self.coordinator: Optional[Coordinator] = None
        self.port = self.http_port = 0
        self._thread = threading.Thread(target=self._main, name="coordinator-server", daemon=True)
        self._thread.start()
        if not self._ready.wait(start_timeout):
            raise TimeoutError(f"the coordinator did not start within {start_timeout:.0f}s")
        if self._error is not None:
            raise self._error

    def _main(self) -> None:
        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()

            def ready(coord: Coordinator, port: int, http_port: int) -> None:
                self.coordinator, self.port, self.http_port = coord, port, http_port
                self._ready.set()

            await serve(*self._args, stop=self._stop, on_ready=ready)

        try:
            asyncio.run(main())
        except BaseException as e:  # reported to the starting thread
            self._error = e
            self._ready.set()

    def close(self, stop_timeout: float = 30.0) -> None:
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(stop_timeout)

    def __enter__(self) -> "BackgroundServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
