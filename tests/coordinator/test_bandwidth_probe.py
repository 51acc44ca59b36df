"""Bandwidth measured at join: the peer client probes a real ``hivepath coordinator serve`` process
in both directions; the probe is authenticated, capped, limited in concurrency, and the coordinator
keeps serving heartbeats and probes after every refusal."""

from __future__ import annotations

import json
import logging
import math
import queue
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator.probe import MAX_CONCURRENT_PROBES, MAX_PROBE_BYTES, MAX_PROBE_CHUNK
from peer.localnet import ProcessGroup, free_port, hivepath_cmd, wait_for
from peer.coordinator_client import CoordinatorClient, PeerInfo
from protos import coordinator_pb2 as pb
from protos import coordinator_pb2_grpc as pb_grpc

pytestmark = pytest.mark.integration

TOKEN = "probe-test-token"
RUN_TOML = """
preset = "tiny"
[coordinator]
flush_interval = 0.2
tick_interval = 0.2
"""


def _serving(port: int) -> bool:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1)
        return r.status == health_pb2.HealthCheckResponse.SERVING


@pytest.fixture(scope="module")
def coordinator(tmp_path_factory):
    """``(grpc_port, http_port)`` of one coordinator process shared by this module's tests."""
    tmp = tmp_path_factory.mktemp("probe")
    (tmp / "run.toml").write_text(RUN_TOML)
    port, http_port = free_port(), free_port()
    group = ProcessGroup(tmp / "logs")
    try:
        group.start("coordinator", hivepath_cmd("coordinator", "serve", "--run-config", str(tmp / "run.toml"),
                                                "--db", str(tmp / "state.db"), "--host", "127.0.0.1", "--port",
                                                str(port), "--http-port", str(http_port)),
                    env={"HIVEPATH_TOKEN": TOKEN})
        wait_for(lambda: _serving(port), 60, "coordinator serving", interval=0.2)
        yield port, http_port
    finally:
        group.close()


@pytest.fixture
def stub(coordinator):
    with grpc.insecure_channel(f"127.0.0.1:{coordinator[0]}") as ch:
        yield pb_grpc.CoordinatorStub(ch)


def _upload(stub, token: str, total: int, payload: int | None = None, chunk: int = 64 << 10):
    """One upload probe announcing ``total`` bytes and sending ``payload`` (default: ``total``)."""
    payload = total if payload is None else payload

    def chunks():
        yield pb.ProbeUploadRequest(token=token, total_bytes=total)
        sent = 0
        while sent < payload:
            n = min(chunk, payload - sent)
            yield pb.ProbeUploadRequest(payload=b"\0" * n)
            sent += n

    return stub.ProbeUpload(chunks(), timeout=30)


def _download(stub, token: str, total: int, chunk: int = 0, timeout: float = 30) -> int:
    request = pb.ProbeDownloadRequest(token=token, total_bytes=total, chunk_bytes=chunk)
    return sum(len(m.payload) for m in stub.ProbeDownload(request, timeout=timeout))


def _code(fn, *args) -> grpc.StatusCode:
    try:
        fn(*args)
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def _counters(http_port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/status.json", timeout=10) as r:
        return json.load(r)["counters"]


def test_client_measures_positive_finite_bandwidth(coordinator):
    port, http_port = coordinator
    done0 = _counters(http_port).get("bandwidth_probes", 0)
    client = CoordinatorClient(f"127.0.0.1:{port}", TOKEN)
    try:
        measured = client.measure_bandwidth()
        assert measured is not None
        up, down = measured
        for bps in (up, down):  # bytes per second on loopback: well above 1 MB/s, finite
            assert math.isfinite(bps) and 1e6 < bps < 1e12
        small = client.measure_bandwidth(probe_bytes=100_000, probe_timeout=10.0)
        assert small is not None and all(math.isfinite(b) and b > 0 for b in small)
    finally:
        client.close()
    assert _counters(http_port)["bandwidth_probes"] == done0 + 4  # two probes each way, counted by the server


def test_probes_need_the_run_token(coordinator, stub, caplog):
    for token in ("", "wrong-token"):
        assert _code(_upload, stub, token, 1000) == grpc.StatusCode.UNAUTHENTICATED
        assert _code(_download, stub, token, 1000) == grpc.StatusCode.UNAUTHENTICATED
    client = CoordinatorClient(f"127.0.0.1:{coordinator[0]}", "wrong-token")
    try:
        with caplog.at_level(logging.WARNING, logger="peer.coordinator_client"):
            assert client.measure_bandwidth(probe_bytes=10_000) is None
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "UNAUTHENTICATED" in warnings[0].getMessage()
    finally:
        client.close()


def test_oversized_probes_are_invalid_argument(stub):
    assert _code(_download, stub, TOKEN, MAX_PROBE_BYTES + 1) == grpc.StatusCode.INVALID_ARGUMENT
    assert _code(_download, stub, TOKEN, 1000, MAX_PROBE_CHUNK + 1) == grpc.StatusCode.INVALID_ARGUMENT
    assert _code(_download, stub, TOKEN, 0) == grpc.StatusCode.INVALID_ARGUMENT
    assert _code(_upload, stub, TOKEN, MAX_PROBE_BYTES + 1, 0) == grpc.StatusCode.INVALID_ARGUMENT
    # more bytes than announced: refused as soon as they pass the announced size
    assert _code(_upload, stub, TOKEN, 100_000, 300_000) == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as e:
        _download(stub, TOKEN, MAX_PROBE_BYTES + 1)
    assert "total_bytes" in e.value.details() and str(MAX_PROBE_BYTES) in e.value.details()
    # exactly the limit is fine
    assert _download(stub, TOKEN, MAX_PROBE_BYTES) == MAX_PROBE_BYTES
    assert _upload(stub, TOKEN, 1 << 20).received_bytes == 1 << 20


def _held_upload(stub):
    """An upload probe that announces itself and then waits: ``(queue to feed it, its future)``."""
    q: queue.SimpleQueue = queue.SimpleQueue()
    q.put(pb.ProbeUploadRequest(token=TOKEN, total_bytes=1000))
    return q, stub.ProbeUpload.future(iter(q.get, None), timeout=60)


def test_busy_coordinator_refuses_extra_probes_then_serves_again(coordinator, stub):
    holders = [_held_upload(stub) for _ in range(MAX_CONCURRENT_PROBES)]
    seen: list[grpc.StatusCode] = []

    def refused() -> bool:
        # A held probe's first message goes out on a gRPC thread: an extra probe can reach the coordinator
        # first and take the slot, and the held one is then refused. Hold another in its place.
        for i, (_, f) in enumerate(holders):
            if f.done() and f.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                holders[i] = _held_upload(stub)
        ended = [f.exception() for _, f in holders if f.done()]
        assert not ended, f"a held upload probe ended before it was released: {ended}"
        seen.append(_code(_download, stub, TOKEN, 1000, 0, 5.0))  # one slow answer does not use up the wait
        return seen[-1] == grpc.StatusCode.RESOURCE_EXHAUSTED and not any(f.done() for _, f in holders)

    try:
        wait_for(refused, 50, "a probe beyond the limit is refused while the others run", interval=0.05)
    except TimeoutError as e:
        raise AssertionError(f"{e}; the extra probes got {sorted(set(seen), key=str)}") from None
    finally:
        for q, _ in holders:
            q.put(pb.ProbeUploadRequest(payload=b"\0" * 1000))
            q.put(None)
    assert [f.result(timeout=30).received_bytes for _, f in holders] == [1000] * MAX_CONCURRENT_PROBES
    # every slot is free again: probes and heartbeats are served
    assert _download(stub, TOKEN, 5000) == 5000
    client = CoordinatorClient(f"127.0.0.1:{coordinator[0]}", TOKEN,
                               PeerInfo("12D3KooWprobeaxxxxxxx", "cpu", 8 << 30, 1000.0, public_key=b"probe"))
    try:
        client.join()
        assert client.heartbeat().lease_remaining > 0
        assert client.measure_bandwidth(probe_bytes=50_000) is not None
    finally:
        client.close()
    assert _serving(coordinator[0])
