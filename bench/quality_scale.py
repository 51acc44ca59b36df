"""How big the quality sweeps are: model width, steps and evaluation budget, as named presets.

``tiny`` exercises every code path in seconds (the harness test), ``quick`` is a reduced grid that
runs on a shared 2-core CPU, ``full`` is the whole grid sized for one GPU (or many CPU cores):
a ~0.45M-parameter byte-level model, thousands of inner steps per worker.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

__all__ = ["Scale", "grid_fields", "seeds_of", "tiny", "quick", "long", "horizon", "horizon_cosine", "wide",
           "wide_horizon", "full", "SCALES"]


def _grid(default):
    """A :class:`Scale` field that only says which points the grid holds (each point's own arguments
    carry what it takes from it): :func:`grid_fields`."""
    return dataclasses.field(default=default, metadata={"grid": True})


@dataclass(frozen=True)
class Scale:
    """Sizes shared by every point of one sweep."""

    name: str
    """Preset name, recorded in quality.json."""
    d_model: int = 128
    """Residual width of every model."""
    n_heads: int = 4
    """Attention heads."""
    blocks_per_module: int = 2
    """Blocks of the dense model P (a 2x2 lattice path has one block per module: same P)."""
    seq_len: int = 128
    """Context length in tokens."""
    batch_size: int = 16
    """Sequences per inner step per worker."""
    lr: float = 3e-3
    """Inner AdamW peak learning rate."""
    warmup_steps: int = 50
    """Inner warm-up steps."""
    lr_decay: bool = False
    """Cosine-decay the inner learning rate to a tenth over each point's steps (``InnerConfig.decay_steps``;
    synchronous, DiLoCo, dense and DiPaCo points); False keeps it constant after the warm-up. The
    heterogeneity and equivalence points always keep it constant."""
    seed: int = 0
    """Seed of weights and batches for every point."""
    steps: int = 3000
    """Inner steps per worker in experiments 1 and 4 (DiLoCo against synchronous)."""
    dipaco_steps: int = 1500
    """Inner steps per path in experiment 2 (DiPaCo against dense)."""
    hetero_rounds: int = 40
    """Experiment 3: simulated time budget, in rounds of H fast-worker steps."""
    hetero_h: int = 50
    """Experiment 3: H, in fast-worker steps."""
    evals: int = 8
    """Evaluations along each run (the curves)."""
    eval_docs: int = 24
    """Validation documents per shard in the fixed evaluation set."""
    eval_tokens: int = 4096
    """Tokens kept of each validation document (its bytes are counted for what is kept)."""
    diloco_grid: tuple[tuple[int, str], ...] = _grid(tuple((H, c) for H in (10, 50, 100, 250)
                                                           for c in ("none", "fp16", "int8", "int4")))
    """Experiment 1: (H inner steps between outer steps, pseudo-gradient codec) points."""
    diloco_tuned: tuple[tuple[int, str, float, float], ...] = _grid(())
    """Experiment 1 points with another outer optimizer: (H, codec, outer lr, outer momentum)."""
    bpe_grid: tuple[tuple[int, str], ...] = _grid(((50, "int8"), (100, "int8"), (250, "int4")))
    """Experiment 1 with the BPE tokenizer (besides its synchronous baseline); empty: no BPE run."""
    outer_grid: tuple[tuple[float, float], ...] = _grid(((0.4, 0.9), (1.0, 0.9), (0.4, 0.8), (0.7, 0.8), (1.0, 0.8),
                                                         (0.7, 0.5), (1.0, 0.5)))
    """Experiment 4: (outer lr, momentum) pairs besides the 0.7 / 0.9 default."""
    outer_H: tuple[int, ...] = _grid((10, 100))
    """Experiment 4: H values the outer grid is swept at."""
    outer_codec: str = _grid("none")
    """Experiment 4's codec (its lr 0.7 / momentum 0.9 point is experiment 1's point of that H and codec)."""
    dipaco_outer_grid: tuple[tuple[float, float], ...] = _grid(((0.7, 0.5),))
    """Experiment 4: (outer lr, momentum) pairs the DiPaCo lattice is also trained with."""
    sparse_grid: tuple[tuple[int, str, float, float], ...] = _grid(())
    """The sparse points (``--only sparse``): (H, sparse codec ``topk{K}b{B}``, outer lr, outer
    momentum), bytes counted on the wire (:mod:`bench.quality_sparse`)."""
    seeds: tuple[int, ...] = _grid(())
    """Seeds besides ``seed`` at which the synchronous baseline (at each rate of ``sync_lrs`` too) and
    the ``seeded`` points run again (the ``seeds`` experiment, :mod:`bench.quality_seeds`): the goal is
    judged on the mean gap over all the seeds."""
    sync_lrs: tuple[float, ...] = _grid(())
    """Inner learning rates the synchronous baseline also trains with besides ``lr`` (its batch is the
    workers' together): the rate of the lowest mean bits per byte over the seeds is the baseline kept."""
    seeded: tuple[str, ...] = _grid(())
    """Sparse points run at every seed of ``seeds`` (names; empty: every sparse point of the grid)."""
    equivalence: tuple[int, int] = _grid((10, 3))
    """(H, rounds) of the point trained both by the simulator and by the peers' DiLoCoOptimizer."""
    reroute_windows: tuple[int, ...] = (64, 256)
    """Experiment 2: re-route every W tokens."""
    priority: tuple[str, ...] = _grid(())
    """Point names run first, in this order (the rest follow in grid order): what matters most finishes
    first when compute is short."""

    def replace(self, **changes) -> "Scale":
        return dataclasses.replace(self, **changes)


def grid_fields() -> tuple[str, ...]:
    """The fields of :class:`Scale` that only say which points the grid holds: a point's key leaves
    them out (:func:`bench.quality.point_key`), so that adding a point to a grid does not run the
    others again."""
    return tuple(f.name for f in dataclasses.fields(Scale) if f.metadata.get("grid"))


def seeds_of(scale: Scale) -> tuple[int, ...]:
    """Every seed of the ``seeds`` experiment: ``seed``, then ``seeds``."""
    return (scale.seed, *scale.seeds)


def full() -> Scale:
    """The whole grid at a GPU-friendly size."""
    return Scale(name="full")


def quick() -> Scale:
    """A reduced grid (~0.12M parameters, 1000 steps per worker) for a shared 2-core CPU, run in priority
    order; the synchronous baseline at four inner learning rates and the sparse points over three
    seeds."""
    return Scale(name="quick", d_model=64, n_heads=4, seq_len=64, batch_size=8, steps=1000, dipaco_steps=500,
                 hetero_rounds=16, hetero_h=25, evals=5, eval_docs=8, eval_tokens=1024, warmup_steps=30,
                 diloco_grid=((10, "none"), (50, "none"), (100, "int4"), (250, "none"), (250, "int8"), (250, "int4")),
                 diloco_tuned=((250, "int4", 0.7, 0.5), (50, "none", 0.7, 0.5)),
                 bpe_grid=((250, "int4"),), outer_grid=((0.4, 0.9), (0.7, 0.5), (1.0, 0.5)), outer_H=(10,),
                 reroute_windows=(64,),
                 sparse_grid=((32, "topk16b2", 1.0, 0.0), (16, "topk16b2", 1.0, 0.0), (64, "topk16b2", 1.0, 0.0),
                              (32, "topk32b2", 1.0, 0.0), (32, "topk16b4", 1.0, 0.0), (8, "topk16b2", 1.0, 0.0)),
                 seeds=(1, 2), sync_lrs=(1.5e-3, 6e-3, 1.2e-2),
                 priority=("sync-bytes", "diloco-bytes-H250-int4", "diloco-bytes-H250-none", "diloco-bytes-H50-none",
                           "diloco-bytes-H10-none", "dipaco-2x2", "dense-p", "dense-2p", "dense-p-equal-compute",
                           "hetero-step", "hetero-time", "hetero-fast", "equivalence-bytes-H10-int8",
                           "diloco-bytes-H250-int8", "diloco-bytes-H100-int4", "outer-H10-lr0.7-m0.5",
                           "outer-H10-lr0.4-m0.9", "outer-H10-lr1-m0.5"))


def long() -> Scale:
    """The quick model trained three times longer (3000 steps per worker) on the headline points only:
    does the gap to synchronous training shrink with the horizon, and does the best outer momentum change?"""
    return quick().replace(name="long", steps=3000, diloco_grid=((50, "none"), (250, "int8"), (250, "int4")),
                           seeds=(), sync_lrs=(), bpe_grid=(), diloco_tuned=((250, "int4", 0.7, 0.5),),
                           outer_grid=((0.7, 0.5),), outer_H=(50,), dipaco_outer_grid=(),
                           priority=("sync-bytes", "diloco-bytes-H250-int4", "diloco-bytes-H50-none",
                                     "outer-H50-lr0.7-m0.5", "diloco-bytes-H250-int8",
                                     "diloco-bytes-H250-int4-lr0.7-m0.5"))


def horizon() -> Scale:
    """The quick model trained 12x longer (12,000 steps per worker, about a hundred outer rounds) on the
    settings that send >= 1000x fewer bytes than synchronous training: H=128 with the 4-bit codec
    and H=256 with int8. Run with ``--only diloco``. The sparse points
    (top-14 to top-32 of every 1024 values at 2 or 4 bits, short horizons, SparseLoCo's outer step:
    lr 1, no momentum) run with ``--only sparse``: H=16 top-14 and H=18 top-16 are the nearest
    settings above 1000x to H=16 top-16 (just below it). ``--only seeds`` runs H=16 top-16 at two
    more seeds, against the synchronous baseline at three inner learning rates (half, once and twice
    the workers' rate)."""
    return quick().replace(name="horizon", steps=12000, evals=6,
                           sparse_grid=((32, "topk16b2", 1.0, 0.0), (16, "topk16b2", 1.0, 0.0),
                                        (16, "topk14b2", 1.0, 0.0), (18, "topk16b2", 1.0, 0.0),
                                        (32, "topk32b2", 1.0, 0.0), (64, "topk16b2", 1.0, 0.0),
                                        (16, "topk32b2", 1.0, 0.0), (32, "topk16b4", 1.0, 0.0),
                                        (8, "topk16b2", 1.0, 0.0)),
                           seeds=(1, 2), sync_lrs=(1.5e-3, 6e-3), seeded=("sparse-bytes-H16-topk16b2-lr1-m0",),
                           diloco_grid=((128, "int4"), (256, "int8")), bpe_grid=(),
                           diloco_tuned=((128, "int4", 0.7, 0.8),), outer_grid=(), outer_H=(), dipaco_outer_grid=(),
                           priority=("sync-bytes", "diloco-bytes-H128-int4", "diloco-bytes-H256-int8",
                                     "diloco-bytes-H128-int4-lr0.7-m0.8"))


def horizon_cosine() -> Scale:
    """``horizon``'s synchronous baseline and H=128 int4 points with the inner learning rate decayed
    (cosine, to a tenth) over the 12,000 steps instead of constant: does the gap that stays with a
    constant rate close when both runs anneal? Outer momentum 0.8, 0.7 and 0.5 besides 0.9, and
    H=32 int8: the gap at 4x more rounds."""
    return horizon().replace(name="horizon-cosine", lr_decay=True, seeds=(), sync_lrs=(), seeded=(),
                             diloco_tuned=((128, "int4", 0.7, 0.8), (128, "int4", 0.7, 0.7), (128, "int4", 0.7, 0.5)),
                             diloco_grid=((128, "int4"), (32, "int8")),
                             priority=("sync-bytes", "diloco-bytes-H128-int4", "diloco-bytes-H128-int4-lr0.7-m0.8",
                                       "diloco-bytes-H32-int8", "diloco-bytes-H128-int4-lr0.7-m0.7",
                                       "diloco-bytes-H128-int4-lr0.7-m0.5"))


def wide() -> Scale:
    """The reference model size on the quick grid's context and batch: d_model 128 (434,816
    parameters, 3.7x the quick model), 4,000 steps per worker (the reference horizon), on the
    >= 1000x settings (H=128 int4, H=256 int8) and the reference point (H=100, uncompressed).
    Does the gap to synchronous training shrink with model size? Run with ``--only diloco``."""
    return quick().replace(name="wide", d_model=128, steps=4000, evals=5, seeds=(), sync_lrs=(),
                           diloco_grid=((128, "int4"), (100, "none"), (256, "int8")), bpe_grid=(),
                           diloco_tuned=(), outer_grid=(), outer_H=(), dipaco_outer_grid=(),
                           priority=("sync-bytes", "diloco-bytes-H128-int4", "diloco-bytes-H100-none",
                                     "diloco-bytes-H256-int8"))


def wide_horizon() -> Scale:
    """``wide``'s model on ``horizon-cosine``'s schedule (12,000 steps, inner lr cosine-decayed to a
    tenth), synchronous against H=128 int4 (outer momentum 0.9 and 0.8): at the same horizon and the same number of outer
    rounds, is the gap of a 3.7x larger model smaller? Run with ``--only diloco``. The best sparse
    setting at the quick model's horizon scale (H=16, top-16 of 1024 at 2 bits) on this model: ``--only sparse``."""
    return wide().replace(name="wide-horizon", steps=12000, evals=6, lr_decay=True,
                          diloco_grid=((128, "int4"),), diloco_tuned=((128, "int4", 0.7, 0.8),),
                          sparse_grid=((16, "topk16b2", 1.0, 0.0),),
                          priority=("sync-bytes", "diloco-bytes-H128-int4-lr0.7-m0.8", "diloco-bytes-H128-int4"))


def tiny() -> Scale:
    """Every code path in seconds: the harness test."""
    return Scale(name="tiny", d_model=16, n_heads=2, blocks_per_module=2, seq_len=16, batch_size=2, steps=6,
                 dipaco_steps=4, hetero_rounds=4, hetero_h=4, evals=2, eval_docs=2, eval_tokens=64,
                 warmup_steps=1, diloco_grid=((3, "none"), (3, "int4")), bpe_grid=(), outer_grid=((0.4, 0.5),),
                 outer_H=(3,), reroute_windows=(8,), equivalence=(3, 2), dipaco_outer_grid=(),
                 sparse_grid=((2, "topk16b2", 1.0, 0.0),), seeds=(1,), sync_lrs=(6e-3,))


SCALES = {"tiny": tiny, "quick": quick, "long": long, "horizon": horizon, "horizon-cosine": horizon_cosine,
          "wide": wide, "wide-horizon": wide_horizon, "full": full}
