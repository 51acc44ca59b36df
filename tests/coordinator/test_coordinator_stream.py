"""Heartbeats over ``HeartbeatStream``: the real gRPC service in this process answers each streamed
heartbeat as the unary call would, ends the stream with the same status code on a refusal, and the
peer client uses the stream, falls back to unary calls where the coordinator lacks it, and survives a
coordinator restart by sending that heartbeat as a unary call and reopening the stream after."""

from __future__ import annotations

import asyncio
import logging
import threading

import grpc
import pytest
from hypothesis import HealthCheck, given, settings as hsettings, strategies as st

from coordinator.core import Coordinator
from coordinator.server import BackgroundServer, ServeOptions
from coordinator.servicer import CoordinatorServicer
from coordinator.settings import CoordinatorSettings
from coordinator.sqlite_store import open_store
from peer.localnet import free_port
from models.presets import tiny_cpu
from peer.coordinator_client import CoordinatorClient, CoordinatorUnavailable, PeerInfo, Progress
from protos import coordinator_pb2 as pb
from protos import coordinator_pb2_grpc as pb_grpc

TOKEN = "stream-token"
RUN = tiny_cpu()
SETTINGS = CoordinatorSettings(lease_timeout=30.0, heartbeat_interval=5.0, tick_interval=0.2, flush_interval=0.2)


def peer_info(i: int) -> PeerInfo:
    return PeerInfo(f"12D3KooWstream{'abcdefgh'[i]}xxxxx", "cpu", 8 << 30, 1000.0, public_key=b"sk%d" % i)


def client_for(port: int, i: int) -> CoordinatorClient:
    return CoordinatorClient(f"127.0.0.1:{port}", TOKEN, peer_info(i), rpc_timeout=5.0, retry_timeout=30.0,
                             backoff_base=0.05, backoff_max=0.5, seed=i)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    db = tmp_path_factory.mktemp("stream") / "state.db"
    with BackgroundServer(RUN, SETTINGS, ServeOptions(db=str(db), port=0, http_port=0, token=TOKEN,
                                                      host="127.0.0.1")) as srv:
        yield srv


def test_client_heartbeats_over_one_stream(server):
    client = client_for(server.port, 0)
    try:
        client.join()
        streams0 = server.coordinator.counters["heartbeat_streams"]
        for rnd in range(1, 4):
            reply = client.heartbeat([Progress("L0M0", rnd, 100 * rnd, 3.0 - 0.1 * rnd)], tokens_per_s=1234.0)
            assert reply.lease_remaining == pytest.approx(30.0, abs=1.0) and not reply.drain and not reply.rejoined
        assert client.heartbeats_sent == {"stream": 3, "unary": 0}
        assert server.coordinator.counters["heartbeat_streams"] == streams0 + 1  # one stream, three heartbeats
        progress = server.coordinator.progress_of(peer_info(0).peer_id)
        assert progress["L0M0"].round == 3 and progress["L0M0"].tokens == 300
        assert server.coordinator.peer(peer_info(0).peer_id).capabilities.tokens_per_s == 1234.0

        # an operator drain reaches the peer in the next streamed reply
        client.drain(peer_info(0).peer_id, "maintenance")
        reply = client.heartbeat()
        assert reply.drain and reply.drain_reason == "maintenance"
        assert client.heartbeats_sent["stream"] == 4
        client.leave("done")
    finally:
        client.close()


def _stream_codes(stub: pb_grpc.CoordinatorStub, requests: list[pb.HeartbeatRequest]) -> tuple[int, grpc.StatusCode]:
    """Replies received and the final status of one stream carrying ``requests``."""
    call = stub.HeartbeatStream(iter([pb.HeartbeatStreamRequest(heartbeat=r) for r in requests]), timeout=10)
    replies = 0
    try:
        for _ in call:
            replies += 1
    except grpc.RpcError as e:
        return replies, e.code()
    return replies, grpc.StatusCode.OK


def test_a_refusal_ends_the_stream_with_the_unary_status_code(server):
    client = client_for(server.port, 1)
    try:
        info = client.join()
        pid = peer_info(1).peer_id
        good = pb.HeartbeatRequest(lease_id=info.lease_id, peer_id=pid, assignment_version=info.assignment.version)
        unknown = pb.HeartbeatRequest(lease_id="0" * 32, peer_id=pid)
        bad_loss = pb.HeartbeatRequest(lease_id=info.lease_id, peer_id=pid,
                                       progress=[pb.ModuleProgress(module_id="L0M0", round=1, loss=float("nan"))])
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
            stub = pb_grpc.CoordinatorStub(ch)
            assert _stream_codes(stub, [good, good]) == (2, grpc.StatusCode.OK)
            assert _stream_codes(stub, [good, unknown, good]) == (1, grpc.StatusCode.NOT_FOUND)
            assert _stream_codes(stub, [bad_loss, good]) == (0, grpc.StatusCode.INVALID_ARGUMENT)
            assert _stream_codes(stub, [pb.HeartbeatRequest()]) == (0, grpc.StatusCode.INVALID_ARGUMENT)
            # the unary call answers the same requests with the same codes
            with pytest.raises(grpc.RpcError) as e:
                stub.Heartbeat(unknown, timeout=10)
            assert e.value.code() == grpc.StatusCode.NOT_FOUND
            assert _stream_codes(stub, [good]) == (1, grpc.StatusCode.OK)  # still serving
    finally:
        client.close()


def test_client_rejoins_when_the_stream_reports_the_lease_gone(server):
    client = client_for(server.port, 2)
    pid = peer_info(2).peer_id
    try:
        client.join()
        client.heartbeat()
        lost = client.joined.lease_id
        server.coordinator.leave(lost, pid, "the coordinator lost the lease")  # the next streamed beat: NOT_FOUND
        reply = client.heartbeat()
        assert reply.rejoined and reply.join is not None and client.joined.lease_id != lost
        assert client.heartbeat().rejoined is False  # over a fresh stream
        assert client.heartbeats_sent == {"stream": 2, "unary": 0}
        assert server.coordinator.peer(pid).state == "active"
    finally:
        client.close()


def test_a_peer_that_left_never_joins_again_from_a_heartbeat(server):
    """A drain ends with leave() while the background heartbeat thread still runs: neither a heartbeat
    sent after the leave nor one that was built from the old lease (NOT_FOUND) may take a fresh lease."""
    client = client_for(server.port, 3)
    pid = peer_info(3).peer_id
    try:
        client.join()
        client.heartbeat()
        old = client.joined
        client.leave("spot notice")
        assert server.coordinator.peer(pid).state == "left"
        with pytest.raises(CoordinatorUnavailable, match="has left the run"):
            client.heartbeat()  # no lease any more: it must not join again here
        client.joined = old  # a heartbeat that read the lease before the leave: NOT_FOUND
        with pytest.raises(CoordinatorUnavailable, match="has left the run"):
            client.heartbeat()
        assert server.coordinator.peer(pid).state == "left"
        assert pid not in {p["peer_id"] for p in client.status()["peers"]}
    finally:
        client.close()


def test_background_heartbeats_stop_at_the_leave(server):
    client = client_for(server.port, 4)
    pid = peer_info(4).peer_id
    beats = threading.Semaphore(0)
    try:
        client.join()
        thread = client.start_heartbeats(lambda: {}, lambda _reply: beats.release(), interval=0.02)
        for _ in range(3):
            assert beats.acquire(timeout=30), "the background heartbeats run"
        client.leave("drained")
        thread.join(timeout=30)
        assert not thread.is_alive(), "the heartbeat thread ends at the leave, not at close()"
        assert server.coordinator.peer(pid).state == "left"
    finally:
        client.close()


_text = st.text(max_size=80) | st.sampled_from(["L0M0", "L1M1", "embed", "head", "12D3KooWfuzzzzzzzzzz"])
_u64 = st.integers(0, 2**64 - 1)
_floats = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([0.0, 1000.0, -1.0])


@hsettings(max_examples=60, deadline=None, derandomize=True,
           suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(real_lease=st.booleans(), lease=_text, peer_id=_text,
       progress=st.lists(st.tuples(_text, _u64, _u64, _floats), max_size=4), version=_u64, tps=_floats,
       sent=_u64, preempting=st.booleans())
def test_fuzzed_streamed_heartbeats_get_the_unary_code_never_internal(server, real_lease, lease, peer_id, progress,
                                                                      version, tps, sent, preempting):
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        stub = pb_grpc.CoordinatorStub(ch)
        if real_lease:
            pid = "12D3KooWfuzzstreamzz"
            joined = stub.Join(pb.JoinRequest(token=TOKEN, peer_id=pid, public_key=b"fuzz", capabilities=pb.Capabilities(
                device="cpu", memory_bytes=8 << 30, tokens_per_s=100.0)), timeout=10)
            lease, peer_id = joined.lease.lease_id, pid
        request = pb.HeartbeatRequest(
            lease_id=lease, peer_id=peer_id, assignment_version=version, tokens_per_s=tps, bytes_sent=sent,
            preempting=preempting,
            progress=[pb.ModuleProgress(module_id=m, round=r, tokens=t, loss=l) for m, r, t, l in progress],
        )
        replies, streamed = _stream_codes(stub, [request])
        try:
            stub.Heartbeat(request, timeout=10)
            unary = grpc.StatusCode.OK
        except grpc.RpcError as e:
            unary = e.code()
    assert streamed not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)
    assert streamed == unary and replies == (1 if unary == grpc.StatusCode.OK else 0)


class _OlderServicer(CoordinatorServicer):
    """The real servicer as an older coordinator answers the stream: UNIMPLEMENTED."""

    async def HeartbeatStream(self, request_iterator, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")


class _OlderCoordinator:
    """A real gRPC server (its own thread and event loop) around :class:`_OlderServicer`."""

    def __init__(self, coord: Coordinator):
        self.port = 0
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=asyncio.run, args=(self._main(coord),), daemon=True)
        self._thread.start()
        assert self._ready.wait(30), "the older coordinator did not start"

    async def _main(self, coord: Coordinator) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        server = grpc.aio.server()
        pb_grpc.add_CoordinatorServicer_to_server(_OlderServicer(coord, TOKEN), server)
        self.port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        self._ready.set()
        await self._stop.wait()
        await server.stop(grace=None)

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)


def test_client_falls_back_to_unary_heartbeats_on_an_older_coordinator(caplog):
    coord = Coordinator(RUN, SETTINGS, open_store(":memory:"))
    older = _OlderCoordinator(coord)
    client = client_for(older.port, 3)
    try:
        client.join()
        with caplog.at_level(logging.WARNING, logger="peer.coordinator_client"):
            for _ in range(3):
                assert client.heartbeat().lease_remaining > 0
        assert client.heartbeats_sent == {"stream": 0, "unary": 3}
        warnings = [r for r in caplog.records if "HeartbeatStream" in r.getMessage()]
        assert len(warnings) == 1  # one warning, then unary for good
        assert coord.counters["heartbeats"] == 3
    finally:
        client.close()
        older.close()


def test_a_broken_stream_sends_that_heartbeat_unary_then_reopens(tmp_path):
    opts = ServeOptions(db=str(tmp_path / "state.db"), port=free_port(), http_port=0, token=TOKEN, host="127.0.0.1")
    with BackgroundServer(RUN, SETTINGS, opts) as first:
        client = client_for(first.port, 4)
        client.join()
        client.heartbeat()
        assert client.heartbeats_sent == {"stream": 1, "unary": 0}
    try:
        with BackgroundServer(RUN, SETTINGS, opts) as second:  # restarted on the same database and port
            reply = client.heartbeat()
            assert not reply.rejoined  # the lease survived the restart
            assert client.heartbeats_sent == {"stream": 1, "unary": 1}
            client.heartbeat()
            assert client.heartbeats_sent == {"stream": 2, "unary": 1}
            # counters are kept in the database: the first process's stream and heartbeat count too
            assert second.coordinator.counters["heartbeat_streams"] == 2
            assert second.coordinator.counters["heartbeats"] == 3
    finally:
        client.close()
