"""The quality grid as named points, and the harness that runs them and records every outcome.

A :class:`Point` names one training run (its experiment, its runner and the runner's arguments).
:func:`grid` lists the points of the experiments at a :class:`~bench.quality_scale.Scale`;
:func:`run_points` runs them, in this process or in a pool of worker processes, and returns one
result per point in the given order. A point that raises is recorded with ``status: "failed"`` and
its error; it is never dropped, so a report can say what did not run.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import multiprocessing
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional, Sequence

from bench.quality_scale import SCALES, Scale

__all__ = ["EXPERIMENTS", "Point", "grid", "run_point", "run_points", "load_context", "scale_by_name"]

log = logging.getLogger(__name__)

EXPERIMENTS = ("diloco", "dipaco", "hetero", "outer", "sparse", "seeds")
"""The four dense experiments, in order, then the sparse codecs, then the goal's points at more seeds
against a tuned synchronous baseline (:mod:`bench.quality_seeds`; empty unless the scale has seeds)."""


@dataclass(frozen=True)
class Point:
    """One training run: ``runner`` is a ``bench.quality_runs.run_*`` name, ``args`` its keyword arguments."""

    name: str
    experiment: str
    runner: str
    args: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _diloco_points(s: Scale) -> list[Point]:
    pts = [Point("sync-bytes", "diloco", "sync", {"tokenizer": "bytes"})]
    for H, codec in s.diloco_grid:
        pts.append(Point(f"diloco-bytes-H{H}-{codec}", "diloco", "diloco",
                         {"tokenizer": "bytes", "inner_steps": H, "codec": codec}))
    for H, codec, lr, mom in s.diloco_tuned:
        pts.append(Point(f"diloco-bytes-H{H}-{codec}-lr{lr:g}-m{mom:g}", "diloco", "diloco",
                         {"tokenizer": "bytes", "inner_steps": H, "codec": codec, "outer_lr": lr,
                          "outer_momentum": mom}))
    H, rounds = s.equivalence
    pts.append(Point(f"equivalence-bytes-H{H}-int8", "diloco", "equivalence",
                     {"tokenizer": "bytes", "inner_steps": H, "rounds": rounds, "codec": "int8"}))
    if s.bpe_grid:
        pts.append(Point("sync-bpe", "diloco", "sync", {"tokenizer": "bpe"}))
        for H, codec in s.bpe_grid:
            pts.append(Point(f"diloco-bpe-H{H}-{codec}", "diloco", "diloco",
                             {"tokenizer": "bpe", "inner_steps": H, "codec": codec}))
    return pts


def _dipaco_points(s: Scale) -> list[Point]:
    H = s.hetero_h
    return [
        Point("dipaco-2x2", "dipaco", "dipaco", {"inner_steps": H, "codec": "int8"}),
        Point("dense-p", "dipaco", "dense", {"blocks": s.blocks_per_module, "token_multiple": 1}),
        Point("dense-2p", "dipaco", "dense", {"blocks": 2 * s.blocks_per_module, "token_multiple": 1}),
        Point("dense-p-equal-compute", "dipaco", "dense", {"blocks": s.blocks_per_module, "token_multiple": 4}),
    ]


def _hetero_points(s: Scale) -> list[Point]:
    return [Point(f"hetero-{mode}", "hetero", "hetero", {"mode": mode, "inner_steps": s.hetero_h})
            for mode in ("step", "time", "fast")]


def _outer_points(s: Scale) -> list[Point]:
    pts = []
    for H in s.outer_H:
        if (H, s.outer_codec) not in s.diloco_grid:
            pts.append(Point(f"outer-H{H}-lr0.7-m0.9", "outer", "diloco",
                             {"tokenizer": "bytes", "inner_steps": H, "codec": s.outer_codec}))
        for lr, mom in s.outer_grid:
            pts.append(Point(f"outer-H{H}-lr{lr:g}-m{mom:g}", "outer", "diloco",
                             {"tokenizer": "bytes", "inner_steps": H, "codec": s.outer_codec, "outer_lr": lr,
                              "outer_momentum": mom}))
    if s.outer_H or s.outer_grid:
        pts.append(Point("dipaco-2x2-sqrt", "outer", "dipaco",
                         {"inner_steps": s.hetero_h, "codec": "int8", "sqrt_sharing": True, "routing": False}))
    for lr, mom in s.dipaco_outer_grid:
        pts.append(Point(f"dipaco-2x2-lr{lr:g}-m{mom:g}", "outer", "dipaco",
                         {"inner_steps": s.hetero_h, "codec": "int8", "outer_lr": lr, "outer_momentum": mom,
                          "routing": False}))
    return pts


def _sparse_points(s: Scale) -> list[Point]:
    return [Point(f"sparse-bytes-H{H}-{codec}-lr{lr:g}-m{mom:g}", "sparse", "sparse",
                  {"tokenizer": "bytes", "inner_steps": H, "codec": codec, "outer_lr": lr, "outer_momentum": mom})
            for H, codec, lr, mom in s.sparse_grid]


def _seed_points(s: Scale) -> list[Point]:
    from bench.quality_seeds import seed_points

    return seed_points(s, _sparse_points(s))


_GRIDS: dict[str, Callable[[Scale], list[Point]]] = {
    "diloco": _diloco_points, "dipaco": _dipaco_points, "hetero": _hetero_points, "outer": _outer_points,
    "sparse": _sparse_points, "seeds": _seed_points,
}


def grid(scale: Scale, only: Optional[Sequence[str]] = None) -> list[Point]:
    """Every point of the experiments in ``only`` (default: all of them) at ``scale``."""
    chosen = list(only) if only else list(EXPERIMENTS)
    unknown = [e for e in chosen if e not in _GRIDS]
    if unknown:
        raise ValueError(f"unknown experiment(s) {', '.join(unknown)}; choose from {', '.join(EXPERIMENTS)}")
    points = [p for e in EXPERIMENTS if e in chosen for p in _GRIDS[e](scale)]
    rank = {name: i for i, name in enumerate(scale.priority)}
    return sorted(points, key=lambda p: rank.get(p.name, len(rank)))  # stable: grid order after the priorities


# -- running --------------------------------------------------------------------------------------

_CTX = None  # the RunContext of a worker process, built once by _init_worker


def load_context(scale: Scale, data_dirs: dict[str, str], device: str = "cpu", threads: int = 1):
    """Open the prepared datasets and build the fixed evaluation sets (imports torch)."""
    import torch

    from bench.quality_eval import EvalSet
    from bench.quality_runs import RunContext
    from models.data import Dataset

    torch.set_num_threads(threads)
    datasets = {name: Dataset(d) for name, d in data_dirs.items()}
    evalsets = {name: EvalSet.from_dataset(ds, scale.eval_docs, scale.eval_tokens) for name, ds in datasets.items()}
    return RunContext(scale=scale, datasets=datasets, device=torch.device(device), evalsets=evalsets)


def run_point(ctx, point: Point) -> dict[str, Any]:
    """Run one point; any exception becomes a ``failed`` record naming the error (never raised)."""
    from bench import quality_equivalence, quality_runs, quality_sparse

    start = time.monotonic()
    record: dict[str, Any] = {"point": point.to_dict(), "name": point.name, "experiment": point.experiment}
    try:
        runner = (getattr(quality_runs, f"run_{point.runner}", None)
                  or getattr(quality_equivalence, f"run_{point.runner}", None)
                  or getattr(quality_sparse, f"run_{point.runner}", None))
        if runner is None:
            raise ValueError(f"unknown runner '{point.runner}'")
        record["result"] = runner(ctx, **point.args)
        record["status"] = "ok"
    except Exception as e:  # a failed point is data, not a crash of the sweep
        record["status"] = "failed"
        record["error"] = f"{type(e).__name__}: {e}"
        record["traceback"] = traceback.format_exc(limit=6)
        log.warning("point %s failed: %s", point.name, record["error"])
    record["seconds"] = round(time.monotonic() - start, 2)
    return record


def _init_worker(scale: dict, data_dirs: dict[str, str], device: str) -> None:
    global _CTX
    _CTX = load_context(Scale(**_tuples(scale)), data_dirs, device, threads=1)


def _tuples(scale: dict) -> dict:
    return {k: tuple(tuple(x) if isinstance(x, list) else x for x in v) if isinstance(v, list) else v
            for k, v in scale.items()}


def _run_in_worker(point: dict) -> dict[str, Any]:
    return run_point(_CTX, Point(**point))


def run_points(points: Sequence[Point], scale: Scale, data_dirs: dict[str, str], device: str = "cpu",
               jobs: int = 1, on_result: Optional[Callable[[dict], None]] = None) -> list[dict[str, Any]]:
    """Run ``points`` (``jobs`` at a time in spawned processes when ``jobs > 1``); one record per point,
    in order. A worker process that dies marks its point failed."""
    results: dict[str, dict] = {}

    def done(record: dict) -> None:
        results[record["name"]] = record
        if on_result is not None:
            on_result(record)

    if jobs <= 1:
        ctx = load_context(scale, data_dirs, device)
        for p in points:
            done(run_point(ctx, p))
    else:
        mp = multiprocessing.get_context("spawn")
        order = list(points)  # submitted (and started) in the given order
        pool = cf.ProcessPoolExecutor(jobs, mp_context=mp, initializer=_init_worker,
                                      initargs=(asdict(scale), dict(data_dirs), device))
        try:
            futures = {pool.submit(_run_in_worker, p.to_dict()): p for p in order}
            for fut in cf.as_completed(futures):
                p = futures[fut]
                try:
                    done(fut.result())
                except Exception as e:  # the worker process died (or could not start)
                    done({"point": p.to_dict(), "name": p.name, "experiment": p.experiment, "status": "failed",
                          "error": f"{type(e).__name__}: {e}", "seconds": None})
        except BaseException:
            # stopped (SIGINT, SIGTERM and SIGHUP arrive as KeyboardInterrupt, bench.common.run_main): the
            # points not begun are dropped and the workers stopped now, where leaving the pool with a
            # plain shutdown would first run every queued point to its end
            pool.shutdown(wait=False, cancel_futures=True)
            for worker in multiprocessing.active_children():
                worker.terminate()
            raise
        pool.shutdown(wait=True)
    return [results[p.name] for p in points]


def scale_by_name(name: str) -> Scale:
    if name not in SCALES:
        raise ValueError(f"unknown scale '{name}'; choose from {', '.join(SCALES)}")
    return SCALES[name]()

