"""bench.delay_relay really delays each direction and passes bytes intact (loopback only)."""

from __future__ import annotations

import hashlib
import json
import random
import signal
import socket
import sys
import threading
import time

import pytest
from peer.localnet import free_port, wait_for

from bench.delay_relay import DelayRelay

DELAY = 0.05


class EchoServer:
    """A loopback TCP server echoing everything back, one thread per connection."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._echo, args=(conn,), daemon=True).start()

    @staticmethod
    def _echo(conn: socket.socket) -> None:
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while data := conn.recv(65536):
                conn.sendall(data)

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def relay():
    echo = EchoServer()
    r = DelayRelay(("127.0.0.1", 0), ("127.0.0.1", echo.port), DELAY).start()
    yield r
    r.stop()
    echo.close()


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(65536, n - len(buf)))
        assert chunk, "connection closed early"
        buf += chunk
    return bytes(buf)


def test_round_trip_gains_twice_the_delay(relay):
    with socket.create_connection(("127.0.0.1", relay.port), timeout=10) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        rtts = []
        for i in range(5):
            t0 = time.perf_counter()
            s.sendall(bytes([i]) * 10)
            assert _recv_exactly(s, 10) == bytes([i]) * 10
            rtts.append(time.perf_counter() - t0)
    assert min(rtts) >= 2 * DELAY, rtts  # held DELAY on the way in and DELAY on the way back


def test_bytes_pass_intact_in_both_directions_and_are_counted(relay):
    payload = random.Random(0).randbytes(3 * 2**20 + 12345)
    got = bytearray()

    with socket.create_connection(("127.0.0.1", relay.port), timeout=30) as s:
        def reader() -> None:
            while len(got) < len(payload):
                chunk = s.recv(65536)
                if not chunk:
                    return
                got.extend(chunk)

        t = threading.Thread(target=reader)
        t.start()
        s.sendall(payload)
        t.join(30)
    assert hashlib.sha256(got).hexdigest() == hashlib.sha256(payload).hexdigest()
    assert relay.stats.connections == 1
    assert relay.stats.bytes_to_target == len(payload)
    assert relay.stats.bytes_to_client == len(payload)


def test_half_close_is_forwarded_after_the_delay(relay):
    with socket.create_connection(("127.0.0.1", relay.port), timeout=10) as s:
        s.sendall(b"last words")
        s.shutdown(socket.SHUT_WR)
        t0 = time.perf_counter()
        data = b""
        while chunk := s.recv(65536):
            data += chunk
        assert data == b"last words"  # echoed, then the server saw our EOF and closed its side
        assert time.perf_counter() - t0 >= DELAY


def test_negative_delay_is_refused():
    with pytest.raises(ValueError, match="delay"):
        DelayRelay(("127.0.0.1", 0), ("127.0.0.1", 1), -0.1)


def test_relay_process_delays_and_reports_forwarded_bytes(procs, tmp_path):
    """The command the benchmark starts in each namespace: bound when its stats file appears, counts
    on SIGTERM."""
    echo = EchoServer()
    port, stats = free_port(), tmp_path / "relay.json"
    procs.start("relay", [sys.executable, "-m", "bench.delay_relay", "--delay-ms", "40",
                          "--map", f"127.0.0.1:{port}=127.0.0.1:{echo.port}", "--stats", str(stats)])
    wait_for(stats.exists, 60, "the relay's stats file")
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        t0 = time.perf_counter()
        s.sendall(b"x" * 1000)
        assert _recv_exactly(s, 1000) == b"x" * 1000
        assert time.perf_counter() - t0 >= 0.08
    procs.signal("relay", signal.SIGTERM)
    assert procs.procs["relay"].wait(timeout=30) == 0
    (counts,) = json.loads(stats.read_text()).values()
    assert counts == {"connections": 1, "bytes_to_target": 1000, "bytes_to_client": 1000}
    echo.close()
