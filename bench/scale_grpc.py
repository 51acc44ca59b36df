"""The coordinator's CPU share at the simulated scale, through its real gRPC server (part of ``bench.scale``).

:mod:`bench.scale_sim` calls the coordinator in-process: no gRPC, no protobuf, no server threads, and
no joins arriving at once. Here a ``hivepath coordinator serve`` process (the simulator's settings:
SQLite with ``synchronous = NORMAL``, a heartbeat every ``heartbeat_interval`` = 5 s) serves ``peers``
peers that joined over gRPC and hold one ``HeartbeatStream`` each, as real peers do; this process
sends each peer's heartbeat once per interval, spread evenly, so the server sees the simulated rate
(``peers / heartbeat_interval`` heartbeats a second). Halfway through the window, ``storm`` new peers
join at once. The server process's CPU time over the window, divided by the window, is its CPU share
in cores (``coordinator_cpu_share_at_PEERS_grpc``); the same before the storm
(``..._steady``), and the storm's own figures: joins admitted and refused, CPU seconds and the slowest
join. The load generator runs on the same machine, so ``heartbeat_rate_achieved`` says whether it
kept the rate.

Run alone (prints the figures, writes no result): ``python -m bench.scale_grpc [--peers N] [--storm
N] [--seconds S]``; ``python -m bench.scale`` runs it at 10,000 peers and a storm of 1,000 and
writes the figures into ``scale.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time

from models import strict_json
from bench.coordinator_load import TOKEN, coordinator_process, event_loop, peer_id, process_cpu_s

MEASURES = (
    "bench/scale_grpc.py",
    "bench/coordinator_load.py",
    "coordinator",
    "models",
    "protos",
)
"""The code these figures depend on (``bench.scale`` measures them)."""

__all__ = ["coordinator_cpu_share", "HEARTBEAT_INTERVAL"]

log = logging.getLogger("bench.scale_grpc")

HEARTBEAT_INTERVAL = 5.0
"""Seconds between a peer's heartbeats: ``CoordinatorSettings.heartbeat_interval``'s default, which
the simulator uses."""

COORDINATOR = {"heartbeat_interval": HEARTBEAT_INTERVAL, "lease_timeout": 600.0, "sqlite_synchronous": "NORMAL",
               "max_peers": 200000}
"""The ``[coordinator]`` table (the run: the tiny preset): the simulator's coordinator settings; leases long enough that none expires while the peers join
(the joins before the window are not what is measured)."""


async def _run(port: int, pid: int, peers: int, storm: int, seconds: float) -> dict:
    import grpc

    from protos.hivepath.coordinator.v1 import coordinator_pb2 as pb
    from protos.hivepath.coordinator.v1 import coordinator_pb2_grpc as pb_grpc

    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stub = pb_grpc.CoordinatorStub(channel)
    caps = pb.Capabilities(device="cpu", memory_bytes=8 << 30, tokens_per_s=1000.0)

    async def join(i: int) -> pb.JoinReply:
        p = peer_id(i)
        return await stub.Join(pb.JoinRequest(token=TOKEN, peer_id=p, public_key=p.encode(), capabilities=caps),
                               timeout=120)

    beats: list[pb.HeartbeatStreamRequest] = []
    for start in range(0, peers, 64):  # the swarm as it stands before the window: not measured
        for i, r in zip(range(start, min(peers, start + 64)),
                        await asyncio.gather(*(join(i) for i in range(start, min(peers, start + 64))))):
            beats.append(pb.HeartbeatStreamRequest(heartbeat=pb.HeartbeatRequest(
                lease_id=r.lease.lease_id, peer_id=peer_id(i), assignment_version=r.assignment.version)))
    # each stream opens with its peer's first heartbeat, as a peer's does: opened all at once and written
    # later, gRPC cancels the ones that wait past about a thousand
    streams: list = [None] * len(beats)
    latencies: list[float] = []

    async def beat(i: int) -> None:
        s = time.perf_counter()
        if streams[i] is None:
            streams[i] = stub.HeartbeatStream()
        try:
            await streams[i].write(beats[i])
            await streams[i].read()
        except asyncio.InvalidStateError:  # the server ended the stream: say why
            raise RuntimeError(f"heartbeat stream {i} ended by the coordinator: {await streams[i].code()} "
                               f"{await streams[i].details()}") from None
        latencies.append(time.perf_counter() - s)

    for start in range(0, len(beats), 64):  # each stream opened with the peer's first heartbeat on it
        await asyncio.gather(*(beat(i) for i in range(start, min(len(beats), start + 64))))
    latencies.clear()
    log.info("%d peers joined and heartbeating; measuring %.0f s", peers, seconds)

    workers = 64
    t0 = time.perf_counter()
    end = t0 + seconds

    async def paced(w: int) -> None:
        """Heartbeats of leases w, w + workers, ...: each once per interval, at its offset in it."""
        cycle = 0
        while True:
            for i in range(w, len(beats), workers):
                due = t0 + cycle * HEARTBEAT_INTERVAL + HEARTBEAT_INTERVAL * i / len(beats)
                if due >= end:
                    return
                delay = due - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                await beat(i)
            cycle += 1

    async def join_storm() -> dict:
        await asyncio.sleep(seconds / 2)
        cpu0, s0 = process_cpu_s(pid), time.perf_counter()
        replies = await asyncio.gather(*(join(peers + k) for k in range(storm)), return_exceptions=True)
        took, cpu = time.perf_counter() - s0, process_cpu_s(pid) - cpu0
        refused = [r for r in replies if isinstance(r, grpc.RpcError)]
        other = [r for r in replies if isinstance(r, BaseException) and not isinstance(r, grpc.RpcError)]
        if other:
            raise other[0]
        return {"join_storm_peers": storm, "join_storm_admitted": storm - len(refused),
                "join_storm_refused": len(refused),
                "join_storm_refusal_codes": sorted({r.code().name for r in refused}),
                "join_storm_s": round(took, 2), "join_storm_server_cpu_s": round(cpu, 2)}

    cpu_start = process_cpu_s(pid)
    storm_task = asyncio.ensure_future(join_storm()) if storm > 0 else None
    steady_cpu = None

    async def steady_probe() -> None:
        nonlocal steady_cpu
        await asyncio.sleep(seconds / 2)
        steady_cpu = process_cpu_s(pid) - cpu_start

    await asyncio.gather(steady_probe(), *(paced(w) for w in range(min(workers, len(beats)))))
    elapsed = time.perf_counter() - t0
    cpu = process_cpu_s(pid) - cpu_start
    out = await storm_task if storm_task is not None else {}
    for s in streams:
        await s.done_writing()
    await channel.close()
    latencies.sort()
    target = peers / HEARTBEAT_INTERVAL
    return {
        f"coordinator_cpu_share_at_{peers}_grpc": round(cpu / elapsed, 4),
        f"coordinator_cpu_share_at_{peers}_grpc_steady": round(steady_cpu / (seconds / 2), 4),
        "grpc_peers": peers,
        "grpc_window_s": round(elapsed, 1),
        "heartbeat_rate_target": round(target, 1),
        "heartbeat_rate_achieved": round(len(latencies) / elapsed, 1),
        "heartbeat_p99_ms": round(latencies[int(0.99 * (len(latencies) - 1))] * 1000, 2) if latencies else None,
        "server_cpu_us_per_heartbeat_at_rate": round(cpu / max(1, len(latencies)) * 1e6, 1),
        **out,
    }


def coordinator_cpu_share(peers: int, storm: int, seconds: float) -> dict:
    """Start the coordinator, bring ``peers`` peers to it, and measure (module docstring)."""
    with coordinator_process(COORDINATOR) as (port, pid), event_loop() as runner:
        return runner.run(_run(port, pid, peers, storm, seconds))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.scale_grpc", description=__doc__.split("\n\n")[0])
    ap.add_argument("--peers", type=int, default=10_000, help="peers heartbeating (default 10000)")
    ap.add_argument("--storm", type=int, default=1_000, help="peers joining at once mid-window (default 1000)")
    ap.add_argument("--seconds", type=float, default=30.0, help="measurement window (default 30)")
    args = ap.parse_args(argv)
    if args.peers < 1 or args.storm < 0 or args.seconds <= 0:
        ap.error("--peers must be >= 1, --storm >= 0 and --seconds > 0")
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    print(strict_json.dumps(coordinator_cpu_share(args.peers, args.storm, args.seconds), sort_keys=True))
    return 0


if __name__ == "__main__":
    from bench.common import run_main

    run_main(main)
