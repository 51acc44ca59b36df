"""Inner-loop overhead: a path's inner step through hivepath against a bare PyTorch loop.

hivepath side: ``ModularLM.path_model`` trained by ``models.training.InnerLoop`` (warm-up learning
rate, clipping, autocast) on batches drawn from a prepared dataset's memory-mapped shard
(``Dataset.path_batches``). Bare side: the same model (same initial weights), the same batch size
and the same AdamW with clipping, in a hand-written loop over batches already in memory. The two run
in alternating blocks so background load hits both alike. Throughput is tokens per CPU-second of
this process on CPU (so other jobs on a shared machine cost neither side) and per wall-clock second
on CUDA. Each side's tokens/s is the median over blocks; ``overhead`` is one minus the median ratio
of adjacent hivepath/bare blocks, and ``overhead_of_medians`` one minus the ratio of the medians.
Target: overhead <= 0.03.

Run: ``python -m bench.inner_loop [--device cpu|cuda] [--threads N] [--blocks N] [--steps N]``.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.common import emit, run_main
from models.presets import demo
from models.corpus import default_corpus
from models.data import Dataset, prepare
from models.lattice import ModularLM
from models.training import InnerLoop, autocast, make_adamw, pick_device

MEASURES = (
    "bench/inner_loop.py",
    "models",
)
"""The code this benchmark's figures depend on: ``python -m bench.report`` marks its results stale
when any of it changed after the commit a result records."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--blocks", type=int, default=16, help="alternating measurement blocks per side")
    ap.add_argument("--steps", type=int, default=10, help="inner steps per block")
    ap.add_argument("--data", help="a prepared 2x2 dataset (default: prepare the built-in corpus in a temp dir)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = pick_device(args.device)
    cfg = demo()
    B, T = cfg.inner.batch_size, cfg.lattice.seq_len
    path = (0, 1)

    with tempfile.TemporaryDirectory() as tmp:
        data_dir = args.data or str(Path(tmp) / "d")
        if not args.data:
            prepare(default_corpus(), data_dir, levels=2, modules=2)
        ds = Dataset(data_dir)

        lattice = ModularLM(cfg.lattice, seed=0, module_ids=cfg.lattice.path_modules(path)).to(device)
        ours = lattice.path_model(path)
        bare_model = copy.deepcopy(ours)
        loop = InnerLoop(ours, cfg.inner, device)
        batches = ds.path_batches(path, "train", B, T, seed=0)

        bare_opt = make_adamw(bare_model.parameters(), cfg.inner)
        bare_params = list(bare_model.parameters())
        fixed = [next(ds.path_batches(path, "train", B, T, seed=i)) for i in range(8)]
        fixed = [(x.to(device), y.to(device)) for x, y in fixed]

        def run_ours(n: int) -> None:
            for _ in range(n):
                x, y = next(batches)
                loop.step(x.to(device, non_blocking=True), y.to(device, non_blocking=True))

        def run_bare(n: int) -> None:
            for i in range(n):
                x, y = fixed[i % len(fixed)]
                with autocast(device):
                    _, loss = bare_model(x, y)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(bare_params, cfg.inner.grad_clip)
                bare_opt.step()
                bare_opt.zero_grad(set_to_none=True)

        run_ours(5)
        run_bare(5)
        # On CPU, count the process's CPU seconds: other jobs on a shared machine then cost neither
        # side anything. On CUDA, wall-clock time between synchronisations.
        clock = time.process_time if device.type == "cpu" else time.perf_counter
        ours_tps, bare_tps = [], []
        for block in range(args.blocks):
            order = (run_ours, run_bare) if block % 2 == 0 else (run_bare, run_ours)
            for fn in order:
                _sync(device)
                start = clock()
                fn(args.steps)
                _sync(device)
                tps = args.steps * B * T / (clock() - start)
                (ours_tps if fn is run_ours else bare_tps).append(tps)
    hp, bare = statistics.median(ours_tps), statistics.median(bare_tps)
    overhead = 1 - statistics.median(o / b for o, b in zip(ours_tps, bare_tps))
    return emit("inner_loop", {
        "hivepath_tokens_per_s": round(hp, 1),
        "bare_tokens_per_s": round(bare, 1),
        "overhead": round(overhead, 4),
        "overhead_of_medians": round(1 - hp / bare, 4),
        "target_overhead": 0.03,
        "meets_target": overhead <= 0.03,
        "seeds": list(range(8)),  # the model and the timed batches from 0, the fixed batches from 0-7
        "device": str(device),
        "clock": "process CPU time" if device.type == "cpu" else "wall clock",
        "threads": args.threads,
        "model": "demo preset path (0,1)",
        "params": cfg.lattice.path_param_count(path),
        "batch_size": B,
        "seq_len": T,
        "blocks": args.blocks,
        "steps_per_block": args.steps,
        "block_tokens_per_s": {"hivepath": [round(t) for t in ours_tps], "bare": [round(t) for t in bare_tps]},
    })


if __name__ == "__main__":
    run_main(main)
