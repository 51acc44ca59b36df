"""The sparse points of the quality sweeps (issue 26): top-k pseudo-gradients at short horizons.

:func:`run_sparse` trains DiLoCo on the dense model with a sparse codec (``topk{K}b{B}``,
:mod:`peer.averaging.sparse`: per-chunk top-k, 2 or 4 bits, error feedback decayed by 0.95) and,
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

from typing import Any

from bench.quality_runs import RunContext, dense_bpb, make_config, seed_batches
from peer.averaging import Reduced, encode_aggregate
from peer.averaging.partition import part_bounds, segment_bounds
from peer.simulator import DiLoCoSimulator

__all__ = ["run_sparse", "round_wire_bytes"]


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


def run_sparse(ctx: RunContext, tokenizer: str = "bytes", workers: int = 4, inner_steps: int = 16,
               codec: str = "topk16b2", outer_lr: float = 1.0, outer_momentum: float = 0.0) -> dict[str, Any]:
    """DiLoCo with a sparse codec: ``workers`` simulated workers, outer step every ``inner_steps``,
    bytes counted from the encoded messages of every round."""
    s = ctx.scale
    cfg = make_config(ctx, tokenizer, inner_steps=inner_steps, codec=codec, outer_lr=outer_lr,
                      outer_momentum=outer_momentum, steps=s.steps)
    ds = ctx.dataset(tokenizer)
    sim = DiLoCoSimulator(cfg, [(0,)], workers, seed_batches(ds, cfg, dense=True), device=ctx.device)
    from bench.quality_runs import _checkpoints

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
    return {"bpb": curve[-1]["bpb"], "tokens": tokens, "bytes_per_worker": sent, "bytes_up": up, "bytes_down": down,
            "parts_gathered": gathered, "parts": parts, "params": cfg.lattice.total_param_count(),
            "rounds": sim.round_no, "curve": curve}
