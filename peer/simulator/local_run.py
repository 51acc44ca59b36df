"""One ``hivepath train-local`` run: train paths of the lattice (or the dense model) in one process
with :class:`peer.simulator.DiLoCoSimulator`, score them on the validation split, and write a run
directory (per-module safetensors, then ``run.json`` last and atomically: a directory without it is
not a finished run). The command line picks the config and the dataset and shows the progress.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from models.checkpoint.summary import SnapshotSummary
from models.config import RunConfig, format_path, parse_path
from models.errors import ConfigError, DataError
from models.evaluate import EvalResult

__all__ = ["LocalRun", "LocalRunResult", "train_local"]

log = logging.getLogger(__name__)

StepCallback = Callable[[int, float, float], None]
"""``(step, loss, tokens_per_s)`` after every simulated step."""


@dataclass
class LocalRun:
    """What one train-local run trains and where it writes it."""

    out: Path
    """The run directory to write."""
    path: Optional[str] = None
    """Train this one path, as written (``0,1`` or ``L0M1-L1M0``); None: every path of the lattice.
    A 1x1 lattice is the dense model and ignores it."""
    workers: Optional[int] = None
    """Simulated DiLoCo workers (default: one per path)."""
    steps: int = 200
    """Inner steps per worker."""
    outer_steps_asked: bool = False
    """Whether H was given: one worker on one path trains without outer steps unless it was."""
    device: str = "auto"
    eval_documents: int = 64
    """Validation documents per path for the final bits per byte (0: all)."""

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ConfigError("steps", f"must be >= 1, got {self.steps}")
        if self.workers is not None and self.workers < 1:
            raise ConfigError("workers", f"must be >= 1, got {self.workers}")


@dataclass
class LocalRunResult:
    """A finished run: the ``run.json`` summary and the evaluation behind its ``eval`` entry."""

    summary: dict
    result: EvalResult
    out: Path


def train_local(cfg: RunConfig, dataset, run: LocalRun, on_start: Callable[[str], None] = log.info,
                on_step: Optional[StepCallback] = None) -> LocalRunResult:
    """Train, evaluate and write ``run.out``; ``on_start(line)`` is told what trains on what,
    ``on_step`` follows the steps. The run's vocabulary and data hash follow ``dataset``."""
    from models.checkpoint import save_module, write_summary
    from models.evaluate import evaluate_lattice
    from models.training import pick_device
    from peer.simulator.simulator import DiLoCoSimulator

    if dataset.manifest["vocab_size"] != cfg.lattice.vocab_size:
        log.info("vocab_size set to %d to match the dataset's tokenizer", dataset.manifest["vocab_size"])
        cfg = cfg.replace(lattice={"vocab_size": dataset.manifest["vocab_size"]})
    cfg = cfg.replace(data={"manifest_hash": dataset.manifest_hash, "tokenizer": dataset.manifest["tokenizer"]})
    L = cfg.lattice
    dense = (L.levels, L.modules_per_level) == (1, 1)
    if run.path is not None and not dense:
        paths = [L.check_path(parse_path(run.path, L.levels))]
    elif dense:
        paths = [(0,)]
    else:
        paths = L.paths()
    if not dense and (dataset.levels, dataset.modules_per_level) != (L.levels, L.modules_per_level):
        raise DataError(
            f"dataset {dataset.dir} is routed for a {dataset.levels}x{dataset.modules_per_level} lattice but the run's "
            f"lattice is {L.levels}x{L.modules_per_level}; prepare it with --lattice {L.levels}x{L.modules_per_level}"
        )
    workers = run.workers if run.workers is not None else len(paths)
    outer_steps = not (workers == 1 and len(paths) == 1 and not run.outer_steps_asked)
    device = pick_device(run.device)
    torch.manual_seed(cfg.seed)
    B, T = cfg.inner.batch_size, L.seq_len

    def batches(k: int, path):
        seed = cfg.seed * 1_000_003 + k
        if dense:
            return dataset.dense_batches("train", B, T, seed)
        return dataset.path_batches(path, "train", B, T, seed)

    try:
        sim = DiLoCoSimulator(cfg, paths, workers, batches, device=device, outer_steps=outer_steps)
    except ValueError as e:
        raise ConfigError("workers", str(e)) from None
    on_start(f"{'dense' if dense else str(len(paths)) + ' path(s)'}, {workers} worker(s), "
             f"{'H=' + str(cfg.outer.inner_steps) + ' codec ' + cfg.outer.codec if outer_steps else 'no outer steps'}, "
             f"{L.path_param_count(paths[0]):,} parameters per path, device {device}, data {dataset.dir}")
    history: list[dict] = []
    tokens_seen = 0
    start = time.monotonic()

    def step_done(step: int, loss: float, tokens: int) -> None:
        nonlocal tokens_seen
        tokens_seen += tokens
        history.append({"step": step, "loss": loss})
        if on_step is not None:
            on_step(step, loss, tokens_seen / max(1e-9, time.monotonic() - start))

    sim.train(run.steps, step_done)
    elapsed = time.monotonic() - start
    model = sim.global_model().to(device)
    result = evaluate_lattice(model, dataset, paths, T, device, dense=dense,
                              max_documents_per_path=run.eval_documents or None)
    for mid in sim.module_ids:
        save_module(run.out, mid, model.module_state(mid), L.content_hash(), run_hash=cfg.content_hash(),
                    steps=str(run.steps))
    summary = SnapshotSummary.of(
        cfg, sim.module_ids, paths=[format_path(p) for p in paths], dense=dense,
        data_dir=str(Path(dataset.dir).resolve()), manifest_hash=dataset.manifest_hash,
        lattice_hash=L.content_hash(),
        workers=workers,
        outer_steps=outer_steps,
        steps=run.steps,
        seconds=round(elapsed, 2),
        tokens_per_s=round(tokens_seen / max(1e-9, elapsed), 1),
        first_loss=history[0]["loss"] if history else None,
        final_loss=history[-1]["loss"] if history else None,
        loss_history=history[:: max(1, len(history) // 100)],
        eval=result.to_dict(),
    ).to_dict()
    write_summary(run.out, summary)  # last: a directory without run.json is not a finished run
    return LocalRunResult(summary, result, run.out)
