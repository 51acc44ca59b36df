"""The goal judged over seeds, against a synchronous baseline tuned at its own batch.

One seed and one learning rate decide too much at these sizes: a point's gap to synchronous training
moves by about as much between seeds as between neighbouring settings, and the synchronous run (one
model at ``workers`` times a worker's batch) was trained at the workers' learning rate. A scale with
``seeds`` and ``sync_lrs`` (:class:`bench.quality_scale.Scale`) adds the ``seeds`` experiment:

- the synchronous baseline at every rate of ``sync_lrs`` (``sync-bytes-lr{lr}``) besides the scale's
  ``lr`` (``sync-bytes``);
- each of those, and each ``seeded`` point, again at every seed of ``seeds`` (``seed{n}/{name}``).

:func:`seeds_summary` keeps the rate whose mean bits per byte over the seeds is lowest, takes each
seeded point's gap to that baseline seed by seed (same seed, same batches, same initial weights), and
judges the goal on the mean gap (``sparse_bpb_gap_mean``), with the spread beside it.
"""

from __future__ import annotations

import statistics
from typing import Any, Sequence

from bench.quality_scale import Scale, seeds_of
from bench.quality_sweeps import Point

__all__ = ["seeded", "sync_name", "seed_points", "seeds_summary", "seeds_table"]


def seeded(name: str, seed: int, scale: Scale) -> str:
    """The name of point ``name`` run at ``seed``: itself at the scale's own seed."""
    return name if seed == scale.seed else f"seed{seed}/{name}"


def sync_name(lr: float, scale: Scale) -> str:
    """The synchronous baseline's point name at inner learning rate ``lr``."""
    return "sync-bytes" if lr == scale.lr else f"sync-bytes-lr{lr:g}"


def _lrs(scale: Scale) -> tuple[float, ...]:
    return (scale.lr, *scale.sync_lrs)


def seed_points(scale: Scale, sparse: list[Point]) -> list[Point]:
    """The ``seeds`` experiment at ``scale``: the synchronous baseline at ``sync_lrs``, then every
    baseline and every seeded point of ``sparse`` (``scale.seeded``, default all) at ``seeds``."""
    if not (scale.seeds or scale.sync_lrs):
        return []
    syncs = [Point(sync_name(lr, scale), "seeds", "sync", {"tokenizer": "bytes", **({} if lr == scale.lr else {"lr": lr})})
             for lr in _lrs(scale)]
    chosen = [p for p in sparse if not scale.seeded or p.name in scale.seeded]
    pts = syncs[1:]  # the scale's own rate at its own seed is the diloco experiment's sync-bytes
    for seed in scale.seeds:
        pts += [Point(seeded(p.name, seed, scale), "seeds", p.runner, {**p.args, "seed": seed}) for p in syncs + chosen]
    return pts


def _mean_spread(values: list[float]) -> dict[str, Any]:
    return {"mean": statistics.fmean(values), "stdev": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values), "n": len(values)}


def seeds_summary(ok: dict[str, dict], scale: Scale, goal_ratio: float, goal_gap: float) -> dict[str, Any]:
    """The ``seeds`` keys from the successful points ``ok`` (name -> result): the synchronous baseline's
    mean bits per byte at each rate whose every seed ran, the rate kept, and for each seeded point
    that ran at every seed its gap to that baseline per seed, their mean and spread, and its bytes
    ratio. ``sparse_bpb_gap_mean`` is the smallest mean gap of a point at >= ``goal_ratio``; the goal
    is met on the mean when it is <= ``goal_gap``. Empty when the scale runs no seeds."""
    if not (scale.seeds or scale.sync_lrs):
        return {}
    seeds = seeds_of(scale)
    by_lr = {lr: [ok[seeded(sync_name(lr, scale), s, scale)] for s in seeds]
             for lr in _lrs(scale) if all(seeded(sync_name(lr, scale), s, scale) in ok for s in seeds)}
    out: dict[str, Any] = {"sync_lrs": list(_lrs(scale)),
                           "sync_bpb_by_lr": {f"{lr:g}": _mean_spread([r["bpb"] for r in rs]) for lr, rs in by_lr.items()}}
    if not by_lr:
        return {**out, "sync_lr_best": None, "seed_points": [], "sparse_bpb_gap_mean": None,
                "sparse_goal_met_on_mean": False}
    best_lr = min(by_lr, key=lambda lr: statistics.fmean(r["bpb"] for r in by_lr[lr]))
    lrs = sorted(by_lr)
    out["sync_lr_best"] = best_lr
    out["sync_lr_best_at_edge"] = len(lrs) > 1 and best_lr in (lrs[0], lrs[-1])
    base = dict(zip(seeds, by_lr[best_lr]))
    rows = []
    for name in sorted({n for n in ok if n.startswith("sparse-bytes-")}):
        runs = {s: ok.get(seeded(name, s, scale)) for s in seeds}
        if any(r is None for r in runs.values()):
            continue
        gaps = {s: (r["bpb"] - base[s]["bpb"]) / base[s]["bpb"] for s, r in runs.items()}
        ratios = [base[s]["bytes_per_worker"] / r["bytes_per_worker"] for s, r in runs.items()]
        rows.append({"name": name, "gap": _mean_spread(list(gaps.values())), "gap_by_seed": {str(s): g for s, g in gaps.items()},
                     "bytes_ratio": statistics.fmean(ratios), "bpb": _mean_spread([r["bpb"] for r in runs.values()])})
    out["seed_points"] = sorted(rows, key=lambda r: r["bytes_ratio"])
    far = [r for r in rows if r["bytes_ratio"] >= goal_ratio]
    best = min(far, key=lambda r: r["gap"]["mean"], default=None)
    out["sparse_mean_point"] = best["name"] if best else None
    out["sparse_bpb_gap_mean"] = best["gap"]["mean"] if best else None
    out["sparse_bpb_gap_stdev"] = best["gap"]["stdev"] if best else None
    out["sparse_bytes_ratio_at_mean_point"] = best["bytes_ratio"] if best else None
    out["sparse_goal_met_on_mean"] = bool(best and best["gap"]["mean"] <= goal_gap)
    return out


def seeds_table(summary: dict[str, Any], seeds: Sequence[int]) -> str:
    """Markdown: the baseline's rates, then each seeded point's mean gap and spread over ``seeds``."""
    if not summary.get("sync_bpb_by_lr"):
        return ""
    lines = [f"\n**Over seeds {', '.join(map(str, seeds))}: synchronous baseline by inner learning rate**\n",
             "| inner lr | mean bpb | stdev | kept |", "|---|---|---|---|"]
    for lr, s in summary["sync_bpb_by_lr"].items():
        kept = "yes" if float(lr) == summary.get("sync_lr_best") else ""
        lines.append(f"| {lr} | {s['mean']:.4f} | {s['stdev']:.4f} | {kept} |")
    if summary.get("seed_points"):
        lines += ["\n| point | bytes ratio | mean gap | stdev | min | max |", "|---|---|---|---|---|---|"]
        for r in summary["seed_points"]:
            g = r["gap"]
            lines.append(f"| {r['name']} | {r['bytes_ratio']:,.0f}x | {100 * g['mean']:+.2f}% | {100 * g['stdev']:.2f}% | "
                         f"{100 * g['min']:+.2f}% | {100 * g['max']:+.2f}% |")
    return "\n".join(lines) + "\n"

