"""Load on the real coordinator: 10,000 live leases heartbeating over gRPC.

The coordinator runs as its own process (``hivepath coordinator serve`` on an SQLite-WAL database
with ``synchronous=FULL``); this process is the load generator on the same machine: it joins
``--peers`` peers, opens one ``HeartbeatStream`` per peer (as each real peer holds one), then keeps
``--concurrency`` heartbeats in flight for ``--seconds`` over all leases (grpc.aio on uvloop). For
comparison it then drives unary ``Heartbeat`` calls for ``--unary-seconds`` (keys ``unary_*``). It
also times one assignment decision with 100,000 peers in state.

Keys: ``heartbeats_per_s`` (target >= 3000), ``p99_ms`` (target <= 20), ``leases``,
``assign_ms_100k`` (target <= 50).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import grpc

from bench.common import emit, run_main

MEASURES = (
    "bench/coordinator_load.py",
    "coordinator",
    "models",
    "protos",
)
"""The code this benchmark's figures depend on: ``python -m bench.report`` marks its results stale
when any of it changed after the commit a result records."""

__all__ = ["main", "coordinator_process", "event_loop", "peer_id", "process_cpu_s", "TOKEN"]

log = logging.getLogger("bench.coordinator_load")

TOKEN = "bench-token"
COORDINATOR = {"lease_timeout": 600.0, "heartbeat_interval": 5.0, "flush_interval": 1.0, "sqlite_synchronous": "FULL",
               "max_peers": 200000}
"""The ``[coordinator]`` table of the measured coordinator (its run: the tiny preset)."""


def peer_id(i: int) -> str:
    """The ``i``-th synthetic peer id."""
    alphabet = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
    s = ""
    for _ in range(8):
        i, r = divmod(i, 58)
        s += alphabet[r]
    return "12D3KooWbench" + s


def assign_ms(peers: int, levels: int, modules_per_level: int, repeats: int = 30) -> float:
    """Median milliseconds of one join decision with ``peers`` peers already holding work."""
    from coordinator.records import Capabilities
    from coordinator.scheduler import assign_peer, path_assignment
    from coordinator.settings import CoordinatorSettings
    from coordinator.view import ClusterView
    from models.config import LatticeConfig, RunConfig

    run = RunConfig(run_id="bench", lattice=LatticeConfig(d_model=64, n_heads=2, blocks_per_module=1, seq_len=64,
                                                           levels=levels, modules_per_level=modules_per_level))
    settings = CoordinatorSettings()
    rng = random.Random(0)
    view = ClusterView()
    paths = run.lattice.paths()
    for i in range(peers):  # state built directly (round-robin paths): only the decision below is timed
        caps = Capabilities("cpu", 8 << 30, rng.uniform(100, 10000), rng.choice([0.0, 1e5, 1e8]), 1e8)
        view.add(f"p{i}", path_assignment(paths[i % len(paths)], caps, run, settings, "bench", 1), caps.tokens_per_s)
    times = []
    for i in range(repeats):
        caps = Capabilities("cpu", 8 << 30, rng.uniform(100, 10000), rng.choice([1e5, 1e8]), 1e8)
        t0 = time.perf_counter()
        a, reason = assign_peer(0.0, caps, view, run, settings)
        times.append((time.perf_counter() - t0) * 1000)
        assert a is not None and reason
    return statistics.median(times)


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rss_mb(pid: int) -> float:
    """Resident memory of process ``pid`` in MiB (Linux /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return 0.0


async def _load(port: int, peers: int, seconds: float, concurrency: int, server_pid: int,
                unary_seconds: float) -> dict:
    from protos.hivepath.coordinator.v1 import coordinator_pb2 as pb
    from protos.hivepath.coordinator.v1 import coordinator_pb2_grpc as pb_grpc

    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stub = pb_grpc.CoordinatorStub(channel)
    caps = pb.Capabilities(device="cpu", memory_bytes=8 << 30, tokens_per_s=1000.0)
    beats: list[pb.HeartbeatRequest] = []
    next_peer = 0

    async def joiner() -> None:
        nonlocal next_peer
        while next_peer < peers:
            i = next_peer
            next_peer += 1
            pid = peer_id(i)
            r = await stub.Join(pb.JoinRequest(token=TOKEN, peer_id=pid, public_key=pid.encode(), capabilities=caps),
                                timeout=60)
            beats.append(pb.HeartbeatRequest(lease_id=r.lease.lease_id, peer_id=pid,
                                              assignment_version=r.assignment.version))

    t0 = time.perf_counter()
    await asyncio.gather(*(joiner() for _ in range(64)))
    join_s = time.perf_counter() - t0
    log.info("%d joins in %.1fs", peers, join_s)

    status = await stub.Status(pb.StatusRequest(token=TOKEN), timeout=60)
    result: dict = {"leases": status.live_leases, "joins_per_s": round(peers / join_s, 1)}

    # One HeartbeatStream per live peer, as each real peer holds one (peer/coordinator_client/),
    # opened with the peer's first heartbeat on it, 64 peers at a time (the server cancels calls
    # it has not picked up beyond grpc's 1000 pending; peers do not all connect in one instant).
    stream_beats = [pb.HeartbeatStreamRequest(heartbeat=b) for b in beats]
    streams: list = [None] * len(beats)

    async def over_stream(i: int) -> None:
        await streams[i].write(stream_beats[i])
        await streams[i].read()

    async def opener(start: int) -> None:
        for i in range(start, len(beats), 64):
            streams[i] = stub.HeartbeatStream()
            await over_stream(i)

    t0 = time.perf_counter()
    await asyncio.gather(*(opener(k) for k in range(64)))
    result["open_streams_s"] = round(time.perf_counter() - t0, 2)
    log.info("%d heartbeat streams open in %.1fs", len(streams), result["open_streams_s"])

    async def unary(i: int) -> None:
        await stub.Heartbeat(beats[i], timeout=10)

    result.update(await _drive(over_stream, len(beats), seconds, concurrency, server_pid))
    if unary_seconds > 0:
        r = await _drive(unary, len(beats), unary_seconds, concurrency, server_pid)
        result.update({f"unary_{k}": v for k, v in r.items()})
    result["server_rss_mb_with_streams"] = _rss_mb(server_pid)
    for s in streams:
        await s.done_writing()
    status = await stub.Status(pb.StatusRequest(token=TOKEN), timeout=60)
    result["leases_after"] = status.live_leases
    await channel.close()
    return result


async def _drive(beat, n_leases: int, seconds: float, concurrency: int, server_pid: int) -> dict:
    """Keep ``concurrency`` heartbeats in flight for ``seconds``, cycling over every lease."""
    latencies: list[float] = []
    errors = 0
    stop_at = time.perf_counter() + seconds
    cursor = 0

    async def beater() -> None:
        nonlocal cursor, errors
        while time.perf_counter() < stop_at:
            i = cursor % n_leases
            cursor += 1
            s = time.perf_counter()
            try:
                await beat(i)
            except grpc.RpcError:
                errors += 1
                continue
            latencies.append(time.perf_counter() - s)

    t0 = time.perf_counter()
    server_cpu0, load_cpu0 = process_cpu_s(server_pid), time.process_time()
    await asyncio.gather(*(beater() for _ in range(concurrency)))
    elapsed = time.perf_counter() - t0
    server_cpu, load_cpu = process_cpu_s(server_pid) - server_cpu0, time.process_time() - load_cpu0
    latencies.sort()
    n = max(1, len(latencies))
    q = lambda f: latencies[min(len(latencies) - 1, int(f * len(latencies)))] * 1000  # noqa: E731
    return {
        "heartbeats_per_s": round(len(latencies) / elapsed, 1),
        "p50_ms": round(q(0.50), 2),
        "p99_ms": round(q(0.99), 2),
        "max_ms": round(latencies[-1] * 1000, 2),
        "heartbeats": len(latencies),
        "errors": errors,
        "server_cpu_us_per_heartbeat": round(server_cpu / n * 1e6, 1),
        "load_cpu_us_per_heartbeat": round(load_cpu / n * 1e6, 1),
        "loadavg_1m": round(os.getloadavg()[0], 2),
        # what two otherwise idle cores could sustain at the CPU cost measured per heartbeat
        "cpu_ceiling_heartbeats_per_s": round(2.0 / max(1e-9, (server_cpu + load_cpu) / n), 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.coordinator_load", description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=10000, help="live leases (default 10000)")
    parser.add_argument("--seconds", type=float, default=15.0, help="heartbeat phase length (default 15)")
    parser.add_argument("--concurrency", type=int, default=24, help="heartbeats in flight (default 24)")
    parser.add_argument("--unary-seconds", type=float, default=10.0,
                        help="then unary Heartbeat calls for comparison, seconds (default 10; 0: skip)")
    parser.add_argument("--assign-peers", type=int, default=100000, help="peers in state for assign_ms (100000)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    result = {
        "seeds": [0],  # the simulated peers' declarations
        "assign_ms_100k": round(assign_ms(args.assign_peers, 2, 16), 3),
        "assign_ms_100k_2x2": round(assign_ms(args.assign_peers, 2, 2), 3),
    }
    log.info("assign: %s", result)
    with coordinator_process(COORDINATOR) as (port, pid), event_loop() as runner:
        result.update(runner.run(_load(port, args.peers, args.seconds, args.concurrency, pid, args.unary_seconds)))
    result.update(concurrency=args.concurrency, seconds=args.seconds, cpus=os.cpu_count(),
                  targets={"heartbeats_per_s": ">= 3000", "p99_ms": "<= 20", "assign_ms_100k": "<= 50"})
    emit("coordinator_load", result)
    return 0


@contextlib.contextmanager
def coordinator_process(coordinator: dict) -> Iterator[tuple[int, int]]:
    """A ``hivepath coordinator serve`` process of the tiny preset's run with the ``[coordinator]`` table
    ``coordinator``, on a fresh database: ``(grpc port, pid)`` once it serves; stopped on exit."""
    from models.presets import tiny_cpu
    from peer.localnet import free_port

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "run.toml").write_text(tiny_cpu().to_toml(coordinator=coordinator))
        port, http_port = free_port(), free_port()
        server = subprocess.Popen(
            [sys.executable, "-m", "hivepath.cli", "--log-level", "WARNING", "coordinator", "serve", "--run-config",
             str(Path(tmp) / "run.toml"), "--db", str(Path(tmp) / "state.db"), "--host", "127.0.0.1", "--port",
             str(port), "--http-port", str(http_port)],
            env={**os.environ, "HIVEPATH_TOKEN": TOKEN}, cwd=Path(__file__).resolve().parents[1],
        )
        try:
            _wait_serving(port, server)
            yield port, server.pid
        finally:
            server.terminate()
            server.wait(30)


def event_loop() -> asyncio.Runner:
    """An asyncio runner on uvloop where it is installed (the load generator's own CPU matters)."""
    try:
        import uvloop

        return asyncio.Runner(loop_factory=uvloop.new_event_loop)
    except ImportError:  # pragma: no cover
        return asyncio.Runner()


def _wait_serving(port: int, server: subprocess.Popen, start_timeout: float = 60.0) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + start_timeout
    while True:
        if server.poll() is not None:
            raise RuntimeError(f"the coordinator exited with {server.returncode}")
        try:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
                r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1)
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    return
        except grpc.RpcError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError("the coordinator did not start")
        time.sleep(0.2)


if __name__ == "__main__":
    run_main(main)
