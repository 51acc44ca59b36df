"""The drain part of ``bench.chaos``: survivors' rounds around a drain.

A coordinator and ``peers`` peers (default 3) on a dense 1x1 lattice as real ``hivepath`` processes on
loopback, every peer holding every module, so each round is one group of all of them. Once the peers
have averaged together for ``window`` seconds (default 30), one peer is drained (SIGTERM) and the
survivors go on for another ``window`` seconds. Round times come from the survivors' ``--progress
json`` ``round`` events (the time between two rounds of one module).

Key: ``survivor_round_ratio_after_drain``, the median survivor round time in the ``window`` seconds
after the drain over that in the ``window`` before (target <= 1.2). A drained peer that left its
holder and matchmaking records behind made every survivor round wait for it until the gather
deadline while the records lived, several times a round's usual length: this key catches that.
"""

from __future__ import annotations

import logging
import statistics
import time
from pathlib import Path
from typing import Optional

MEASURES = (
    "bench/chaos_drain.py",
    "models",
    "peer",
    "coordinator",
    "hivepath",
    "protos",
)
"""The code this benchmark's figures depend on: ``python -m bench.report`` marks its results stale
when any of it changed after the commit a result records."""

__all__ = ["drain_run"]

log = logging.getLogger("bench.chaos_drain")


def _round_ends(events: list[dict], module: str) -> list[float]:
    return sorted(e["time"] for e in events if e.get("event") == "round" and e.get("module") == module)


def _durations(ends: list[float], start: float, stop: float) -> list[float]:
    """Durations of the rounds that ended in ``(start, stop]`` (from the end of the round before)."""
    return [b - a for a, b in zip(ends, ends[1:]) if start < b <= stop]


def drain_run(work: Path, peers: int = 3, window: float = 30.0, inner_steps: int = 10) -> dict:
    from models.data import prepared
    from peer.localnet import ProcessGroup, preset_network, wait_for

    data = prepared(work / "data-dense", 1, 1, "bytes")
    procs = ProcessGroup(work / "drain-logs")
    names = [f"peer{i}" for i in range(peers)]
    try:
        net = preset_network(procs, work / "drain-net", data.dir, data.manifest_hash, run_id="drain",
                             inner_steps=inner_steps, round_timeout=12.0, lease_timeout=600.0,
                             lattice={"levels": 1, "modules_per_level": 1})
        net.start_coordinator()
        for n in names:
            net.start_peer(n)
        wait_for(lambda: all(f"averaged by {peers}" in procs.log(n) for n in names), 600,
                 "every peer to average in one group")
        formed = time.time()
        wait_for(lambda: time.time() >= formed + window, window + 60, "the window before the drain", interval=1.0)
        drained, survivors = names[-1], names[:-1]
        t_drain = time.time()
        code = net.stop(drained, timeout=120)
        wait_for(lambda: time.time() >= t_drain + window, window + 120, "the window after the drain", interval=1.0)
        before: list[float] = []
        after: list[float] = []
        for n in survivors:
            ends = _round_ends(net.progress_lines(n), "embed")
            before += _durations(ends, t_drain - window, t_drain)
            after += _durations(ends, t_drain, t_drain + window)
        out = {"drain_peers": peers, "drain_window_s": window, "drain_exit_code": code,
               "survivor_rounds_before_drain": len(before), "survivor_rounds_after_drain": len(after),
               "survivor_round_median_before_s": round(statistics.median(before), 3) if before else None,
               "survivor_round_median_after_s": round(statistics.median(after), 3) if after else None}
        ratio: Optional[float] = None
        if before and after:
            ratio = round(statistics.median(after) / statistics.median(before), 3)
        out["survivor_round_ratio_after_drain"] = ratio
        return out
    finally:
        procs.close()


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(prog="python -m bench.chaos_drain", description=__doc__.split("\n\n")[0])
    ap.add_argument("--peers", type=int, default=3)
    ap.add_argument("--window", type=float, default=30.0)
    ap.add_argument("--work", type=Path, help="keep logs and checkpoints here (default: a temp dir, removed at the end "
                    "unless --keep)")
    ap.add_argument("--keep", action="store_true", help="keep the temp work directory and say where")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from bench.common import emit, run_main, work_directory

    def measure() -> dict:
        with work_directory("hivepath-drain-", args.work, args.keep) as work:
            return emit("chaos_drain", {**drain_run(work, args.peers, args.window), "seeds": [0]})  # the run config's seed

    run_main(measure)
