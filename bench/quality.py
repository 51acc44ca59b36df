"""Training quality on real text: DiLoCo vs synchronous, DiPaCo vs dense, heterogeneity,
outer hyperparameters, on the built-in corpus.

Run: ``python -m bench.quality [--quick] [--only diloco,dipaco,hetero,outer,sparse,seeds] [--jobs N]``.

Prepares the built-in corpus for a 2x2 lattice (byte-level, and BPE 4096 for the full grid) under
``data/quality-*`` once, runs every point of the chosen experiments (``bench.quality_sweeps``) with
fixed seeds (the goal's points at the scale's further seeds too, against a synchronous baseline
tuned over inner learning rates: ``bench.quality_seeds``), appends each point's record to ``bench/results/quality_points.jsonl`` as it finishes
with its reuse key (:func:`point_key`: the point, its scale and device, and a hash of the code a point
runs), then writes ``bench/results/quality.json`` (every point of the grid recorded under its current
key, plus the headline figures of ``bench.quality_report.summarize``) and the plots
``docs/img/quality_*.png``. A rerun skips a point only when a record under the same key exists, so a
point recorded by other code or another configuration runs again; ``--fresh`` reruns them all.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Optional, Sequence

from bench.common import RESULTS, code_hash, emit, run_main
from bench.quality_report import plot, summarize, tables
from bench.quality_scale import SCALES, Scale, grid_fields, seeds_of
from bench.quality_sweeps import EXPERIMENTS, Point, grid, run_points, scale_by_name
from models import strict_json

MEASURES = (
    "bench/quality.py",
    "bench/quality_equivalence.py",
    "bench/quality_eval.py",
    "bench/quality_report.py",
    "bench/quality_runs.py",
    "bench/quality_scale.py",
    "bench/quality_seeds.py",
    "bench/quality_sparse.py",
    "bench/quality_sweeps.py",
    "models",
    "peer/averaging",
    "peer/compression",
    "peer/diloco",
    "peer/outer",
    "peer/simulator",
)
"""The code this benchmark's figures depend on: ``python -m bench.report`` marks its results stale
when any of it changed after the commit a result records."""

POINT_CODE = tuple(p for p in MEASURES if p not in ("bench/quality.py", "bench/quality_report.py"))
"""The code one point runs (all of :data:`MEASURES` but the summary and plots): a stored point is
reused only while its hash is unchanged."""

__all__ = ["main", "prepare_data", "load_records", "point_key"]

log = logging.getLogger(__name__)

DATA = Path(__file__).resolve().parent.parent / "data"
TOKENIZERS = {"bytes": "bytes", "bpe": "bpe:4096"}


def prepare_data(tokenizers: Sequence[str], root: Path = DATA) -> dict[str, str]:
    """``{name: directory}`` of the built-in corpus prepared for a 2x2 lattice, preparing it once."""
    from models.corpus import default_corpus
    from models.data import prepared

    dirs = {}
    for name in tokenizers:
        spec = TOKENIZERS[name]
        d = root / f"quality-{spec.replace(':', '')}"
        def corpus(spec=spec, d=d):
            log.info("preparing the built-in corpus (%s) into %s", spec, d)
            return default_corpus()

        prepared(d, 2, 2, spec, corpus=corpus)
        dirs[name] = str(d)
    return dirs


GRID_FIELDS = grid_fields()
"""The fields of a :class:`~bench.quality_scale.Scale` that only say which points the grid holds
(marked so where the field is declared): a point's key leaves them out, so that adding a point to a
grid does not run the others again."""


def point_key(point: Point, scale: Scale, device: str, code: str) -> str:
    """The key a point's record is stored and reused under: a hash of the point (runner and
    arguments), its scale (but the :data:`GRID_FIELDS`), the device and ``code``
    (:func:`bench.common.code_hash` of :data:`POINT_CODE`). Any change to one of them is another key:
    the point runs again."""
    sizes = {k: v for k, v in asdict(scale).items() if k not in GRID_FIELDS}
    config = {"point": point.to_dict(), "scale": sizes, "device": device, "code": code}
    return hashlib.sha256(strict_json.dumps(config, sort_keys=True).encode()).hexdigest()


def load_records(path: Path, keys: dict[str, str]) -> dict[str, dict]:
    """The latest record of each point in a records file (JSON lines) whose ``key`` is the one
    ``keys`` (``{point name: point_key}``) holds for it now; records of other points, scales, devices
    or code are not reused."""
    out: dict[str, dict] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                if rec.get("name") in keys and rec.get("key") == keys[rec["name"]]:
                    out[rec["name"]] = rec
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.quality", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the reduced grid (a 2-core CPU, under an hour)")
    ap.add_argument("--scale", choices=sorted(SCALES), help="scale preset (default full; --quick = quick)")
    ap.add_argument("--only", default="", help=f"comma-separated experiments of {','.join(EXPERIMENTS)}")
    ap.add_argument("--points", default="", help="comma-separated point names to run (default: all of the grid)")
    ap.add_argument("--jobs", type=int, default=1, help="points run at once in worker processes (default 1)")
    ap.add_argument("--device", default="auto", help="auto (CUDA if available), cpu or cuda")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads in this process (default 1)")
    ap.add_argument("--records", type=Path, default=RESULTS / "quality_points.jsonl", help="per-point records file")
    ap.add_argument("--fresh", action="store_true", help="rerun points already recorded")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    import torch

    torch.set_num_threads(args.threads)
    scale = scale_by_name(args.scale or ("quick" if args.quick else "full"))
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    only = [e for e in args.only.split(",") if e]
    points = grid(scale, only or None)
    if args.points:
        wanted = set(args.points.split(","))
        points = [p for p in points if p.name in wanted]
    code = code_hash(POINT_CODE)
    keys = {p.name: point_key(p, scale, device, code) for p in grid(scale)}
    records = load_records(args.records, keys)
    todo = [p for p in points if args.fresh or records.get(p.name, {}).get("status") != "ok"]
    data_dirs = prepare_data(sorted({"bytes"} | {p.args.get("tokenizer", "bytes") for p in points}))
    log.info("%s scale: %d point(s) to run (%d already recorded), %d job(s) on %s",
             scale.name, len(todo), len(points) - len(todo), args.jobs, device)
    args.records.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()

    def on_result(rec: dict) -> None:
        rec = {**rec, "scale": scale.name, "device": device, "key": keys[rec["name"]]}
        records[rec["name"]] = rec
        with args.records.open("a") as f:
            f.write(strict_json.dumps(rec, sort_keys=True) + "\n")
        bpb = rec.get("result", {}).get("bpb")
        log.info("%s %s in %ss%s", rec["name"], rec["status"], rec["seconds"],
                 f": {bpb:.4f} bpb" if bpb is not None else f" ({rec.get('error')})")

    run_points(todo, scale, data_dirs, device=device, jobs=args.jobs, on_result=on_result)
    ordered = [records[n] for n in sorted(records)]
    summary = summarize(ordered, scale)
    # quick and full are the report's quality.json; other scales write quality_SCALE.json and their own plots.
    name = "quality" if scale.name in ("quick", "full") else f"quality_{scale.name}"
    for p in plot(ordered, prefix=name):
        log.info("wrote %s", p)
    sys.stderr.write(tables(ordered, scale, summary))
    if name == "quality":  # the report: where the goal was met, this scale or another (named apart)
        from bench.quality_report import goal_across_scales

        summary.update(goal_across_scales({**summary, "scale_name": scale.name}))
    emit(name, {**summary, "scale": asdict(scale), "device": device, "seeds": list(seeds_of(scale)),
                "code_hash": code, "seconds_this_invocation": round(time.monotonic() - start, 1),
                "points_run_this_invocation": [p.name for p in todo],
                "points_not_run": sorted(p.name for p in grid(scale) if p.name not in records),
                "points": ordered})
    return 0 if all(r.get("status") == "ok" for r in ordered) else 1


if __name__ == "__main__":
    run_main(main)
