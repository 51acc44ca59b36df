"""One point of the quality sweeps: build the model, train it, evaluate it in bits per byte.

Each ``run_*`` function trains one configuration on a prepared dataset and returns a JSON-able
dict with the final validation bits per byte, a curve (bits per byte against tokens and against
bytes exchanged) and the bytes each worker sent. The runs use the same code the network runs:
``peer.simulator.DiLoCoSimulator`` (DiLoCo, Douillard et al. 2023; DiPaCo, Douillard et al. 2024),
``models.training.InnerLoop`` and ``models.evaluate``.

Bytes exchanged per worker follow a ring all-reduce: ``2 (K - 1) / K`` times the payload. Synchronous
data-parallel sends the fp32 gradient every step; DiLoCo sends each module's encoded pseudo-gradient
(``models.codec_spec.codec_spec(codec).encoded_size``) once per round.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from bench.quality_eval import EvalSet, routed_bpb
from bench.quality_scale import Scale
from models.codec_spec import codec_spec
from models.config import InnerConfig, LatticeConfig, OuterConfig, Path_, RunConfig
from models.data import Dataset
from models.evaluate import bits_per_byte
from models.lattice import ModularLM
from models.training import InnerLoop
from peer.simulator import DiLoCoSimulator

__all__ = ["RunContext", "make_config", "allreduce_bytes", "seed_batches", "dense_bpb", "run_sync", "run_diloco",
           "run_dense", "run_dipaco",
           "HeteroSimulator", "run_hetero"]

log = logging.getLogger(__name__)


@dataclass
class RunContext:
    """What every point of a sweep shares: the scale, the prepared datasets (by tokenizer), the device."""

    scale: Scale
    datasets: dict[str, Dataset]
    device: torch.device
    evalsets: dict[str, EvalSet]

    def dataset(self, tokenizer: str) -> Dataset:
        if tokenizer not in self.datasets:
            raise KeyError(f"no prepared dataset for tokenizer '{tokenizer}' (have {', '.join(self.datasets)})")
        return self.datasets[tokenizer]


def make_config(ctx: RunContext, tokenizer: str, *, levels: int = 1, modules: int = 1, blocks: Optional[int] = None,
                inner_steps: int = 50, codec: str = "none", outer_lr: float = 0.7, outer_momentum: float = 0.9,
                sqrt_sharing: bool = False, batch_size: Optional[int] = None, steps: int = 0,
                seed: Optional[int] = None, lr: Optional[float] = None) -> RunConfig:
    """The run config of one point at the sweep's scale (validated by ``RunConfig``); with the scale's
    ``lr_decay``, the inner learning rate decays (cosine) over the point's ``steps`` inner steps.
    ``seed`` and ``lr`` replace the scale's seed (weights and batches) and inner learning rate."""
    s = ctx.scale
    ds = ctx.dataset(tokenizer)
    return RunConfig(
        run_id="quality",
        seed=s.seed if seed is None else seed,
        lattice=LatticeConfig(vocab_size=int(ds.manifest["vocab_size"]), d_model=s.d_model, n_heads=s.n_heads,
                              blocks_per_module=blocks or s.blocks_per_module, levels=levels,
                              modules_per_level=modules, seq_len=s.seq_len),
        inner=InnerConfig(lr=s.lr if lr is None else lr, warmup_steps=s.warmup_steps, batch_size=batch_size or s.batch_size,
                          decay_steps=steps if s.lr_decay and steps > s.warmup_steps else 0),
        outer=OuterConfig(inner_steps=inner_steps, codec=codec, lr=outer_lr, momentum=outer_momentum,
                          sqrt_sharing=sqrt_sharing),
    )


def allreduce_bytes(payload_bytes: float, group: int) -> float:
    """Bytes one member of a ring all-reduce of ``group`` members sends (reduce-scatter + all-gather)."""
    return 2.0 * (group - 1) / group * payload_bytes if group > 1 else 0.0


def _module_numels(cfg: RunConfig, module_ids: Sequence[str]) -> dict[str, int]:
    return {m: cfg.lattice.module_param_count(m) for m in module_ids}


def _checkpoints(total: int, count: int) -> set[int]:
    """Steps (1..total) after which to evaluate: ``count`` evenly spaced, always including ``total``."""
    return {max(1, round(total * (i + 1) / count)) for i in range(max(1, count))} | {total}


def seed_batches(ds: Dataset, cfg: RunConfig, dense: bool) -> Callable:
    """``batches(k, path)``: worker ``k``'s seeded batch iterator (all shards when ``dense``)."""
    B, T = cfg.inner.batch_size, cfg.lattice.seq_len

    def batches(k: int, path: Path_):
        seed = cfg.seed * 1_000_003 + k
        return ds.dense_batches("train", B, T, seed) if dense else ds.path_batches(path, "train", B, T, seed)

    return batches


def dense_bpb(ctx: RunContext, model: torch.nn.Module, tokenizer: str) -> float:
    """Bits per byte of ``model`` on every document of the sweep's evaluation set."""
    es = ctx.evalsets[tokenizer]
    return bits_per_byte(model.to(ctx.device), es.documents, ctx.scale.seq_len, ctx.device).bpb


def run_sync(ctx: RunContext, tokenizer: str = "bytes", workers: int = 4, lr: Optional[float] = None,
             seed: Optional[int] = None) -> dict[str, Any]:
    """Synchronous data-parallel with ``workers`` workers of batch B: one model, batch K*B, gradient
    all-reduced every step (identical arithmetic to averaging K workers' gradients); ``lr`` and
    ``seed`` replace the scale's inner learning rate and seed."""
    s = ctx.scale
    cfg = make_config(ctx, tokenizer, batch_size=s.batch_size * workers, steps=s.steps, seed=seed, lr=lr)
    ds = ctx.dataset(tokenizer)
    model = ModularLM(cfg.lattice, seed=cfg.seed).to(ctx.device)
    pm = model.path_model((0,))
    loop = InnerLoop(pm, cfg.inner, ctx.device)
    batches = seed_batches(ds, cfg, dense=True)(0, (0,))
    numel = cfg.lattice.total_param_count()
    per_step = allreduce_bytes(4.0 * numel, workers)
    tokens_per_step = cfg.inner.batch_size * cfg.lattice.seq_len
    curve, marks = [], _checkpoints(s.steps, s.evals)
    for step in range(1, s.steps + 1):
        x, y = next(batches)
        loop.step(x.to(ctx.device), y.to(ctx.device))
        if step in marks:
            curve.append({"step": step, "tokens": step * tokens_per_step, "bytes": step * per_step,
                          "bpb": dense_bpb(ctx, pm, tokenizer)})
    return {"bpb": curve[-1]["bpb"], "tokens": s.steps * tokens_per_step, "bytes_per_worker": s.steps * per_step,
            "params": numel, "curve": curve}


def _train_rounds(ctx: RunContext, sim: DiLoCoSimulator, total_steps: int, round_bytes: float,
                  evaluate: Callable[[], float]) -> tuple[list[dict], float]:
    """Run ``sim`` for ``total_steps`` inner steps per worker in rounds of H, evaluating near the checkpoints."""
    H = sim.cfg.outer.inner_steps
    marks = sorted(_checkpoints(total_steps, ctx.scale.evals))
    curve, done, sent, tokens = [], 0, 0.0, 0
    while done < total_steps:
        n = min(H, total_steps - done)
        stats = sim.inner_steps(n)
        sim.outer_step(stats.tokens)
        done += n
        tokens += sum(stats.tokens)
        sent += round_bytes
        if marks and done >= marks[0]:
            while marks and done >= marks[0]:
                marks.pop(0)
            curve.append({"step": done, "tokens": tokens, "bytes": sent, "bpb": evaluate()})
    return curve, sent


def run_diloco(ctx: RunContext, tokenizer: str = "bytes", workers: int = 4, inner_steps: int = 50,
               codec: str = "none", outer_lr: float = 0.7, outer_momentum: float = 0.9) -> dict[str, Any]:
    """DiLoCo on the dense model: ``workers`` simulated workers, outer step every ``inner_steps``."""
    s = ctx.scale
    cfg = make_config(ctx, tokenizer, inner_steps=inner_steps, codec=codec, outer_lr=outer_lr,
                      outer_momentum=outer_momentum, steps=s.steps)
    ds = ctx.dataset(tokenizer)
    sim = DiLoCoSimulator(cfg, [(0,)], workers, seed_batches(ds, cfg, dense=True), device=ctx.device)
    c = codec_spec(codec)
    payload = sum(c.encoded_size(n) for n in _module_numels(cfg, sim.module_ids).values())
    evaluate = lambda: dense_bpb(ctx, sim.global_model().path_model((0,)), tokenizer)  # noqa: E731
    curve, sent = _train_rounds(ctx, sim, s.steps, allreduce_bytes(payload, workers), evaluate)
    return {"bpb": curve[-1]["bpb"], "tokens": curve[-1]["tokens"], "bytes_per_worker": sent,
            "params": cfg.lattice.total_param_count(), "rounds": sim.round_no, "curve": curve}


def run_dense(ctx: RunContext, tokenizer: str = "bytes", blocks: int = 2, token_multiple: int = 1) -> dict[str, Any]:
    """A dense 1x1 model of ``blocks`` blocks trained alone on all data for ``token_multiple`` times the
    tokens one DiPaCo path sees (``dipaco_steps`` steps of batch B, times the multiple, as more steps)."""
    s = ctx.scale
    steps = s.dipaco_steps * token_multiple
    cfg = make_config(ctx, tokenizer, blocks=blocks, steps=steps)
    ds = ctx.dataset(tokenizer)
    model = ModularLM(cfg.lattice, seed=cfg.seed).to(ctx.device)
    pm = model.path_model((0,))
    loop = InnerLoop(pm, cfg.inner, ctx.device)
    batches = seed_batches(ds, cfg, dense=True)(0, (0,))
    tokens_per_step = cfg.inner.batch_size * cfg.lattice.seq_len
    curve, marks = [], _checkpoints(steps, s.evals)
    for step in range(1, steps + 1):
        x, y = next(batches)
        loop.step(x.to(ctx.device), y.to(ctx.device))
        if step in marks:
            curve.append({"step": step, "tokens": step * tokens_per_step, "bytes": 0.0,
                          "bpb": dense_bpb(ctx, pm, tokenizer)})
    return {"bpb": curve[-1]["bpb"], "tokens": steps * tokens_per_step, "bytes_per_worker": 0.0,
            "params": cfg.lattice.total_param_count(), "curve": curve}


def run_dipaco(ctx: RunContext, tokenizer: str = "bytes", inner_steps: int = 50, codec: str = "int8",
               sqrt_sharing: bool = False, outer_lr: float = 0.7, outer_momentum: float = 0.9,
               routing: bool = True) -> dict[str, Any]:
    """A 2x2 DiPaCo lattice, one worker per path on its routed shard, modules averaged among the paths
    sharing them; routed evaluation, plus the routing analysis of :func:`bench.quality_eval.routed_bpb`."""
    s = ctx.scale
    # A path of a 2-level lattice holds as many blocks as the dense model P.
    blocks = max(1, s.blocks_per_module // 2)
    cfg = make_config(ctx, tokenizer, levels=2, modules=2, blocks=blocks, inner_steps=inner_steps, codec=codec,
                      outer_lr=outer_lr, outer_momentum=outer_momentum, sqrt_sharing=sqrt_sharing,
                      steps=s.dipaco_steps)
    ds = ctx.dataset(tokenizer)
    paths = cfg.lattice.paths()
    sim = DiLoCoSimulator(cfg, paths, len(paths), seed_batches(ds, cfg, dense=False), device=ctx.device)
    c = codec_spec(codec)
    numels = _module_numels(cfg, sim.module_ids)
    per_worker = max(sum(allreduce_bytes(c.encoded_size(numels[m]), len(sim.holders(m)))
                         for m in cfg.lattice.path_modules(p)) for p in paths)
    es = ctx.evalsets[tokenizer]

    def evaluate() -> float:
        model = sim.global_model().to(ctx.device)
        return routed_bpb(model.path_model, es, paths, s.seq_len, ctx.device, ds.router, analysis=False)["bpb"]

    curve, sent = _train_rounds(ctx, sim, s.dipaco_steps, per_worker, evaluate)
    result: dict[str, Any] = {"bpb": curve[-1]["bpb"], "tokens": curve[-1]["tokens"], "bytes_per_worker": sent,
                              "params_per_path": cfg.lattice.path_param_count(),
                              "params_total": cfg.lattice.total_param_count(), "rounds": sim.round_no,
                              "curve": curve}
    if routing:
        model = sim.global_model().to(ctx.device)
        result["routing"] = routed_bpb(model.path_model, es, paths, s.seq_len, ctx.device, ds.router,
                                       analysis=True, reroute_windows=s.reroute_windows)
        result["shards"] = {name: {"train_tokens": sh["train"]["tokens"], "sources": sh["train"]["sources"],
                                   "epochs_seen": round(s.dipaco_steps * s.batch_size * s.seq_len
                                                        / max(1, sh["train"]["tokens"]), 3)}
                            for name, sh in ds.manifest["shards"].items()}
    return result


class HeteroSimulator(DiLoCoSimulator):
    """The simulator with a per-worker number of inner steps per round (time-bounded rounds: each worker
    contributes the steps it completes, and the outer step weights it by its tokens)."""

    def uneven_round(self, steps: Sequence[int]) -> list[int]:
        """Worker ``k`` takes ``steps[k]`` inner steps, then one outer step weighted by tokens; returns tokens."""
        if len(steps) != len(self.workers):
            raise ValueError(f"need one step count per worker ({len(self.workers)}), got {len(steps)}")
        B, T = self.cfg.inner.batch_size, self.cfg.lattice.seq_len
        tokens = []
        for w, n in zip(self.workers, steps):
            for _ in range(n):
                x, y = next(w.batches)
                w.loop.step(x.to(self.device), y.to(self.device))
            tokens.append(n * B * T)
            w.tokens += n * B * T
        if sum(tokens) == 0:
            raise ValueError("a round in which no worker takes a step cannot be averaged")
        self.outer_step(tokens)
        return tokens


def run_hetero(ctx: RunContext, mode: str, tokenizer: str = "bytes", costs: Sequence[float] = (1, 1, 1, 4),
               inner_steps: int = 50, codec: str = "int8", outer_lr: float = 0.7,
               outer_momentum: float = 0.9) -> dict[str, Any]:
    """Simulated wall clock of DiLoCo with heterogeneous workers (``costs``: time per inner step).

    ``step``: every worker takes H steps, the round lasts ``H * max(costs)``. ``time``: the round lasts
    ``H * min(costs)`` and worker k takes ``floor(H * min(costs) / costs[k])`` steps. ``fast``: only the
    workers of minimal cost, H steps each. Every mode runs for the same simulated time.
    """
    s = ctx.scale
    fastest = min(costs)
    if mode == "fast":
        costs = [c for c in costs if c == fastest]
    elif mode not in ("step", "time"):
        raise ValueError(f"hetero mode must be step, time or fast, got '{mode}'")
    cfg = make_config(ctx, tokenizer, inner_steps=inner_steps, codec=codec, outer_lr=outer_lr,
                      outer_momentum=outer_momentum)
    ds = ctx.dataset(tokenizer)
    sim = HeteroSimulator(cfg, [(0,)], len(costs), seed_batches(ds, cfg, dense=True), device=ctx.device)
    H = inner_steps
    if mode == "step":
        steps, round_time = [H] * len(costs), H * max(costs)
    else:
        steps, round_time = [int(math.floor(H * fastest / c + 1e-9)) for c in costs], H * fastest
    budget = s.hetero_rounds * H * fastest
    rounds = int(math.floor(budget / round_time + 1e-9))
    every = max(1, rounds // s.evals)
    curve, clock, tokens = [], 0.0, 0
    for r in range(1, rounds + 1):
        tokens += sum(sim.uneven_round(steps))
        clock += round_time
        if r % every == 0 or r == rounds:
            curve.append({"round": r, "time": clock, "tokens": tokens,
                          "bpb": dense_bpb(ctx, sim.global_model().path_model((0,)), tokenizer)})
    return {"bpb": curve[-1]["bpb"], "tokens": tokens, "sim_time": clock, "steps_per_round": steps,
            "round_time": round_time, "costs": list(costs), "curve": curve}
