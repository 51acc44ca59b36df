"""The coordinator's wire against a real ``hivepath coordinator serve`` process: raw frames that are
not messages get INVALID_ARGUMENT ("malformed request") on every method of every service it hosts,
with no state change and at most one log line per method per minute; and a second coordinator on a
busy port exits 2 with one line instead of sharing the port.

The frames are generated from the service descriptors, so a method added to a ``.proto`` is fuzzed
without touching this file. Each frame is classified by protobuf itself (``FromString``), so the
test cannot pass on a frame that happens to be a valid message:

- malformed (DecodeError): a length past the end, an overlong or unterminated varint, invalid UTF-8
  in each string field, an end-group tag without its start, wire type 7, field number 0, an unclosed
  group, groups nested past protobuf's depth limit, a valid message cut short by one byte, seeded
  random bytes that do not parse: INVALID_ARGUMENT with exactly "malformed request";
- well-formed: an empty frame, an unknown field, a known field with the wrong wire type (protobuf
  keeps both as unknown fields), seeded random bytes that happen to parse: the servicer judges them,
  so the answer is the one the same message gets without its unknown fields (the servicer's own
  status and message, e.g. UNAUTHENTICATED "token: missing"), never UNKNOWN or INTERNAL.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from typing import Iterator

import grpc
import pytest
from google.protobuf.descriptor import MethodDescriptor
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator.wire import MALFORMED
from models.log_limit import LogLimiter
from peer.localnet import ProcessGroup, free_port, hivepath_cmd, wait_for
from helpers.protowire import canonical, frames, parses
from peer.coordinator_client import CoordinatorClient, PeerInfo
from protos import coordinator_pb2 as pb

TOKEN = "wire-test-token"
RUN_TOML = """
preset = "tiny"
[coordinator]
lease_timeout = 300.0
heartbeat_interval = 5.0
flush_interval = 0.2
tick_interval = 0.2
"""
SERVICES = [*pb.DESCRIPTOR.services_by_name.values(), *health_pb2.DESCRIPTOR.services_by_name.values()]
METHODS = [m for s in SERVICES for m in s.methods]
CALL_TIMEOUT = 10.0


# -- calls ------------------------------------------------------------------------------------------


def path(m: MethodDescriptor) -> str:
    return f"/{m.containing_service.full_name}/{m.name}"


def call(channel: grpc.Channel, m: MethodDescriptor, frame: bytes) -> tuple[str, str]:
    """``(status code, details)`` of one call carrying ``frame`` as raw bytes (no stub); a stream that
    answers is cancelled after its first message and reads ``("OK", "")``."""
    try:
        if not m.server_streaming:
            if m.client_streaming:
                channel.stream_unary(path(m))(iter([frame]), timeout=CALL_TIMEOUT)
            else:
                channel.unary_unary(path(m))(frame, timeout=CALL_TIMEOUT)
            return "OK", ""
        if m.client_streaming:
            responses = channel.stream_stream(path(m))(iter([frame]), timeout=CALL_TIMEOUT)
        else:
            responses = channel.unary_stream(path(m))(frame, timeout=CALL_TIMEOUT)
        next(responses, None)
        responses.cancel()
        return "OK", ""
    except grpc.RpcError as e:
        return e.code().name, e.details() or ""


# -- the coordinator process ------------------------------------------------------------------------


@dataclass
class Coordinator:
    procs: ProcessGroup
    port: int
    http_port: int
    channel: grpc.Channel

    def log(self) -> str:
        return self.procs.log("coord")

    def http(self, route: str) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}{route}", timeout=10) as r:
            return r.read().decode()

    def state(self) -> dict:
        """``/status.json`` less what moves by itself (clock-derived ages, the ticker's last rebalancing
        reason, the planning pass's last findings) or counts calls (counters)."""
        s = json.loads(self.http("/status.json"))
        s.pop("uptime_s"), s.pop("counters"), s.pop("rebalance"), s.pop("slow_links")
        for m in s["modules"]:
            m.pop("plan_reason")
        for p in s["peers"]:
            p.pop("last_seen_age_s"), p.pop("lease_remaining_s")
        for c in s["contributions"]:
            c.pop("last_seen_age_s")
        for p in s["paths"]:
            p.pop("val_bpb_age_s")
        return s

    def malformed_counter(self) -> float:
        match = re.search(r"^hivepath_coordinator_malformed_requests_total (\S+)$", self.http("/metrics"), re.M)
        assert match, "the counter is on /metrics"
        return float(match.group(1))


def serving(port: int) -> bool:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1)
        return reply.status == health_pb2.HealthCheckResponse.SERVING


def serve_cmd(tmp, port: int, http_port: int, db: str = "state.db") -> list[str]:
    return hivepath_cmd("coordinator", "serve", "--run-config", str(tmp / "run.toml"), "--db", str(tmp / db),
                        "--host", "127.0.0.1", "--port", str(port), "--http-port", str(http_port))


@pytest.fixture(scope="module")
def coordinator(tmp_path_factory) -> Iterator[Coordinator]:
    tmp = tmp_path_factory.mktemp("wire")
    (tmp / "run.toml").write_text(RUN_TOML)
    procs = ProcessGroup(tmp / "logs")
    port, http_port = free_port(), free_port()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        procs.start("coord", serve_cmd(tmp, port, http_port), env={"HIVEPATH_TOKEN": TOKEN})
        wait_for(lambda: serving(port), 60, "the coordinator serving", interval=0.1)
        yield Coordinator(procs, port, http_port, channel)
    finally:
        channel.close()
        procs.close()


def client(c: Coordinator, i: int) -> CoordinatorClient:
    info = PeerInfo(f"12D3KooWwire{'abcdefgh'[i]}xxxxxxx", "cpu", 8 << 30, 1000.0, public_key=b"k%d" % i)
    return CoordinatorClient(f"127.0.0.1:{c.port}", TOKEN, info, retry_timeout=30.0, seed=i)


# -- tests ------------------------------------------------------------------------------------------


def test_raw_frames_to_every_method_are_refused_cleanly_without_state_change(coordinator):
    c = coordinator
    first = client(c, 0)
    try:
        first.join()
        before, counted_before, log_before = c.state(), c.malformed_counter(), len(c.log().splitlines())
        started = time.monotonic()
        refused: dict[str, int] = {}
        for m in METHODS:
            d = m.input_type
            for name, frame in frames(d, path(m)).items():
                got = call(c.channel, m, frame)
                if not parses(d, frame):
                    assert got == ("INVALID_ARGUMENT", MALFORMED), (path(m), name, frame, got)
                    refused[path(m)] = refused.get(path(m), 0) + 1
                    continue
                assert got[0] not in ("UNKNOWN", "INTERNAL") and got[1] != MALFORMED, (path(m), name, got)
                assert got == call(c.channel, m, canonical(d, frame)), (path(m), name, "unknown fields are ignored")
        elapsed = time.monotonic() - started

        assert set(refused) == {path(m) for m in METHODS}, "every method got malformed frames"
        assert c.malformed_counter() - counted_before == sum(refused.values())
        assert c.state() == before, "malformed and default requests changed nothing"
        log = c.log()
        assert "Traceback" not in log and " ERROR " not in log, log[-3000:]
        fuzz_lines = log.splitlines()[log_before:]
        per_minute = 1 + int(elapsed // 60)
        for m in METHODS:
            lines = [line for line in fuzz_lines if f"malformed request to {path(m)} " in line]
            assert 1 <= len(lines) <= per_minute, (path(m), lines)
        assert len(fuzz_lines) <= len(METHODS) * per_minute, fuzz_lines

        # a normal client is still served, and the servicer still names the field it refuses
        second = client(c, 1)
        try:
            assert second.join().lease_id
            assert second.heartbeat().lease_remaining > 0
            assert {p["peer_id"] for p in second.status()["peers"]} == {first.peer.peer_id, second.peer.peer_id}
        finally:
            second.close()
        heartbeat = next(m for m in METHODS if m.name == "Heartbeat")
        code, details = call(c.channel, heartbeat, pb.HeartbeatRequest(lease_id="zz").SerializeToString())
        assert code == "INVALID_ARGUMENT" and details.startswith("lease_id:"), details
    finally:
        first.close()


def test_a_malformed_frame_mid_stream_ends_the_stream_after_the_valid_ones(coordinator):
    c = coordinator
    peer = client(c, 2)
    try:
        joined = peer.join()
        valid = pb.HeartbeatStreamRequest(
            heartbeat=pb.HeartbeatRequest(lease_id=joined.lease_id, peer_id=peer.peer.peer_id)).SerializeToString()
        stream = c.channel.stream_stream(f"/{pb.DESCRIPTOR.services_by_name['Coordinator'].full_name}/HeartbeatStream")
        replies = []
        with pytest.raises(grpc.RpcError) as e:
            for raw in stream(iter([valid, b"\xff\xff\xff"]), timeout=CALL_TIMEOUT):
                replies.append(pb.HeartbeatStreamResponse.FromString(raw))
        assert (e.value.code(), e.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, MALFORMED)
        assert len(replies) == 1 and replies[0].heartbeat.lease_remaining_s > 0
        assert peer.heartbeat().lease_remaining > 0, "the lease is intact"
    finally:
        peer.close()


@pytest.mark.parametrize("busy", ["port", "http-port"])
def test_a_second_coordinator_on_a_busy_port_exits_2_with_one_line(coordinator, tmp_path, busy):
    c = coordinator
    (tmp_path / "run.toml").write_text(RUN_TOML)
    port, http_port = (c.port, free_port()) if busy == "port" else (free_port(), c.http_port)
    out = subprocess.run(serve_cmd(tmp_path, port, http_port), capture_output=True, text=True, timeout=60,
                         env={**os.environ, "HIVEPATH_TOKEN": TOKEN})
    taken = c.port if busy == "port" else c.http_port
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2, out.stderr
    assert len(lines) == 1 and lines[0].startswith(f"hivepath: error: --{busy} {taken}: ") and "in use" in lines[0], \
        out.stderr
    assert serving(c.port), "the first coordinator keeps serving"
    assert c.http("/healthz") == "ok\n"


def test_log_limiter_admits_one_line_per_key_per_interval_and_counts_the_rest():
    now = [0.0]
    limiter = LogLimiter(60.0, clock=lambda: now[0])
    assert limiter.admit("a") == 0
    assert limiter.admit("a") is None and limiter.admit("a") is None
    assert limiter.admit("b") == 0, "keys are limited apart"
    now[0] = 59.9
    assert limiter.admit("a") is None
    now[0] = 60.0
    assert limiter.admit("a") == 3, "the next line says how many were held back"
    assert limiter.admit("a") is None
