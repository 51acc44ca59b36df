"""The sparse points of the quality sweeps: top-k pseudo-gradients at short horizons.

:func:`run_sparse` trains DiLoCo on the dense model with a sparse codec (``topk{K}b{B}``,
:mod:`peer.compression.sparse`: per-chunk top-k, 2 or 4 bits, error feedback decayed by 0.95) and,
as in SparseLoCo (Sarfi et al. 2025), no outer momentum by default: the decayed residual plays its part.

Bytes are counted on the wire, never estimated: every round, each module is cut into segments and
parts exactly as :mod:`peer.averaging.allreduce` cuts it for a group of equal-bandwidth members
(:func:`~peer.averaging.partition.segment_bounds`, :func:`~peer.averaging.partition.part_bounds`);
member ``i`` sends its encoded parts to the other reducers and, as the reducer of part ``i``, the
encoded average of that part (:func:`peer.averaging.encode_aggregate` of the round's real
contributions: gathered contributions or the exact union, whichever is smaller) to the other members.
Positions, scales, tags and weights are all in those bytes. ``bytes_per_worker`` is the mean over
members of what each sends, comparable to the synchronous baseline's ring all-reduce
(``bench.quality_runs.allreduce_bytes`` of the fp32 gradient, every step).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Optional

from bench.common import RESULTS
from bench.quality_runs import RunContext, dense_bpb, make_config, seed_batches
from peer.averaging import Reduced, encode_aggregate
from peer.averaging.partition import part_bounds, segment_bounds
from peer.simulator import DiLoCoSimulator

__all__ = ["run_sparse", "round_wire_bytes", "sparse_rows", "sparse_summary", "sparse_table", "sparse_plot",
           "GOAL_RATIO", "GOAL_GAP"]


def round_wire_bytes(sim: DiLoCoSimulator, module_id: str) -> dict[str, float]:
    """Bytes each member sent in ``module_id``'s last round (up: parts to reducers; down: averages of
    its own part to the others), averaged over members, and how many parts went out gathered."""
    contributions, reduced = sim.last_exchange[module_id]
    members = sorted(contributions)
    k = len(members)
    if k < 2:
        return {"up": 0.0, "down": 0.0, "parts": 0, "gathered": 0}
    numel = reduced.value.numel()
    up = down = 0
    parts = gathered = 0
    for s0, s1 in segment_bounds(numel):
        for j, (a, b) in enumerate(part_bounds(s1 - s0, [1.0] * k)):
            if b <= a:
                continue
            a, b = s0 + a, s0 + b
            up += (k - 1) * sim.codec.encoded_size(b - a)  # every member but reducer j sends its part j
            part = Reduced(reduced.value[a:b], reduced.used)
            reply = encode_aggregate(sim.codec, part, {p: (v[a:b], w) for p, (v, w) in contributions.items()},
                                     sim.aggregation)
            down += (k - 1) * len(reply)
            parts += 1
            gathered += int(reply[:1] == b"\x01")
    return {"up": up / k, "down": down / k, "parts": parts, "gathered": gathered}


PARTIAL = RESULTS / "quality_sparse_partial.jsonl"
"""Each evaluation of a sparse point as it happens (scale, point arguments, curve entry): a point cut
short (a 2-core machine shared with other work) still leaves its curve, to compare with the synchronous
curve at equal inner steps."""


def _partial(ctx: RunContext, name: str, entry: dict) -> None:
    from models import strict_json

    if ctx.scale.name == "tiny":  # the harness test's scale: nothing of it goes into bench/results
        return
    rec = {"scale": ctx.scale.name, "name": name, **entry}
    with PARTIAL.open("a") as f:
        f.write(strict_json.dumps(rec, sort_keys=True) + "\n")


def run_sparse(ctx: RunContext, tokenizer: str = "bytes", workers: int = 4, inner_steps: int = 16,
               codec: str = "topk16b2", outer_lr: float = 1.0, outer_momentum: float = 0.0,
               seed: Optional[int] = None) -> dict[str, Any]:
    """DiLoCo with a sparse codec: ``workers`` simulated workers, outer step every ``inner_steps``,
    bytes counted from the encoded messages of every round; ``seed`` replaces the scale's."""
    s = ctx.scale
    cfg = make_config(ctx, tokenizer, inner_steps=inner_steps, codec=codec, outer_lr=outer_lr,
                      outer_momentum=outer_momentum, steps=s.steps, seed=seed)
    ds = ctx.dataset(tokenizer)
    sim = DiLoCoSimulator(cfg, [(0,)], workers, seed_batches(ds, cfg, dense=True), device=ctx.device)
    from bench.quality_runs import _checkpoints
    from bench.quality_seeds import seeded

    name = seeded(f"sparse-bytes-H{inner_steps}-{codec}-lr{outer_lr:g}-m{outer_momentum:g}", cfg.seed, s)

    marks = sorted(_checkpoints(s.steps, s.evals))
    curve: list[dict] = []
    done = tokens = 0
    sent = up = down = 0.0
    parts = gathered = 0
    while done < s.steps:
        n = min(inner_steps, s.steps - done)
        stats = sim.inner_steps(n)
        sim.outer_step(stats.tokens)
        for mid in sim.module_ids:
            w = round_wire_bytes(sim, mid)
            up, down = up + w["up"], down + w["down"]
            parts, gathered = parts + w["parts"], gathered + w["gathered"]
        sent = up + down
        done += n
        tokens += sum(stats.tokens)
        if marks and done >= marks[0]:
            while marks and done >= marks[0]:
                marks.pop(0)
            curve.append({"step": done, "tokens": tokens, "bytes": sent,
                          "bpb": dense_bpb(ctx, sim.global_model().path_model((0,)), tokenizer)})
            _partial(ctx, name, curve[-1])
    return {"bpb": curve[-1]["bpb"], "tokens": tokens, "bytes_per_worker": sent, "bytes_up": up, "bytes_down": down,
            "parts_gathered": gathered, "parts": parts, "params": cfg.lattice.total_param_count(),
            "module_numels": {m: cfg.lattice.module_param_count(m) for m in sim.module_ids},
            "rounds": sim.round_no, "curve": curve}


# -- report -----------------------------------------------------------------------------------------

GOAL_RATIO = 1000.0
"""The goal: at least this many times fewer bytes than synchronous training ..."""
GOAL_GAP = 0.02
"""... within this relative gap in bits per byte (at equal inner steps)."""


def sparse_rows(ok: dict[str, dict]) -> list[dict]:
    """The sparse points against ``sync-bytes``: H, codec, k, bits, bytes ratio, gap (sorted by ratio)."""
    from models.sparse_spec import sparse_spec

    sync = ok.get("sync-bytes")
    rows = []
    for name, res in ok.items():
        if not name.startswith("sparse-bytes-"):
            continue
        h, codec, lr, mom = name[len("sparse-bytes-"):].split("-")
        spec = sparse_spec(codec)
        row = {"name": name, "H": int(h[1:]), "codec": codec, "k_percent": 100 * spec.density, "bits": spec.bits,
               "outer": f"{lr[2:]}/{mom[1:]}", "bpb": res["bpb"], "bytes": res["bytes_per_worker"],
               "parts_gathered": res.get("parts_gathered"), "parts": res.get("parts")}
        if sync is not None:
            row["gap"] = (res["bpb"] - sync["bpb"]) / sync["bpb"]
            row["bytes_ratio"] = sync["bytes_per_worker"] / res["bytes_per_worker"]
        rows.append(row)
    return sorted(rows, key=lambda r: (r.get("bytes_ratio", 0.0), r["name"]))


def _at_step(curve: list[dict], step: int, key: str = "bpb") -> Optional[float]:
    """``key`` of ``curve`` at ``step``: exact where it was evaluated there, else linear between the
    evaluations either side; None outside the curve."""
    pts = sorted((p["step"], p[key]) for p in curve)
    for (s0, v0), (s1, v1) in zip(pts, pts[1:]):
        if s0 <= step <= s1:
            return v0 if step == s0 else v1 if step == s1 else v0 + (v1 - v0) * (step - s0) / (s1 - s0)
    return pts[0][1] if pts and pts[0][0] == step else None


def partial_rows(ok: dict[str, dict], partial: list[dict]) -> list[dict]:
    """Sparse points cut short, from :data:`PARTIAL` (one scale's entries): each one's last evaluation,
    its gap to synchronous training at the same inner step (the synchronous curve interpolated
    linearly between its evaluations when it was not evaluated at that step: ``sync_interpolated``),
    and the same for every int4 DiLoCo point."""
    sync = ok.get("sync-bytes")
    if sync is None:
        return []
    last: dict[str, dict] = {}
    for entry in partial:  # the scale's own seed only (a point at another seed is named seed{n}/...)
        if entry["name"].startswith("sparse-bytes-") and entry["name"] not in ok and entry["step"] >= last.get(entry["name"], {"step": -1})["step"]:
            last[entry["name"]] = entry
    rows = []
    for name, e in sorted(last.items()):
        s_bpb = _at_step(sync["curve"], e["step"])
        if s_bpb is None:
            continue
        s_bytes = _at_step(sync["curve"], e["step"], "bytes")
        h, codec = name[len("sparse-bytes-"):].split("-")[:2]
        int4 = {}
        for n, r in ok.items():
            v = _at_step(r["curve"], e["step"]) if n.startswith("diloco-bytes-") and "-int4" in n else None
            if v is not None:
                int4[n] = {"gap": (v - s_bpb) / s_bpb, "bytes_ratio": sync["bytes_per_worker"] / r["bytes_per_worker"]}
        rows.append({"name": name, "H": int(h[1:]), "codec": codec, "step": e["step"], "bpb": e["bpb"],
                     "sync_bpb": s_bpb, "sync_interpolated": all(p["step"] != e["step"] for p in sync["curve"]),
                     "gap": (e["bpb"] - s_bpb) / s_bpb, "bytes_ratio": s_bytes / e["bytes"], "int4_at_step": int4})
    return rows


def sparse_summary(ok: dict[str, dict], dense_rows: list[dict], replicas: Optional[dict],
                   partial: Optional[list[dict]] = None) -> dict[str, Any]:
    """The sparse keys: the best sparse point within the goal's gap, the int4 codec at the nearest
    byte budget, the replicas' largest difference over the peer-path run (``bench.sparse_network``)."""
    rows = [r for r in sparse_rows(ok) if "gap" in r]
    out: dict[str, Any] = {"sparse_points": rows}
    within = [r for r in rows if r["gap"] <= GOAL_GAP]
    best = max(within, key=lambda r: r["bytes_ratio"]) if within else None
    out["sparse_best_bytes_ratio"] = best["bytes_ratio"] if best else None
    out["sparse_bpb_gap_at_best"] = best["gap"] if best else None
    out["sparse_best_point"] = best["name"] if best else None
    out["sparse_meets_goal"] = bool(best and best["bytes_ratio"] >= GOAL_RATIO)
    far = [r for r in rows if r["bytes_ratio"] >= GOAL_RATIO]
    closest = min(far or rows, key=lambda r: r["gap"], default=None)
    out["sparse_smallest_gap_at_1000x_point"] = closest["name"] if closest and far else None
    out["sparse_smallest_gap_at_1000x"] = closest["gap"] if closest and far else None
    ref = best or closest
    int4 = [r for r in dense_rows if r["codec"] == "int4" and "bytes_ratio" in r]
    if ref is not None and int4:
        near = min(int4, key=lambda r: (abs(math.log(r["bytes_ratio"] / ref["bytes_ratio"])), r["gap"]))
        out["int4_bpb_gap_at_same_bytes"] = near["gap"]
        out["int4_point_at_same_bytes"] = near["name"]
        out["int4_bytes_ratio_at_same_bytes"] = near["bytes_ratio"]
        out["sparse_point_compared_with_int4"] = ref["name"]
    else:
        out["int4_bpb_gap_at_same_bytes"] = None
    out["replica_max_abs_diff"] = replicas.get("replica_max_abs_diff") if replicas else None
    cut = partial_rows(ok, partial or [])
    out["sparse_partial_points"] = cut
    if not rows and cut:  # no sparse point finished: the keys from the curves of those cut short
        out["sparse_keys_from"] = "partial curves (gap to synchronous training at the same inner step)"
        within = [r for r in cut if r["gap"] <= GOAL_GAP]
        best = max(within, key=lambda r: r["bytes_ratio"]) if within else None
        out["sparse_best_bytes_ratio"] = best["bytes_ratio"] if best else None
        out["sparse_bpb_gap_at_best"] = best["gap"] if best else None
        out["sparse_best_point"] = best["name"] if best else None
        far = [r for r in cut if r["bytes_ratio"] >= GOAL_RATIO]
        closest = min(far, key=lambda r: r["gap"], default=None)
        out["sparse_smallest_gap_at_1000x_point"] = closest["name"] if closest else None
        out["sparse_smallest_gap_at_1000x"] = closest["gap"] if closest else None
        ref = best or closest or min(cut, key=lambda r: r["gap"])
        if ref["int4_at_step"]:
            name, near = min(ref["int4_at_step"].items(),
                             key=lambda kv: (abs(math.log(kv[1]["bytes_ratio"] / ref["bytes_ratio"])), kv[1]["gap"]))
            out["int4_bpb_gap_at_same_bytes"] = near["gap"]
            out["int4_point_at_same_bytes"] = name
            out["int4_bytes_ratio_at_same_bytes"] = near["bytes_ratio"]
            out["sparse_point_compared_with_int4"] = ref["name"]
    return out


def sparse_table(ok: dict[str, dict]) -> str:
    rows = sparse_rows(ok)
    if not rows:
        return ""
    lines = ["| H | codec | kept | bits | outer lr/momentum | bpb | gap to sync | bytes ratio | parts gathered |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        gap = f"{100 * r['gap']:+.2f}%" if "gap" in r else "-"
        ratio = f"{r['bytes_ratio']:,.0f}x" if "bytes_ratio" in r else "-"
        lines.append(f"| {r['H']} | {r['codec']} | {r['k_percent']:.2f}% | {r['bits']} | {r['outer']} | "
                     f"{r['bpb']:.4f} | {gap} | {ratio} | {r['parts_gathered']}/{r['parts']} |")
    return "\n".join(lines) + "\n"


def sparse_plot(ok: dict[str, dict], dense_rows: list[dict], path: Path) -> Optional[Path]:
    """Gap to synchronous training against bytes ratio: sparse points beside the dense codecs'."""
    rows = [r for r in sparse_rows(ok) if "gap" in r]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for codec in sorted({r["codec"] for r in rows}):
        pts = sorted((r for r in rows if r["codec"] == codec), key=lambda r: r["bytes_ratio"])
        ax.plot([r["bytes_ratio"] for r in pts], [100 * r["gap"] for r in pts], "-o", label=f"{codec} (H varies)")
        for r in pts:
            ax.annotate(f"H={r['H']}", (r["bytes_ratio"], 100 * r["gap"]), fontsize=7, xytext=(3, 3),
                        textcoords="offset points")
    dense = [r for r in dense_rows if "gap" in r]
    if dense:
        ax.plot([r["bytes_ratio"] for r in dense], [100 * r["gap"] for r in dense], "ks", ms=4,
                label="DiLoCo none/fp16/int8/int4")
    ax.axhline(100 * GOAL_GAP, color="grey", ls="--", lw=1)
    ax.axvline(GOAL_RATIO, color="grey", ls="--", lw=1)
    ax.set(xscale="log", xlabel="bytes of synchronous training / bytes of the run (per worker)",
           ylabel="bits per byte above synchronous (%)", title="sparse pseudo-gradients: gap against bytes")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
