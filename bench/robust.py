"""Robust aggregation rules against one hostile member: how far each rule's aggregate lands
from the honest members' weighted mean, and what a reduction costs.

5 members with token weights 1..5 over ``--numel`` coordinates: 4 honest deltas (a shared signal
``N(0, 0.01^2)`` plus their own noise ``N(0, 0.01^2)``) and a fifth that is honest (``none``) or hostile:
``nan`` (all NaN), ``huge`` (``N(0, 1e12)``), ``random`` (a random direction of 10x the honest mean's
norm), ``flip`` (-10 x the honest mean). The error is the distance of the aggregate from the honest
members' weighted mean in units of *spread* (the largest distance of an honest delta from that mean).
Rules: ``mean``, ``mean`` with a norm bound of 2, ``trimmed_mean``, ``centered_clip``, and
``centered_clip`` with a norm bound of 2 (:func:`peer.averaging.aggregate`, the function every
reducer runs on its part). Then the milliseconds of one reduction of a 1 Mi-element part with 5
members (one thread), whose ratios between rules matter more than their absolute values.

Run: ``python -m bench.robust [--numel N]``. Keys: ``err_over_spread`` (attack -> rule -> error),
``robust_err_over_spread_max`` (the worst of ``trimmed_mean`` and ``centered_clip`` over the attacks;
the test bound is 0.6), ``ms_per_1m_part_5_members``.
"""

from __future__ import annotations

import argparse
import math
import time

from bench.common import emit, run_main

MEASURES = (
    "bench/robust.py",
    "peer/averaging",
    "peer/compression",
)
"""The code this benchmark's figures depend on: ``python -m bench.report`` marks its results stale
when any of it changed after the commit a result records."""

__all__ = ["main"]

WEIGHTS = (1.0, 2.0, 3.0, 4.0, 5.0)
ATTACKS = ("none", "nan", "huge", "random", "flip")
SEED = 0


def _group(kind: str, n: int):
    """``({peer: (delta, weight)}, honest weighted mean, spread)`` of one 5-member group."""
    import torch

    from peer.compression import weighted_mean

    g = torch.Generator().manual_seed(SEED)
    signal = torch.randn(n, generator=g) * 0.01  # (n,)
    honest = [signal + torch.randn(n, generator=g) * 0.01 for _ in range(4)]
    mean = weighted_mean(honest, list(WEIGHTS[:4]))
    spread = max(float((h - mean).norm()) for h in honest)
    if kind == "none":
        bad = signal + torch.randn(n, generator=g) * 0.01
    elif kind == "nan":
        bad = torch.full((n,), float("nan"))
    elif kind == "huge":
        bad = torch.randn(n, generator=g) * 1e6
    elif kind == "random":
        bad = torch.randn(n, generator=g) * (10 * float(mean.norm()) / math.sqrt(n))
    else:
        bad = -10 * mean
    members = {f"p{i}": (h, WEIGHTS[i]) for i, h in enumerate(honest)}
    members["p4"] = (bad, WEIGHTS[4])
    return members, mean, spread


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench.robust", description=__doc__.split("\n\n")[0])
    ap.add_argument("--numel", type=int, default=65536, help="coordinates of the error test (default 65536)")
    args = ap.parse_args(argv)
    import torch

    from peer.averaging import Aggregation, aggregate

    torch.set_num_threads(1)
    rules = {"mean": Aggregation("mean"), "mean+nb2": Aggregation("mean", 2.0),
             "trimmed_mean": Aggregation("trimmed_mean"), "centered_clip": Aggregation("centered_clip"),
             "centered_clip+nb2": Aggregation("centered_clip", 2.0)}
    errors: dict[str, dict[str, float]] = {}
    for kind in ATTACKS:
        members, mean, spread = _group(kind, args.numel)
        errors[kind] = {name: round(float((aggregate(members, rule).value - mean).norm()) / spread, 3)
                        for name, rule in rules.items()}
    members, _, _ = _group("none", 1 << 20)
    times = {}
    for name, rule in rules.items():
        aggregate(members, rule)
        t0 = time.perf_counter()
        for _ in range(3):
            aggregate(members, rule)
        times[name] = round((time.perf_counter() - t0) / 3 * 1000, 1)
    robust = max(errors[k][r] for k in ATTACKS for r in ("trimmed_mean", "centered_clip"))
    return emit("robust", {"err_over_spread": errors, "robust_err_over_spread_max": robust,
                           "ms_per_1m_part_5_members": times, "numel": args.numel, "members": len(WEIGHTS),
                           "weights": list(WEIGHTS), "threads": 1, "seeds": [SEED]})


if __name__ == "__main__":
    run_main(main)
