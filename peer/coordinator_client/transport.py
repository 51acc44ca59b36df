"""The peer's transport to the coordinator below the RPC semantics: gRPC keepalive, the long-lived
heartbeat stream, the bandwidth probes, and :func:`what_answers` at an address that gRPC cannot reach
(:class:`peer.coordinator_client.CoordinatorClient` uses them; nothing here retries or interprets a
refusal)."""

from __future__ import annotations

import ipaddress
import math
import queue
import socket
import ssl
import threading
import time
from typing import Iterator, NamedTuple

import grpc

from protos.hivepath.coordinator.v1 import coordinator_pb2 as pb
from protos.hivepath.coordinator.v1 import coordinator_pb2_grpc as pb_grpc
from protos.transport import PING_INTERVAL_MS, PING_TIMEOUT_MS

__all__ = ["KEEPALIVE_OPTIONS", "PROBE_BYTES", "PROBE_CHUNK", "HeartbeatStream", "StreamStalled", "ProbeFailed",
           "probe_upload", "probe_download", "Answer", "what_answers", "NOTHING", "TLS", "HTTP1", "HTTP2", "OTHER"]

KEEPALIVE_OPTIONS = [
    ("grpc.keepalive_time_ms", PING_INTERVAL_MS),
    ("grpc.keepalive_timeout_ms", PING_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
"""HTTP/2 pings (:mod:`protos.transport`: every 10 s, answered within 5 s): a link that silently drops packets (a partition, a
moved container) is noticed and the channel reconnects, instead of every call riding a dead TCP
connection until the kernel gives up on it (many minutes). The coordinator permits pings this often."""

PROBE_BYTES = 2 << 20
"""Default bandwidth probe size per direction (the coordinator accepts up to 8 MiB)."""
PROBE_CHUNK = 256 << 10


class StreamStalled(Exception):
    """The heartbeat stream ended or gave no reply in time: send the heartbeat as a unary call."""


class ProbeFailed(Exception):
    """A bandwidth probe moved another number of bytes than it asked for."""


class HeartbeatStream:
    """One long-lived ``HeartbeatStream`` call: :meth:`exchange` sends a heartbeat and waits for its
    reply (the coordinator answers each in order). A reader thread turns replies and the stream's
    end into queue items, so a stalled coordinator costs ``reply_timeout``, never a hung thread."""

    def __init__(self, stub: pb_grpc.CoordinatorStub):
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._replies: queue.SimpleQueue = queue.SimpleQueue()
        self._call = stub.HeartbeatStream(iter(self._requests.get, None))
        self._reader = threading.Thread(target=self._read, name="coordinator-heartbeat-stream", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        try:
            for reply in self._call:
                self._replies.put(reply)
            self._replies.put(StreamStalled("the coordinator ended the stream"))
        except grpc.RpcError as e:
            self._replies.put(e)

    def exchange(self, request: pb.HeartbeatRequest, reply_timeout: float) -> pb.HeartbeatResponse:
        self._requests.put(pb.HeartbeatStreamRequest(heartbeat=request))
        try:
            item = self._replies.get(timeout=reply_timeout)
        except queue.Empty:
            raise StreamStalled(f"no reply within {reply_timeout:.1f}s") from None
        if isinstance(item, BaseException):
            raise item
        return item.heartbeat

    def close(self) -> None:
        self._requests.put(None)
        self._call.cancel()


def probe_upload(stub: pb_grpc.CoordinatorStub, token: str, probe_bytes: int, probe_timeout: float) -> float:
    """Send ``probe_bytes`` to the coordinator; our upload rate in bytes per second."""
    chunk = b"\0" * min(PROBE_CHUNK, probe_bytes)

    def chunks() -> Iterator[pb.ProbeUploadRequest]:
        yield pb.ProbeUploadRequest(token=token, total_bytes=probe_bytes)
        sent = 0
        while sent < probe_bytes:
            n = min(len(chunk), probe_bytes - sent)
            yield pb.ProbeUploadRequest(payload=chunk[:n])
            sent += n

    t0 = time.perf_counter()
    r = stub.ProbeUpload(chunks(), timeout=probe_timeout)
    elapsed = time.perf_counter() - t0
    if r.received_bytes != probe_bytes:
        raise ProbeFailed(f"the coordinator received {r.received_bytes} of {probe_bytes} probe bytes")
    seconds = r.seconds if math.isfinite(r.seconds) and r.seconds > 0 else elapsed
    return probe_bytes / max(seconds, 1e-6)


def probe_download(stub: pb_grpc.CoordinatorStub, token: str, probe_bytes: int, probe_timeout: float) -> float:
    """Receive ``probe_bytes`` from the coordinator; our download rate in bytes per second."""
    t_start = time.perf_counter()
    t0 = t_last = None
    received = 0
    request = pb.ProbeDownloadRequest(token=token, total_bytes=probe_bytes, chunk_bytes=PROBE_CHUNK)
    for m in stub.ProbeDownload(request, timeout=probe_timeout):
        t_last = time.perf_counter()
        if t0 is None:
            t0 = t_last  # the empty leading message starts the clock
        received += len(m.payload)
    if received != probe_bytes or t0 is None or t_last is None:
        raise ProbeFailed(f"received {received} of {probe_bytes} probe bytes")
    seconds = t_last - t0 if t_last > t0 else t_last - t_start
    return probe_bytes / max(seconds, 1e-6)


# -- what answers at an address -------------------------------------------------------------------

NOTHING, TLS, HTTP1, HTTP2, OTHER = "nothing", "tls", "http1", "http2", "other"
"""Kinds of :class:`Answer`: no connection; a TLS server; an HTTP/1 server; an HTTP/2 server speaking
plain text (gRPC without TLS, as ``coordinator serve`` without ``--tls-cert``); anything else."""

_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
"""What an HTTP/2 client sends first: the connection preface and an empty SETTINGS frame."""


class Answer(NamedTuple):
    kind: str
    """:data:`NOTHING`, :data:`TLS`, :data:`HTTP1`, :data:`HTTP2` or :data:`OTHER`."""
    text: str
    """What answered, in words for an error line ("nothing answers (connection refused)")."""


def what_answers(address: str, timeout: float = 3.0) -> Answer:
    """Who answers at ``HOST:PORT``: one TCP connection, an HTTP/2 preface sent, the first bytes read
    (at most ``timeout`` seconds for each). A TLS server answers the preface with an alert record, an
    HTTP/1 server with a status line, an HTTP/2 server with a SETTINGS frame."""
    host, _, port = address.rpartition(":")
    host = host[1:-1] if host.startswith("[") else host
    try:
        sock = socket.create_connection((host, int(port)), timeout=timeout)
    except socket.gaierror as e:
        return Answer(NOTHING, f"the host name {host!r} does not resolve ({e.strerror})")
    except ConnectionRefusedError:
        return Answer(NOTHING, "nothing answers (connection refused)")
    except (socket.timeout, TimeoutError):
        return Answer(NOTHING, f"nothing answers (no connection within {timeout:.0f}s)")
    except OSError as e:
        return Answer(NOTHING, f"nothing answers ({e.strerror or e})")
    with sock:
        sock.settimeout(timeout)
        try:
            sock.sendall(_H2_PREFACE)
            data = sock.recv(64)
        except (socket.timeout, TimeoutError):
            return Answer(OTHER, f"a server accepts connections there but says nothing within {timeout:.0f}s")
        except OSError:
            data = b""
    if (data[:1] in (b"\x15", b"\x16") and data[1:2] == b"\x03") or (not data and _tls_answers(host, port, timeout)):
        return Answer(TLS, "a TLS server answers")
    if not data:
        return Answer(OTHER, "a server accepts connections there and closes them without a word")
    if data.startswith(b"HTTP/"):
        status = data.split(b"\r\n", 1)[0].decode("ascii", "replace")
        return Answer(HTTP1, f"an HTTP/1 server answers ({status!r})")
    if data.lstrip().startswith(b"<"):  # an HTTP/1 server that answers a version it does not know with a bare page
        return Answer(HTTP1, "an HTTP/1 server answers (a web page)")
    if len(data) >= 9 and data[3] == 0x04:
        return Answer(HTTP2, "an HTTP/2 server answers without TLS")
    return Answer(OTHER, f"a server that speaks neither gRPC nor HTTP answers ({data[:12]!r})")


def _tls_answers(host: str, port: str, timeout: float) -> bool:
    """True when a TLS handshake succeeds at ``host``/``port`` (no certificate check: this only asks
    which protocol answers; some TLS servers close on a plain-text preface without an alert)."""
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    try:
        ipaddress.ip_address(host)
        server_name = None
    except ValueError:
        server_name = host
    try:
        with socket.create_connection((host, int(port)), timeout=timeout) as sock:
            with ctx.wrap_socket(sock, server_hostname=server_name):
                return True
    except (OSError, ssl.SSLError):
        return False
