"""A peer's local status endpoint: what it is doing and whether it is stuck, on 127.0.0.1 only.

``hivepath peer join`` and ``hivepath archive`` serve two paths over plain HTTP (stdlib
``http.server`` in a daemon thread; loopback only, so nothing outside the machine or container
reaches it):

- ``GET /status``: the peer's :class:`peer.node.progress.PeerStatus` as JSON plus its role, the seconds
  since its last progress, since its main loop last turned, since the coordinator last answered a
  heartbeat, and the health verdict (``healthy``, ``reason``).
- ``GET /healthz``: 200 with the reason when healthy, 503 with the reason when not. The container
  images' ``HEALTHCHECK`` and the Kubernetes probes ask this (``deploy/healthcheck.py``).

Healthy means the process is not stuck (:func:`evaluate_health`): it is in a waiting state
(starting, joining, loading state, draining), or its main loop made progress within
``stall_timeout`` seconds. A coordinator that does not answer does not make a peer unhealthy: the
peer keeps training and averaging without it (the age of the last heartbeat is shown instead).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Optional

from models import strict_json
from models.errors import HivepathError
from peer.node.progress import WAITING_STATES, PeerStatus
from peer.settings import default
from protos import versions

__all__ = ["LocalStatusServer", "StatusPortUnavailable", "evaluate_health", "status_document", "start_optional",
           "DEFAULT_STATUS_PORT", "DEFAULT_STALL_TIMEOUT"]

log = logging.getLogger(__name__)

DEFAULT_STATUS_PORT: int = default("HIVEPATH_STATUS_PORT")
DEFAULT_STALL_TIMEOUT: float = default("HIVEPATH_STALL_TIMEOUT")
"""Generous on purpose: one outer round (inner steps plus the exchange) can take minutes."""


class StatusPortUnavailable(HivepathError):
    """The local status port cannot be bound (in use, or not allowed)."""


def _age(since: Optional[float], now: float) -> Optional[float]:
    return None if since is None else round(max(0.0, now - since), 3)


def evaluate_health(status: PeerStatus, now: float, stall_timeout: float) -> tuple[bool, str]:
    """``(healthy, reason)`` of a peer at monotonic time ``now``.

    A waiting state (:data:`peer.node.progress.WAITING_STATES`) is healthy. Otherwise the peer is healthy
    while the newest of its last progress (an inner step, an outer round, work served), its main
    loop's last turn and its entering the current state is at most ``stall_timeout`` seconds old.
    """
    if status.state in WAITING_STATES:
        return True, f"{status.state} for {now - status.state_at:.0f}s (a waiting state)"
    last = max(status.progress_at, status.loop_at, status.state_at)
    quiet = now - last
    if quiet > stall_timeout:
        return False, (f"stuck: {status.state} with no progress for {quiet:.0f}s (more than the "
                       f"{stall_timeout:.0f}s stall timeout; last step {status.step}, round {status.round_no})")
    return True, (f"{status.state}: last progress {now - status.progress_at:.0f}s ago (step {status.step}, "
                  f"round {status.round_no}), main loop turned {now - status.loop_at:.0f}s ago")


def status_document(status: PeerStatus, role: str, now: float, stall_timeout: float,
                    started_at: Optional[float] = None) -> dict[str, Any]:
    """The JSON body of ``GET /status``."""
    healthy, reason = evaluate_health(status, now, stall_timeout)
    doc = status.snapshot()
    doc.update(
        role=role,
        pid=os.getpid(),
        healthy=healthy,
        reason=reason,
        stall_timeout=stall_timeout,
        seconds_since_progress=_age(status.progress_at, now),
        seconds_since_loop=_age(status.loop_at, now),
        seconds_in_state=_age(status.state_at, now),
        seconds_since_heartbeat=_age(status.heartbeat_at, now),
        uptime_s=_age(started_at, now),
        version=versions.RELEASE,
        commit=versions.commit(),
        protocols=versions.stated_all(),
        unknown_fields=versions.UNKNOWN_FIELDS.snapshot(),
    )
    return doc


class _Handler(BaseHTTPRequestHandler):
    server: "_Server"

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        path = self.path.split("?", 1)[0].rstrip("/") or "/"
        if path == "/status":
            doc = self.server.document()
            self._send(200, strict_json.dumps(doc, sort_keys=True) + "\n", "application/json")
        elif path == "/healthz":
            doc = self.server.document()
            self._send(200 if doc["healthy"] else 503, doc["reason"] + "\n", "text/plain; charset=utf-8")
        else:
            self._send(404, f"no such path {path}: try /status or /healthz\n", "text/plain; charset=utf-8")

    def _send(self, code: int, body: str, content_type: str) -> None:
        data = body.encode()
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, fmt: str, *args: Any) -> None:
        log.debug("status request: " + fmt, *args)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    document: Callable[[], dict[str, Any]]


class LocalStatusServer:
    """Serves ``/status`` and ``/healthz`` of ``status`` on ``host:port`` from a daemon thread.

    ``port=0`` binds an ephemeral port (tests); the command line treats ``--status-port 0`` as "do
    not serve" and never builds one. ``clock`` is injectable for tests (monotonic seconds).
    """

    def __init__(self, status: PeerStatus, role: str, port: int = DEFAULT_STATUS_PORT, host: str = "127.0.0.1",
                 stall_timeout: float = DEFAULT_STALL_TIMEOUT, clock: Callable[[], float] = time.monotonic):
        if stall_timeout <= 0:
            raise HivepathError(f"--stall-timeout must be > 0 seconds, got {stall_timeout}")
        self.status = status
        self.role = role
        self.host = host
        self.port = port
        self.stall_timeout = stall_timeout
        self.clock = clock
        self.started_at = clock()
        self._server: Optional[_Server] = None
        self._thread: Optional[threading.Thread] = None

    def document(self) -> dict[str, Any]:
        return status_document(self.status, self.role, self.clock(), self.stall_timeout, self.started_at)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> "LocalStatusServer":
        """Bind and serve; raise :class:`StatusPortUnavailable` naming the fix when the port is taken."""
        try:
            server = _Server((self.host, self.port), _Handler)
        except OSError as e:
            raise StatusPortUnavailable(f"cannot serve the local status on {self.host}:{self.port} ({e.strerror or e}): "
                                "pass another --status-port (env HIVEPATH_STATUS_PORT), or 0 to turn it off") from None
        server.document = self.document
        self._server = server
        self.port = server.server_address[1]
        self._thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1},
                                        name="local-status", daemon=True)
        self._thread.start()
        log.info("local status on %s/status (health: /healthz)", self.url)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None

    def __enter__(self) -> "LocalStatusServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_optional(status: PeerStatus, role: str, port: int, stall_timeout: float,
                   search: int = 0) -> Optional[LocalStatusServer]:
    """The server of ``hivepath peer join``/``archive``: None when ``port`` is 0 (turned off) or taken.

    ``search``: when ``port`` is taken, try the next ``search`` ports too (the peer asks for this on
    the default port: several peers on one host each get one, and say which). A port still taken is
    logged and the peer goes on without a status page: training matters more than its status page.
    """
    if not port:
        return None
    first_error = None
    for candidate in range(port, min(65535, port + search) + 1):
        server = LocalStatusServer(status, role, port=candidate, stall_timeout=stall_timeout)
        try:
            server.start()
        except StatusPortUnavailable as e:
            first_error = first_error or e
            continue
        if candidate != port:
            log.info("port %d is taken (another peer on this machine?): this %s's status is on port %d; "
                     "read it with 'hivepath peer status --port %d'", port, role, candidate, candidate)
        return server
    log.warning("%s; going on without it", first_error)
    return None
