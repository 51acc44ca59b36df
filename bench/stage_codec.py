"""Stage mode's activation codec: wire bytes and validation bits per byte against fp32 activations.

A path of the demo preset is trained in this process as a stage trainer and its servers train it,
with the codec the only difference: every tensor crosses a trainer<->server link as the real
:func:`peer.stage.encode_tensor` / :func:`peer.stage.decode_tensor` make it. Forward, the embedding's
output goes to level 0's server, each level's output comes back to the trainer and goes on to the next
level, the last comes back to the head (two links a level); backward, the gradients cross the same
links the other way. One AdamW (``models.training.InnerLoop``, the demo preset's inner config with a
cosine decay over the run) stands in for the trainer's and servers' inner optimizers: no outer rounds,
nobody to average with. A codec is a scheme (:func:`peer.stage.wire.codec_scheme`, e.g.
``int4tok+zstd/first=int5tok+zstd``): level ``i``'s forward request and its reply cross in the scheme's
``forward(i)`` codec, its backward request and reply in ``backward(i)``, as
:class:`peer.node.stage_runner.StageTrainer` sends them and its servers answer. Each codec trains from the same initial weights on the same batches (the
built-in corpus, prepared for the 2x2 lattice) as codec ``none`` (fp32, lossless), for each seed.

Reported per codec: ``activation_bytes_ratio``, the encoded bytes of every activation and gradient of
the run over their fp32 bytes (both directions; forward and backward apart, and the worst tensor);
``stage_bpb_gap_vs_fp32``, the relative gap of the path's routed validation bits per byte (the
documents the dataset's router sends to the path, scored by the trained path in fp32, as ``hivepath
eval`` does) to fp32's, per seed, their mean and spread. Targets, for the candidate (the first codec):
ratio <= 1/8 and mean gap <= 2%.

Run: ``python -m bench.stage_codec [--steps N] [--seeds 0,1,2] [--path 1,0]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Optional, Sequence

import torch
from torch import nn

from bench.common import emit, run_main
from models.config import format_path, parse_path
from models.corpus import default_corpus
from models.data import Dataset, prepare
from models.evaluate import routed_evaluation
from models.lattice import ModularLM, PathModel
from models.presets import demo
from models.training import InnerLoop
from peer.stage import activation_codec, decode_tensor, encode_tensor
from peer.stage.wire import DEFAULT_ACTIVATION_CODEC, codec_scheme

MEASURES = (
    "bench/stage_codec.py",
    "models",
    "peer/stage",
    "peer/compression",
)
"""The code this benchmark's figures depend on: ``python -m bench.report`` marks its results stale
when any of it changed after the commit a result records."""

TARGET_RATIO = 0.125
"""Most wire bytes of activations and gradients, relative to fp32."""
TARGET_GAP = 0.02
"""Most relative gap of validation bits per byte to fp32 activations, on the mean over seeds."""
BASELINE = "none"
"""The fp32 arm: codec ``none`` sends the fp32 values as they are (lossless)."""


class Link:
    """The trainer<->server links of one run in one codec scheme: crosses tensors and counts their bytes.

    As :class:`peer.node.stage_runner.StageTrainer` does: level ``i``'s forward request names
    ``scheme.forward(i)`` and its server answers in it, its backward request ``scheme.backward(i)``.
    """

    def __init__(self, scheme: str):
        self.scheme = codec_scheme(scheme)
        self.bytes = {"forward": 0, "backward": 0}
        self.fp32_bytes = {"forward": 0, "backward": 0}
        self.worst_ratio = 0.0

    def cross(self, t: torch.Tensor, direction: str, level: int) -> torch.Tensor:
        """``t`` (B, T, C) of level ``level``'s request or reply as the other side decodes it."""
        codec = self.scheme.forward(level) if direction == "forward" else self.scheme.backward(level)
        msg = encode_tensor(t, activation_codec(codec))
        self.bytes[direction] += len(msg.data)
        self.fp32_bytes[direction] += 4 * t.numel()
        self.worst_ratio = max(self.worst_ratio, len(msg.data) / (4 * t.numel()))
        return decode_tensor(msg, direction, t.numel(), shape=list(t.shape)).to(t.dtype)

    def ratio(self, direction: Optional[str] = None) -> float:
        keys = [direction] if direction else list(self.bytes)
        return sum(self.bytes[k] for k in keys) / sum(self.fp32_bytes[k] for k in keys)


class _Hop(torch.autograd.Function):
    """One link: activations encoded and decoded on the way forward, their gradient on the way back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, link: Link, level: int) -> torch.Tensor:
        ctx.link, ctx.level = link, level
        return link.cross(x, "forward", level)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return ctx.link.cross(grad, "backward", ctx.level), None, None


class StagedPath(nn.Module):
    """``path`` with every level on a stage server: each level's input and output cross a link."""

    def __init__(self, path: PathModel, link: Link):
        super().__init__()
        self.path = path
        self.link = link

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.path.embed(idx)  # (B, T, C)
        for level, module in enumerate(self.path.stack):  # trainer -> server -> trainer
            xin = _Hop.apply(x, self.link, level)  # (B, T, C) as the server decodes it
            if self.link.scheme.residual:  # the server replies output - input; the trainer adds its exact x
                x = x + _Hop.apply(module(xin) - xin, self.link, level)
            else:
                x = _Hop.apply(module(xin), self.link, level)
        logits = self.path.head(x, self.path.embed.tok.weight)  # (B, T, V)
        loss = nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss


def train_and_score(cfg, dataset: Dataset, path: tuple[int, ...], codec: str, seed: int, steps: int) -> dict:
    """Train ``path`` for ``steps`` steps through links in ``codec``; its validation bpb and the bytes."""
    torch.manual_seed(seed)
    lm = ModularLM(cfg.lattice, seed=seed, module_ids=cfg.lattice.path_modules(path))
    link = Link(codec)
    loop = InnerLoop(StagedPath(lm.path_model(path), link), cfg.inner)
    batches = dataset.path_batches(path, "train", cfg.inner.batch_size, cfg.lattice.seq_len, seed)
    t0 = time.perf_counter()
    losses = [float(loop.step(*next(batches))) for _ in range(steps)]
    train_s = time.perf_counter() - t0
    scored = routed_evaluation(lm.path_model, dataset, [path], cfg.lattice.seq_len)
    return {
        "bpb": scored.bpb,
        "train_loss_last_20": statistics.fmean(losses[-20:]),
        "bytes_ratio": link.ratio(),
        "bytes_ratio_forward": link.ratio("forward"),
        "bytes_ratio_backward": link.ratio("backward"),
        "worst_tensor_ratio": link.worst_ratio,
        "train_s": round(train_s, 1),
    }


def _seed_runs(job: tuple) -> dict[str, dict]:
    """Every codec of one seed: ``train_and_score`` from the same weights and batches (a worker process's job)."""
    data_dir, cfg, path, codecs, seed, steps = job
    torch.set_num_threads(1)
    dataset = Dataset(Path(data_dir))
    return {c: train_and_score(cfg, dataset, path, c, seed, steps) for c in codecs}


def _summary(runs: dict[int, dict[str, dict]], codec: str) -> dict:
    """One codec's figures over the seeds: its gaps to fp32 seed by seed, their mean and spread."""
    gaps = {seed: r[codec]["bpb"] / r[BASELINE]["bpb"] - 1 for seed, r in runs.items()}
    ratios = [r[codec]["bytes_ratio"] for r in runs.values()]
    return {
        "activation_bytes_ratio": max(ratios),
        "activation_bytes_ratio_per_seed": {str(s): r[codec]["bytes_ratio"] for s, r in runs.items()},
        "activation_bytes_ratio_forward": max(r[codec]["bytes_ratio_forward"] for r in runs.values()),
        "activation_bytes_ratio_backward": max(r[codec]["bytes_ratio_backward"] for r in runs.values()),
        "worst_tensor_ratio": max(r[codec]["worst_tensor_ratio"] for r in runs.values()),
        "stage_bpb_gap_vs_fp32": statistics.fmean(gaps.values()),
        "stage_bpb_gap_stdev": statistics.stdev(gaps.values()) if len(gaps) > 1 else 0.0,
        "stage_bpb_gap_min": min(gaps.values()),
        "stage_bpb_gap_max": max(gaps.values()),
        "stage_bpb_gap_per_seed": {str(s): g for s, g in gaps.items()},
        "bpb_per_seed": {str(s): r[codec]["bpb"] for s, r in runs.items()},
        "train_loss_last_20_per_seed": {str(s): r[codec]["train_loss_last_20"] for s, r in runs.items()},
        "train_s_per_seed": {str(s): r[codec]["train_s"] for s, r in runs.items()},
    }


def main(argv: Optional[Sequence[str]] = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=500, help="training steps of each run")
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (weights, batches)")
    ap.add_argument("--path", default="1,0", help="the path trained (the demo preset's lattice is 2x2)")
    ap.add_argument("--codecs", default=f"{DEFAULT_ACTIVATION_CODEC},int8",
                    help="codec schemes compared with fp32, the candidate first (default: peers' default, then int8)")
    ap.add_argument("--jobs", type=int, default=1, help="seeds run at once, one process each")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    seeds = [int(s) for s in args.seeds.split(",")]
    codecs = [c for c in args.codecs.split(",") if c != BASELINE]
    base = demo()
    cfg = dataclasses.replace(base, inner=dataclasses.replace(base.inner, decay_steps=args.steps))
    path = cfg.lattice.check_path(parse_path(args.path))
    runs: dict[int, dict[str, dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        prepare(default_corpus(), Path(tmp) / "data", levels=cfg.lattice.levels, modules=cfg.lattice.modules_per_level,
                tokenizer="bytes")
        jobs = [(str(Path(tmp) / "data"), cfg, path, [BASELINE, *codecs], seed, args.steps) for seed in seeds]
        if args.jobs > 1:  # one process a seed: each run is one torch thread, its figures the same either way
            with ProcessPoolExecutor(min(args.jobs, len(jobs)), mp_context=multiprocessing.get_context("spawn")) as pool:
                results = list(pool.map(_seed_runs, jobs))
        else:
            results = [_seed_runs(job) for job in jobs]
        for seed, result in zip(seeds, results):
            runs[seed] = result
            print(f"seed {seed}: " + ", ".join(f"{c} bpb {r['bpb']:.4f} bytes {r['bytes_ratio']:.4f}"
                                               for c, r in result.items()), file=sys.stderr, flush=True)
    per_codec = {c: _summary(runs, c) for c in codecs}
    candidate = per_codec[codecs[0]]
    return emit("stage_codec", {
        "codec": codecs[0],
        "activation_bytes_ratio": candidate["activation_bytes_ratio"],
        "stage_bpb_gap_vs_fp32": candidate["stage_bpb_gap_vs_fp32"],
        "target_bytes_ratio": TARGET_RATIO,
        "target_bpb_gap": TARGET_GAP,
        "meets_bytes_target": candidate["activation_bytes_ratio"] <= TARGET_RATIO,
        "meets_bpb_target": candidate["stage_bpb_gap_vs_fp32"] <= TARGET_GAP,
        "codecs": per_codec,
        "fp32_bpb_per_seed": {str(s): r[BASELINE]["bpb"] for s, r in runs.items()},
        "fp32_train_loss_last_20_per_seed": {str(s): r[BASELINE]["train_loss_last_20"] for s, r in runs.items()},
        "model": f"demo preset, path {format_path(path)} (embed, {cfg.lattice.levels} levels, head), "
                 f"{cfg.lattice.path_param_count(path)} parameters",
        "training": f"{args.steps} steps of {cfg.inner.batch_size} x {cfg.lattice.seq_len} tokens "
                    f"({args.steps * cfg.inner.batch_size * cfg.lattice.seq_len} tokens), AdamW lr {cfg.inner.lr}, "
                    f"warm-up {cfg.inner.warmup_steps}, cosine decay to {cfg.inner.min_lr_ratio} x lr at the end",
        "steps": args.steps,
        "seeds": seeds,
        "path": format_path(path),
        "torch_threads": torch.get_num_threads(),
    })


if __name__ == "__main__":
    run_main(main)
