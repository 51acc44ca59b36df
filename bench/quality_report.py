"""Turn the quality sweep's point records into headline figures, Markdown tables and PNG plots.

:func:`summarize` computes the headline keys of ``quality.json`` (``diloco_best_bytes_ratio``,
``diloco_bpb_gap_at_best``, ``dipaco_bpb``, ``dense_p_bpb``, ``dense_2p_bpb``,
``dense_p_equal_compute_bpb``, ``hetero_speedup``) plus what the report needs; a figure whose points
did not run (or failed) is ``None``, never guessed. :func:`tables` renders Markdown, :func:`plot`
writes ``docs/img/quality_*.png`` (matplotlib, Agg backend).

Run ``python -m bench.quality_report`` to print the tables and redraw the plots from
``bench/results/quality.json``.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence

if TYPE_CHECKING:
    from bench.quality_scale import Scale

__all__ = ["summarize", "tables", "plot", "GAP_LIMIT"]

log = logging.getLogger(__name__)

GAP_LIMIT = 0.02
"""A DiLoCo setting counts if its bits per byte is within 2% of synchronous training."""

IMG = Path(__file__).resolve().parent.parent / "docs" / "img"
RESULTS = Path(__file__).resolve().parent / "results"


def _ok(records: Sequence[dict]) -> dict[str, dict]:
    return {r["name"]: r["result"] for r in records if r.get("status") == "ok"}


def _diloco_rows(ok: dict[str, dict], tok: str) -> list[dict]:
    sync = ok.get(f"sync-{tok}")
    rows = []
    for name, res in ok.items():
        if not name.startswith(f"diloco-{tok}-"):
            continue
        h, codec, *outer = name[len(f"diloco-{tok}-"):].split("-")
        row = {"name": name, "H": int(h[1:]), "codec": codec, "outer": "/".join(o[1:] if o[0] == "m" else o[2:]
                                                                            for o in outer) or "0.7/0.9",
               "bpb": res["bpb"], "bytes": res["bytes_per_worker"]}
        if sync is not None:
            row["gap"] = (res["bpb"] - sync["bpb"]) / sync["bpb"]
            row["bytes_ratio"] = sync["bytes_per_worker"] / res["bytes_per_worker"]
        rows.append(row)
    return sorted(rows, key=lambda r: (r["H"], ["none", "fp16", "int8", "int4"].index(r["codec"]), r["outer"]))


def _outer_rows(ok: dict[str, dict]) -> list[dict]:
    """Experiment 4's points; the 0.7 / 0.9 default at H is experiment 1's codec-none point of that H."""
    rows = []
    for name, res in ok.items():
        if name.startswith("outer-H"):
            h, lr, m = name[len("outer-"):].split("-")
            rows.append({"H": int(h[1:]), "lr": float(lr[2:]), "momentum": float(m[1:]), "bpb": res["bpb"]})
    for H in sorted({r["H"] for r in rows}):
        base = ok.get(f"diloco-bytes-H{H}-none")
        if base is not None and not any(r["H"] == H and (r["lr"], r["momentum"]) == (0.7, 0.9) for r in rows):
            rows.append({"H": H, "lr": 0.7, "momentum": 0.9, "bpb": base["bpb"]})
    return sorted(rows, key=lambda r: (r["H"], r["bpb"]))


def _time_to(curve: Sequence[dict], target: float) -> Optional[float]:
    for p in curve:
        if p["bpb"] <= target + 1e-12:
            return float(p["time"])
    return None


def summarize(records: Sequence[dict], scale: Optional["Scale"] = None) -> dict[str, Any]:
    """Headline figures from point records (see the module docstring); with the ``scale`` they ran at,
    the goal over its seeds too (:func:`bench.quality_seeds.seeds_summary`)."""
    ok = _ok(records)
    out: dict[str, Any] = {}
    # 1. DiLoCo against synchronous data-parallel.
    rows = _diloco_rows(ok, "bytes")
    within = [r for r in rows if "gap" in r and r["gap"] <= GAP_LIMIT]
    best = max(within, key=lambda r: r["bytes_ratio"]) if within else None
    out["sync_bpb"] = ok["sync-bytes"]["bpb"] if "sync-bytes" in ok else None
    out["diloco_best_bytes_ratio"] = best["bytes_ratio"] if best else None
    out["diloco_bpb_gap_at_best"] = best["gap"] if best else None
    out["diloco_best_point"] = best["name"] if best else None
    out["diloco_meets_goal"] = bool(best and best["bytes_ratio"] >= 1000)
    closest = min((r for r in rows if "gap" in r), key=lambda r: r["gap"], default=None)
    out["diloco_smallest_gap_point"] = closest["name"] if closest else None
    out["diloco_smallest_gap"] = closest["gap"] if closest else None
    eq = next((v for k, v in ok.items() if k.startswith("equivalence-")), None)
    if eq is not None:
        out["equivalence_max_abs_weight_diff"] = eq["max_abs_weight_diff"]
        out["equivalence_bpb"] = {"simulator": eq["simulator_bpb"], "peer_optimizer": eq["bpb"]}
    for tok in ("bpe",):
        if f"sync-{tok}" in ok:
            out[f"sync_{tok}_bpb"] = ok[f"sync-{tok}"]["bpb"]
            out[f"diloco_{tok}"] = {r["name"]: {"bpb": r["bpb"], "gap": r.get("gap"), "bytes_ratio": r.get("bytes_ratio")}
                                    for r in _diloco_rows(ok, tok)}
    # 2. DiPaCo against dense.
    get = lambda n: ok[n]["bpb"] if n in ok else None  # noqa: E731
    out["dipaco_bpb"] = get("dipaco-2x2")
    out["dense_p_bpb"] = get("dense-p")
    out["dense_2p_bpb"] = get("dense-2p")
    out["dense_p_equal_compute_bpb"] = get("dense-p-equal-compute")
    if out["dipaco_bpb"] is not None and out["dense_p_bpb"] is not None:
        out["dipaco_gain_vs_dense_p"] = 1 - out["dipaco_bpb"] / out["dense_p_bpb"]
        out["dipaco_beats_dense_p_by_10pct"] = out["dipaco_gain_vs_dense_p"] >= 0.10
    if out["dipaco_bpb"] is not None and out["dense_p_equal_compute_bpb"] is not None:
        out["dipaco_matches_equal_compute"] = out["dipaco_bpb"] <= out["dense_p_equal_compute_bpb"]
    if "dipaco-2x2" in ok and "routing" in ok["dipaco-2x2"]:
        r = ok["dipaco-2x2"]["routing"]
        out["dipaco_router_accuracy"] = r["router_accuracy"]
        out["dipaco_bpb_oracle"] = r["bpb_oracle_per_document"]
        out["dipaco_bpb_rerouted"] = r["bpb_rerouted"]
    out["dipaco_sqrt_sharing_bpb"] = get("dipaco-2x2-sqrt")
    out["dipaco_outer_variants_bpb"] = {n: ok[n]["bpb"] for n in sorted(ok) if n.startswith("dipaco-2x2-lr")}
    if out["dipaco_outer_variants_bpb"]:
        name, bpb = min(out["dipaco_outer_variants_bpb"].items(), key=lambda kv: kv[1])
        out["dipaco_best_outer_point"], out["dipaco_best_outer_bpb"] = name, bpb
        if out["dense_p_bpb"] is not None:
            out["dipaco_best_outer_gain_vs_dense_p"] = 1 - bpb / out["dense_p_bpb"]
    # 3. Heterogeneity (simulated wall clock).
    het = {m: ok.get(f"hetero-{m}") for m in ("step", "time", "fast")}
    if all(het.values()):
        target = max(h["bpb"] for h in het.values())
        times = {m: _time_to(h["curve"], target) for m, h in het.items()}
        out["hetero_target_bpb"] = target
        out["hetero_time_to_target"] = times
        out["hetero_speedup"] = times["step"] / times["time"] if times["step"] and times["time"] else None
        out["hetero_time_vs_fastest_three"] = times["time"] / times["fast"] if times["time"] and times["fast"] else None
        out["hetero_meets_goal"] = bool(times["time"] and times["fast"] and times["time"] <= times["fast"])
    else:
        out["hetero_speedup"] = None
    # 4. Outer hyperparameters.
    outer: dict[str, list[dict]] = {}
    for r in _outer_rows(ok):
        outer.setdefault(f"H{r['H']}", []).append(r)
    out["outer_best"] = {h: min(v, key=lambda r: r["bpb"]) for h, v in sorted(outer.items())}
    # 5. Sparse pseudo-gradients; a sparse point that meets the goal is DiLoCo's best too.
    from bench.quality_sparse import sparse_summary

    replicas = RESULTS / "sparse_network.json"
    scale_name = next((r.get("scale") for r in records if r.get("name") == "sync-bytes"), None)
    partial = RESULTS / "quality_sparse_partial.jsonl"
    partial_entries = [e for e in map(json.loads, partial.read_text().splitlines() if partial.exists() else [])
                       if e.get("scale") == scale_name]
    out.update(sparse_summary(ok, rows, json.loads(replicas.read_text()) if replicas.exists() else None,
                              partial_entries))
    if out["sparse_meets_goal"] and out["sparse_best_bytes_ratio"] > (out["diloco_best_bytes_ratio"] or 0):
        out["diloco_best_bytes_ratio"] = out["sparse_best_bytes_ratio"]
        out["diloco_bpb_gap_at_best"] = out["sparse_bpb_gap_at_best"]
        out["diloco_best_point"] = out["sparse_best_point"]
        out["diloco_meets_goal"] = True
    if scale is not None:
        from bench.quality_seeds import seeds_summary
        from bench.quality_sparse import GOAL_GAP, GOAL_RATIO

        out.update(seeds_summary(ok, scale, GOAL_RATIO, GOAL_GAP))
    out["points_ok"] = sorted(ok)
    out["points_failed"] = {r["name"]: r.get("error") for r in records if r.get("status") != "ok"}
    return out


def goal_across_scales(summary: dict, results: Path = RESULTS) -> dict[str, Any]:
    """Where the goal (>= 1000x within 2% of a scale's own synchronous baseline) was met, for the
    report (``quality.json``): this scale (``diloco_best_scale``) when one of its points meets it;
    else the best point of another scale's results file (``quality_SCALE.json``: its own model, steps,
    baseline and run) under ``goal_elsewhere_*`` keys, named by ``goal_elsewhere_file``. This run's
    own ``diloco_*`` keys are never replaced by another file's: the goal is met *here* only when
    ``diloco_meets_goal`` says so."""
    if summary.get("diloco_meets_goal"):
        return {"diloco_best_scale": summary.get("scale_name")}
    best = None
    for path in sorted(results.glob("quality_*.json")):
        try:
            other = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if other.get("diloco_meets_goal") and (best is None or other["diloco_best_bytes_ratio"]
                                               > best[1]["diloco_best_bytes_ratio"]):
            best = (path, other)
    if best is None:
        return {"diloco_best_scale": None}
    path, other = best
    return {"diloco_best_scale": None, "goal_elsewhere_file": path.name,
            "goal_elsewhere_bytes_ratio": other["diloco_best_bytes_ratio"],
            "goal_elsewhere_bpb_gap": other["diloco_bpb_gap_at_best"],
            "goal_elsewhere_point": other["diloco_best_point"]}


def _fmt(x: Any, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def tables(records: Sequence[dict], scale: Optional["Scale"] = None, summary: Optional[dict] = None) -> str:
    """Markdown tables of every experiment that has results (the seeds' with the ``scale``, from
    ``summary``'s seeds keys when :func:`summarize` already computed them)."""
    ok = _ok(records)
    lines: list[str] = []
    for tok in ("bytes", "bpe"):
        if f"sync-{tok}" not in ok:
            continue
        s = ok[f"sync-{tok}"]
        lines += [f"\n**DiLoCo vs synchronous ({tok})**: synchronous {s['bpb']:.3f} bpb, "
                  f"{s['bytes_per_worker'] / 1e9:.2f} GB sent per worker\n",
                  "| H | codec | outer lr/momentum | bpb | gap vs sync | bytes / worker | fewer bytes than sync |",
                  "|---|-------|-------------------|-----|-------------|----------------|-----------------------|"]
        for r in _diloco_rows(ok, tok):
            lines.append(f"| {r['H']} | {r['codec']} | {r['outer']} | {r['bpb']:.3f} | {100 * r['gap']:+.1f}% | "
                         f"{r['bytes'] / 1e6:.1f} MB | {r['bytes_ratio']:,.0f}x |")
    eq = next(((k, v) for k, v in ok.items() if k.startswith("equivalence-")), None)
    if eq is not None:
        k, v = eq
        lines.append(f"\n**Simulator vs peers' DiLoCoOptimizer** ({k}, {v['workers']} workers, {v['rounds']} rounds): "
                     f"bpb {v['simulator_bpb']:.4f} vs {v['bpb']:.4f}, max weight difference {v['max_abs_weight_diff']:.3g}\n")
    names = [("dipaco-2x2", "DiPaCo 2x2, routed"), ("dipaco-2x2-sqrt", "DiPaCo 2x2, sqrt sharing")]
    names += [(n, f"DiPaCo 2x2, outer {n[len('dipaco-2x2-'):]}") for n in sorted(ok) if n.startswith("dipaco-2x2-lr")]
    names += [("dense-p", "dense P, one path's tokens"), ("dense-2p", "dense 2P, one path's tokens"),
              ("dense-p-equal-compute", "dense P, 4x tokens (equal compute)")]
    if any(n in ok for n, _ in names):
        lines += ["\n**DiPaCo vs dense**\n", "| model | params | tokens | bpb |", "|---|---|---|---|"]
        for n, label in names:
            if n in ok:
                r = ok[n]
                params = r.get("params_per_path", r.get("params"))
                lines.append(f"| {label} | {params:,} | {r['tokens']:,} | {r['bpb']:.3f} |")
        routing = ok.get("dipaco-2x2", {}).get("routing")
        if routing:
            lines += ["\n| routing | bpb |", "|---|---|", f"| prefix (first 32 tokens) | {routing['bpb_prefix_routed']:.3f} |"]
            for w, b in routing["bpb_rerouted"].items():
                lines.append(f"| re-route every {w} tokens | {b:.3f} |")
            lines.append(f"| oracle (each document's best path) | {routing['bpb_oracle_per_document']:.3f} |")
            lines.append(f"\nRouter picks the lowest-loss path for {100 * routing['router_accuracy']:.0f}% of documents "
                         f"({100 * routing['router_accuracy_bytes']:.0f}% of bytes).")
            lines += ["\n| path | bpb | train tokens in shard | epochs seen | sources |", "|---|---|---|---|---|"]
            shards = ok["dipaco-2x2"].get("shards", {})
            for p, v in routing["per_path"].items():
                sh = shards.get(p.replace(",", "-"), {})
                src = ", ".join(f"{k} {n:,}" for k, n in sh.get("sources", {}).items())
                lines.append(f"| {p} | {_fmt(v['bpb'])} | {sh.get('train_tokens', 0):,} | {sh.get('epochs_seen', '-')} | {src} |")
    het = [(m, ok.get(f"hetero-{m}")) for m in ("step", "time", "fast")]
    if any(h for _, h in het):
        summ = summarize(records)
        times = summ.get("hetero_time_to_target", {})
        lines += [f"\n**Heterogeneity (simulated clock; unit = one fast inner step)**, target "
                  f"{_fmt(summ.get('hetero_target_bpb'))} bpb\n",
                  "| mode | steps per worker per round | round time | final bpb | time to target |", "|---|---|---|---|---|"]
        label = {"step": "step-bounded, 4 workers", "time": "time-bounded, 4 workers", "fast": "fastest three alone"}
        for m, h in het:
            if h:
                lines.append(f"| {label[m]} | {h['steps_per_round']} | {h['round_time']:g} | {h['bpb']:.3f} | "
                             f"{_fmt(times.get(m), '.0f')} |")
    outer = _outer_rows(ok)
    if outer:
        lines += ["\n**Outer learning rate and momentum (codec none), best first**\n", "| H | lr | momentum | bpb |",
                  "|---|---|---|---|"]
        lines += [f"| {r['H']} | {r['lr']:g} | {r['momentum']:g} | {r['bpb']:.3f} |" for r in outer]
    from bench.quality_sparse import sparse_table

    sparse = sparse_table(ok)
    if sparse:
        lines += ["\n**Sparse pseudo-gradients (top-k per 1024 values, error feedback decayed by 0.95)**\n", sparse]
    if scale is not None:
        from bench.quality_scale import seeds_of
        from bench.quality_seeds import seeds_summary, seeds_table
        from bench.quality_sparse import GOAL_GAP, GOAL_RATIO

        seeds = summary if summary is not None else seeds_summary(ok, scale, GOAL_RATIO, GOAL_GAP)
        lines.append(seeds_table(seeds, seeds_of(scale)))
    failed = [r for r in records if r.get("status") != "ok"]
    if failed:
        lines += ["\n**Failed points**\n"] + [f"- {r['name']}: {r.get('error')}" for r in failed]
    return "\n".join(lines) + "\n"


def plot(records: Sequence[dict], outdir: Path = IMG, prefix: str = "quality") -> list[Path]:
    """Write ``outdir/PREFIX_*.png`` for the experiments that have results; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = _ok(records)
    outdir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    if "sync-bytes" in ok:
        fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
        s = ok["sync-bytes"]
        for ax, key in ((a, "tokens"), (b, "bytes")):
            ax.plot([p[key] for p in s["curve"]], [p["bpb"] for p in s["curve"]], "k-o", label="synchronous", lw=2)
        rows = _diloco_rows(ok, "bytes")
        for r in rows:
            curve = ok[r["name"]]["curve"]
            style = {"none": "-", "fp16": "--", "int8": "-.", "int4": ":"}[r["codec"]]
            label = f"H={r['H']} {r['codec']}" + ("" if r["outer"] == "0.7/0.9" else f" outer {r['outer']}")
            # against tokens, a large grid shows only none and int4 at the default outer step (readable)
            if len(rows) <= 6 or (r["codec"] in ("none", "int4") and r["outer"] == "0.7/0.9"):
                a.plot([p["tokens"] for p in curve], [p["bpb"] for p in curve], style, label=label)
            b.plot([p["bytes"] for p in curve], [p["bpb"] for p in curve], style, label=label)
        a.set(xlabel="tokens (all workers)", ylabel="validation bits per byte", title="DiLoCo vs synchronous, K=4")
        b.set(xscale="log", xlabel="bytes sent per worker", ylabel="validation bits per byte",
              title="against bytes exchanged")
        a.legend(fontsize=7)
        b.legend(fontsize=6, ncol=2)
        written.append(_save(fig, outdir / f"{prefix}_diloco.png"))
    dense = [n for n in ("dipaco-2x2", "dense-p", "dense-2p", "dense-p-equal-compute") if n in ok]
    dense += [n for n in sorted(ok) if n.startswith("dipaco-2x2-")]
    if dense:
        fig, ax = plt.subplots(figsize=(6.5, 4.5))
        for n in dense:
            ax.plot([p["tokens"] for p in ok[n]["curve"]], [p["bpb"] for p in ok[n]["curve"]], "-o", ms=3, label=n)
        ax.set(xlabel="tokens (whole run)", ylabel="validation bits per byte", title="DiPaCo 2x2 vs dense")
        ax.legend(fontsize=8)
        written.append(_save(fig, outdir / f"{prefix}_dipaco.png"))
    het = {m: ok[f"hetero-{m}"] for m in ("step", "time", "fast") if f"hetero-{m}" in ok}
    if het:
        fig, ax = plt.subplots(figsize=(6.5, 4.5))
        for m, h in het.items():
            ax.plot([p["time"] for p in h["curve"]], [p["bpb"] for p in h["curve"]], "-o", ms=3, label=m + "-bounded"
                    if m != "fast" else "fastest three alone")
        ax.set(xlabel="simulated wall clock (fast-worker inner steps)", ylabel="validation bits per byte",
               title="one worker 4x slower (simulated)")
        ax.legend(fontsize=8)
        written.append(_save(fig, outdir / f"{prefix}_hetero.png"))
    from bench.quality_sparse import sparse_plot

    sparse = sparse_plot(ok, _diloco_rows(ok, "bytes"), outdir / f"{prefix}_sparse.png")
    if sparse is not None:
        written.append(sparse)
    return written


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Print the tables and redraw the plots from a quality.json (default bench/results/quality.json)."""
    args = list(argv if argv is not None else sys.argv[1:])
    src = Path(args[0]) if args else Path(__file__).resolve().parent / "results" / "quality.json"
    records = json.loads(src.read_text())["points"]
    sys.stdout.write(tables(records))
    for p in plot(records, prefix=src.stem):
        sys.stdout.write(f"wrote {p}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
