"""Measure this machine's exchange constants for the scale simulator, on real averaging processes.

The simulator (:mod:`bench.scale_sim`) models one module's exchange, from its group forming to the end of
its all-reduce, as the bytes on the slowest link, a fixed ``latency``, and ``part_cpu`` seconds of a
member's processing for each other member's part, that many times slower when more exchanging peers
than cores share the machine (``SimConfig.exchange_cores``). Both constants depend on the machine:
fitted once on one VM, they over-predicted the calibration's overheads by half on a faster one. This
probe measures them where the calibration runs, before it, on a run it does not compare against.

For each size n, n member processes (``python -m bench.exchange_probe --member``, each with its own
DHT node and p2p daemons, as a peer has) hold the modules of one path of the run's lattice and average
them all at once each round, as a path peer does, with the run's codec and random deltas of the
modules' sizes, for ``rounds`` rounds (the first not counted). Nothing else runs: their exchanges
have the machine's cores. The median ``transfer_seconds`` (group formed to all-reduce done) of
``module`` over members and counted rounds, minus its bytes over loopback, is fitted by least squares
as ``latency + part_cpu * (n - 1) * max(1, n / cores)`` (:func:`fit`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional, Sequence

__all__ = ["SIZES", "ROUNDS", "fit", "measure", "main"]

log = logging.getLogger("bench.exchange_probe")

SIZES = (2, 3, 4, 6)
"""Members at each step of a probe (a calibration probes them all, whatever its largest network):
from one member a core to three on a 2-core machine."""
ROUNDS = 6
"""Rounds each size averages; the first (connections opened, buffers sized) is not counted."""
ROUND_TIMEOUT = 30.0
RUN_ID = "probe"
HOST = "/ip4/127.0.0.1/tcp/0"
LOOPBACK_BPS = 1e9
"""Bytes per second taken for loopback when the bytes of a measured exchange are set apart (the
calibration's peers report 0.1-2.4 GB/s; the tiny preset's parts make this term well under a millisecond)."""


def fit(points: Sequence[tuple[int, float]], cores: int) -> dict:
    """Least squares of ``seconds = latency + part_cpu * (n - 1) * max(1, n / cores)`` over ``points``
    (n, seconds); both at least 0 (a negative intercept is refitted through the origin)."""
    xs = [(n - 1) * max(1.0, n / cores) for n, _ in points]
    ys = [s for _, s in points]
    if len(set(xs)) < 2:
        raise ValueError(f"the fit needs at least two sizes with different loads, got {sorted(set(xs))}")
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    latency = my - slope * mx
    if latency < 0:
        latency, slope = 0.0, sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)
    slope = max(0.0, slope)
    residual = max(abs(latency + slope * x - y) for x, y in zip(xs, ys))
    return {"latency": latency, "part_cpu": slope, "max_residual_s": residual}


def _module_sizes(run) -> dict[str, int]:
    """Parameters of each module of the run's first path."""
    lattice = run.lattice
    return {m: lattice.module_param_count(m) for m in lattice.path_modules((0,) * lattice.levels)}


def measure(run, module: str, sizes: Sequence[int] = SIZES, rounds: int = ROUNDS,
            work: Optional[Path] = None) -> dict:
    """Probe ``sizes`` one after the other (see the module's docstring); the figures and the fit."""
    from coordinator.scheduler import exchange_bytes
    from peer.localnet import ProcessGroup

    cores = len(os.sched_getaffinity(0))
    wire = exchange_bytes(run, [module])
    rows = []
    with tempfile.TemporaryDirectory(prefix="hivepath-probe-") as tmp:
        base = Path(work or tmp)
        base.mkdir(parents=True, exist_ok=True)
        config = base / "run.json"
        config.write_text(run.to_json())
        procs = ProcessGroup(base / "logs")
        try:
            for n in sizes:
                rows.append(_probe(procs, base, config, module, n, rounds, wire))
                log.info("probe: %d members: %s", n, rows[-1])
        finally:
            procs.close()
    fitted = fit([(r["members"], max(0.0, r["transfer_s_median"] - r["bytes_s"])) for r in rows], cores)
    return {**fitted, "cores": cores, "module": module, "wire_bytes": wire, "rounds": rounds, "rows": rows}


def _probe(procs, base: Path, config: Path, module: str, n: int, rounds: int, wire: int) -> dict:
    """One size: ``n`` members started, averaged ``rounds`` rounds, stopped; the figures of ``module``."""
    from peer.localnet import wait_for

    names = [f"n{n}-member{i}" for i in range(n)]
    try:
        maddrs = base / f"maddrs-{n}.json"
        common = [sys.executable, "-m", "bench.exchange_probe", "--member", "--config", str(config),
                  "--size", str(n), "--rounds", str(rounds)]
        procs.start(names[0], [*common, "--index", "0", "--maddrs-out", str(maddrs)])
        wait_for(lambda: procs.none_exited(names) and maddrs.exists(), 120, f"member 0 of {n} to start its DHT",
                 interval=0.2, retry_on=())
        first = json.loads(maddrs.read_text())
        for i in range(1, n):
            procs.start(names[i], [*common, "--index", str(i), "--initial-peers", ",".join(first)])
        wait_for(lambda: procs.none_exited(names) and all(procs.json_lines(m, "done") for m in names),
                 180 + 2 * rounds * ROUND_TIMEOUT, f"{n} members to average {rounds} rounds", interval=0.5,
                 retry_on=())
    finally:
        procs.stop([m for m in names if m in procs.procs], timeout=30.0)
    events = [e for m in names for e in procs.json_lines(m, "probe") if e["module"] == module and e["round"] > 0]
    whole = [e["transfer_s"] for e in events if e["ok"] and e["group_size"] == n]
    if not whole:
        raise RuntimeError(f"{n} members: no counted round of {module} averaged all {n}: {events}")
    return {"members": n, "transfer_s_median": statistics.median(whole),
            # a member's part out and the others' in, both ways, on loopback
            "bytes_s": wire * 2 * (n - 1) / n / LOOPBACK_BPS,
            "exchanges": len(whole), "failed": sum(not e["ok"] or e["group_size"] != n for e in events)}


def _member(args: argparse.Namespace) -> None:
    """One member: hold the run's first path, wait for the others, average ``rounds`` rounds of every
    module at once and print each exchange as a JSON line; then wait to be stopped (a member that left
    at once could cut a slower one's last round short)."""
    import threading

    import torch

    from models import strict_json
    from models.config import RunConfig
    from models.durable import atomic_write_text
    from peer.averaging.net_averager import NetAverager
    from peer.compression import resolve_codec
    from peer.localnet import wait_for
    from peer.network import DHTOptions, HolderRecord, holders_key, read_records, start_dht
    from peer.node.lifetime import stop_on_signals

    run = RunConfig.from_json(Path(args.config).read_text())
    sizes = _module_sizes(run)
    codec = resolve_codec(run.outer)
    gen = torch.Generator().manual_seed(args.index)
    deltas = {m: torch.randn(k, generator=gen) * 1e-3 for m, k in sizes.items()}
    initial = [a for a in (args.initial_peers or "").split(",") if a]
    with stop_on_signals(), start_dht(DHTOptions(host_maddrs=(HOST,), initial_peers=initial)) as dht:
        if args.maddrs_out:  # whole or absent: the prober reads it as soon as it exists
            atomic_write_text(args.maddrs_out, strict_json.dumps(dht.maddrs()))
        avg = NetAverager(dht, RUN_ID, run.content_hash())
        try:
            for m in sizes:
                avg.hold(m, 0)
            wait_for(lambda: all(len(read_records(dht.dht, holders_key(RUN_ID, m), HolderRecord)) == args.size
                                 for m in sizes), 120, f"{args.size} holders of every module", interval=0.2)
            with ThreadPoolExecutor(len(sizes)) as pool:
                for r in range(args.rounds):
                    results = dict(zip(sizes, pool.map(
                        lambda m: avg.average(m, r, [deltas[m]], 1.0, codec, ROUND_TIMEOUT), sizes)))
                    for m, res in results.items():
                        print(strict_json.dumps({"event": "probe", "round": r, "module": m, "ok": res.ok,
                                          "group_size": res.group_size, "transfer_s": res.transfer_seconds,
                                          "reason": res.reason}), flush=True)
            print(strict_json.dumps({"event": "done", "time": time.time()}), flush=True)
            threading.Event().wait()  # until SIGTERM (stop_on_signals: KeyboardInterrupt)
        except KeyboardInterrupt:
            pass
        finally:
            avg.shutdown()


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.exchange_probe", description=__doc__.split("\n\n")[0])
    ap.add_argument("--member", action="store_true", help="run as one member (started by measure())")
    ap.add_argument("--config", help="the run config (JSON) whose first path and codec a member averages")
    ap.add_argument("--size", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=ROUNDS)
    ap.add_argument("--index", type=int, default=0)
    ap.add_argument("--initial-peers", default="")
    ap.add_argument("--maddrs-out", default="")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    if not args.member:
        ap.error("this module measures the scale simulator's constants for bench.scale_calibrate; "
                 "run that benchmark (python -m bench.scale_calibrate), which starts the members")
    if not args.config:
        ap.error("--member needs --config RUN.json")
    _member(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
