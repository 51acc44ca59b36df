"""``hivepath train-local``: train paths of the lattice (or the dense model) in one process.

With several workers it simulates DiLoCo/DiPaCo (``peer.simulator``), the numerical reference of
the networked run. Writes per-module safetensors checkpoints and ``run.json`` to ``--out``. This
module picks the config (preset, file, flags) and the dataset and shows the progress;
:func:`peer.simulator.train_local` does the run.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

from hivepath.numbers import Number, count, natural, positive, seed
from hivepath.paths import dataset, text_file, write_dir
from hivepath.progress import prepare_with_progress
from hivepath.settings import add_flag
from models.errors import ConfigError

__all__ = ["register", "run", "resolve_config", "default_data_dir"]

log = logging.getLogger(__name__)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train-local",
        help="train paths (or the dense model) in one process; simulate K DiLoCo workers",
        description=(
            "Train one path on its shard, every path (DiPaCo), or the dense 1x1 model on all data, in one "
            "process. --workers K --inner-steps H simulates K DiLoCo workers with outer Nesterov SGD every H "
            "inner AdamW steps. Without --data the built-in corpus is prepared once and cached under "
            "data/default-TOKENIZER. Ends with validation bits per byte (routed when several paths train) "
            "and writes per-module safetensors and run.json to --out."
        ),
    )
    p.add_argument("--preset", choices=["tiny", "demo", "dense"], default=None, help="named config (default tiny)")
    p.add_argument("--config", type=text_file(), metavar="RUN.TOML", help="run config file (overrides the preset)")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--path", metavar="I,J", help="train one path, e.g. 0,1")
    which.add_argument("--all-paths", action="store_true", help="train every path (default for a lattice)")
    which.add_argument("--dense", action="store_true", help="train a 1x1 lattice of the same width on all data")
    p.add_argument("--workers", type=count(), metavar="K", help="simulated DiLoCo workers (default: one per path)")
    p.add_argument("--inner-steps", type=count(), metavar="H", help="inner steps between outer steps (default from config); one worker on one path "
                   "trains without outer steps unless this is given")
    p.add_argument("--steps", type=count(), default=200, metavar="N", help="inner steps per worker (default 200)")
    p.add_argument("--codec", choices=["none", "fp16", "int8", "int4"], help="pseudo-gradient codec")
    p.add_argument("--outer-lr", type=positive(), metavar="LR", help="outer learning rate (default 0.7)")
    p.add_argument("--outer-momentum", type=Number(float, 0.0, 0.999), metavar="M", help="outer Nesterov momentum (default 0.9)")
    p.add_argument("--lr-decay", action="store_true",
                   help="decay the inner learning rate (cosine, to a tenth) over --steps instead of keeping it constant")
    p.add_argument("--seed", type=seed(), metavar="N", help="seed of the initial weights and batches")
    p.add_argument("--data", type=dataset(), metavar="DIR",
                   help="a prepared dataset (default: the built-in corpus, cached)")
    p.add_argument("--out", type=write_dir(), metavar="DIR", help="output directory (default runs/TIMESTAMP)")
    p.add_argument("--device", default="auto", help="auto (CUDA if available), cpu or cuda")
    add_flag(p, "HIVEPATH_THREADS", help="CPU threads for torch (default: torch's choice)")
    p.add_argument("--eval-docs", type=natural(), default=64, metavar="N",
                   help="validation documents per path for the final bits per byte (0: all; default 64)")
    p.set_defaults(func=run)


def resolve_config(args: argparse.Namespace):
    """Preset, then ``--config``, then flags; ``--dense`` turns the lattice into 1x1."""
    from models.presets import PRESETS, load_run_config

    if args.config:
        cfg = load_run_config(args.config)
        if args.preset:
            raise ConfigError("preset", "give --preset or --config (a config file names its own preset)")
    else:
        cfg = PRESETS[args.preset or "tiny"]()
    outer = {}
    if args.inner_steps is not None:
        outer["inner_steps"] = args.inner_steps
    if args.codec is not None:
        outer["codec"] = args.codec
    if args.outer_lr is not None:
        outer["lr"] = args.outer_lr
    if args.outer_momentum is not None:
        outer["momentum"] = args.outer_momentum
    changes: dict = {"outer": outer} if outer else {}
    if getattr(args, "lr_decay", False):
        if args.steps <= cfg.inner.warmup_steps:
            raise ConfigError("steps", f"--lr-decay needs --steps above the warm-up ({cfg.inner.warmup_steps} steps)")
        changes["inner"] = {"decay_steps": args.steps}
    if args.seed is not None:
        changes["seed"] = args.seed
    if args.dense:
        changes["lattice"] = {"levels": 1, "modules_per_level": 1}
    return cfg.replace(**changes) if changes else cfg


def default_data_dir(tokenizer: str, levels: int, modules: int) -> Path:
    """``data/default-TOKENIZER`` for the presets' 2x2 shape (and dense runs); suffixed otherwise."""
    name = f"default-{tokenizer.replace(':', '')}"
    if (levels, modules) not in ((2, 2), (1, 1)):
        name += f"-{levels}x{modules}"
    return Path("data") / name


def _dataset(args, cfg):
    from models.data import Dataset, prepared

    L = cfg.lattice
    if args.data:
        return Dataset(args.data)
    shape = (2, 2) if (L.levels, L.modules_per_level) == (1, 1) else (L.levels, L.modules_per_level)
    path = default_data_dir(cfg.data.tokenizer, *shape)
    def make(out: Path) -> None:
        log.info("preparing the built-in corpus into %s (once)", out)
        prepare_with_progress([], "default", str(out), shape[0], shape[1], cfg.data.tokenizer)

    return prepared(path, make=make)


def run(args: argparse.Namespace) -> int:
    """``hivepath train-local``: config and dataset from the flags, :func:`peer.simulator.train_local`
    behind a progress bar, then the bits per byte."""
    import torch
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    from peer.simulator import LocalRun, train_local

    if args.threads is not None:
        if args.threads < 1:
            raise ConfigError("threads", f"must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    cfg = resolve_config(args)
    local = LocalRun(out=Path(args.out or Path("runs") / time.strftime("%Y%m%d-%H%M%S")), path=args.path,
                     workers=args.workers, steps=args.steps, outer_steps_asked=args.inner_steps is not None,
                     device=args.device, eval_documents=args.eval_docs)
    ds = _dataset(args, cfg)
    console = Console(stderr=True)
    with Progress(TextColumn("[bold]train-local"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("loss {task.fields[loss]:.3f}"), TextColumn("{task.fields[tps]:,.0f} tok/s"),
                  TimeRemainingColumn(), console=console) as bar:
        task = bar.add_task("train", total=args.steps, loss=float("nan"), tps=0.0)
        done = train_local(cfg, ds, local, on_start=console.log,
                           on_step=lambda step, loss, tps: bar.update(task, completed=step, loss=loss, tps=tps))
    summary, result = done.summary, done.result
    for name, r in result.per_path.items():
        if "bpb" in r and r["documents"]:
            console.print(f"path {name}: {r['bpb']:.3f} bits/byte on {r['documents']} validation documents")
    routed = " (routed)" if not summary["dense"] and len(summary["paths"]) > 1 else ""
    console.print(f"validation: {result.bpb:.3f} bits/byte{routed}; "
                  f"loss {summary['first_loss']:.3f} -> {summary['final_loss']:.3f}; checkpoints in {done.out}")
    return 0
