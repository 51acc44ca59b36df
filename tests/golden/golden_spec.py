"""The schedule behind ``sim_tiny.json``: a tiny 2x2 lattice, 3 paths, fixed batches, codec none.

Shared by ``regen.py`` (which runs it through the ``train-local --workers`` simulator,
:class:`peer.simulator.DiLoCoSimulator`) and ``tests/peer/simulator/test_golden_simulator.py`` (which runs it
through real peers: ``DiLoCoOptimizer`` over ``NetAverager``). A module's state is summarised by its fp64
sum, absolute sum and a few values at fixed positions of its flattened global copy.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator, Sequence

import torch

from models.config import RunConfig
from models.presets import tiny_cpu

PATHS = [(0, 0), (0, 1), (1, 1)]
"""Worker k trains PATHS[k]: embed and head are shared by 3, L0M0 and L1M1 by 2, the rest alone."""
ROUNDS = 3
INNER_STEPS = 3
SAMPLES = 16
VOCAB = 64
"""Batches use token ids below this (a small vocabulary: the loss falls within a few steps)."""


def config() -> RunConfig:
    """``tiny_cpu`` with no codec (exact averages), H = INNER_STEPS and a generous round deadline (a slow process must not miss the gather)."""
    cfg = tiny_cpu()
    outer = dataclasses.replace(cfg.outer, codec="none", inner_steps=INNER_STEPS, round_timeout=90.0)
    return dataclasses.replace(cfg, outer=outer)


def batches(k: int, path: Sequence[int] = ()) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Worker ``k``'s endless fixed batches: ``x, y`` (B, T) from a generator seeded with ``100 + k``."""
    cfg = config()
    gen = torch.Generator().manual_seed(100 + k)
    while True:
        tokens = torch.randint(0, VOCAB, (cfg.inner.batch_size, cfg.lattice.seq_len + 1), generator=gen)  # (B, T+1)
        yield tokens[:, :-1], tokens[:, 1:]


def summarize(params: Sequence[torch.Tensor]) -> dict:
    """fp64 sum and absolute sum of the flattened ``params``, and SAMPLES values at fixed positions."""
    flat = torch.cat([p.detach().reshape(-1).to(torch.float64) for p in params])  # (numel,)
    idx = torch.linspace(0, flat.numel() - 1, SAMPLES).round().to(torch.long)
    return {"numel": flat.numel(), "sum": float(flat.sum()), "abs_sum": float(flat.abs().sum()),
            "values": [float(v) for v in flat[idx]]}
