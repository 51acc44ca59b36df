"""``hivepath train-local``: train paths of the lattice (or the dense model) in one process.

With several workers it simulates DiLoCo/DiPaCo (``peer.simulator``), the numerical reference of
the networked run. Writes per-module safetensors checkpoints and ``run.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

from hivepath.cli import env_default
from models.errors import ConfigError, DataError

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
    p.add_argument("--config", metavar="RUN.TOML", help="run config file (overrides the preset)")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--path", metavar="I,J", help="train one path, e.g. 0,1")
    which.add_argument("--all-paths", action="store_true", help="train every path (default for a lattice)")
    which.add_argument("--dense", action="store_true", help="train a 1x1 lattice of the same width on all data")
    p.add_argument("--workers", type=int, metavar="K", help="simulated DiLoCo workers (default: one per path)")
    p.add_argument("--inner-steps", type=int, metavar="H", help="inner steps between outer steps (default from config); one worker on one path "
                   "trains without outer steps unless this is given")
    p.add_argument("--steps", type=int, default=200, metavar="N", help="inner steps per worker (default 200)")
    p.add_argument("--codec", choices=["none", "fp16", "int8", "int4"], help="pseudo-gradient codec")
    p.add_argument("--outer-lr", type=float, metavar="LR", help="outer learning rate (default 0.7)")
    p.add_argument("--outer-momentum", type=float, metavar="M", help="outer Nesterov momentum (default 0.9)")
    p.add_argument("--lr-decay", action="store_true",
                   help="decay the inner learning rate (cosine, to a tenth) over --steps instead of keeping it constant")
    p.add_argument("--seed", type=int, metavar="N", help="seed of the initial weights and batches")
    p.add_argument("--data", metavar="DIR", help="a prepared dataset (default: the built-in corpus, cached)")
    p.add_argument("--out", metavar="DIR", help="output directory (default runs/TIMESTAMP)")
    p.add_argument("--device", default="auto", help="auto (CUDA if available), cpu or cuda")
    p.add_argument("--threads", type=int, default=env_default("HIVEPATH_THREADS", None, int), metavar="N",
                   help="CPU threads for torch (env HIVEPATH_THREADS; default: torch's choice)")
    p.add_argument("--eval-docs", type=int, default=64, metavar="N",
                   help="validation documents per path for the final bits per byte (0: all; default 64)")
    p.set_defaults(func=run)


def resolve_config(args: argparse.Namespace):
    """Preset, then ``--config``, then flags; ``--dense`` turns the lattice into 1x1."""
    from models.config import PRESETS, load_run_config

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
    from hivepath.cmd_data import prepare_dataset
    from models.data import Dataset

    L = cfg.lattice
    if args.data:
        return Dataset(args.data)
    shape = (2, 2) if (L.levels, L.modules_per_level) == (1, 1) else (L.levels, L.modules_per_level)
    path = default_data_dir(cfg.data.tokenizer, *shape)
    if not (path / "manifest.json").exists():
        log.info("preparing the built-in corpus into %s (once)", path)
        prepare_dataset([], "default", str(path), shape[0], shape[1], cfg.data.tokenizer)
    return Dataset(path)


def run(args: argparse.Namespace) -> int:
    import torch
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from models.checkpoint import save_module, write_summary
    from models.config import parse_path, format_path
    from models.evaluate import bits_per_byte, routed_evaluation
    from models.training import pick_device
    from peer.simulator import DiLoCoSimulator

    if args.threads is not None:
        if args.threads < 1:
            raise ConfigError("threads", f"must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    cfg = resolve_config(args)
    ds = _dataset(args, cfg)
    if ds.manifest["vocab_size"] != cfg.lattice.vocab_size:
        log.info("vocab_size set to %d to match the dataset's tokenizer", ds.manifest["vocab_size"])
        cfg = cfg.replace(lattice={"vocab_size": ds.manifest["vocab_size"]})
    cfg = cfg.replace(data={"manifest_hash": ds.manifest_hash, "tokenizer": ds.manifest["tokenizer"]})
    L = cfg.lattice
    dense = (L.levels, L.modules_per_level) == (1, 1)
    if args.path is not None and not dense:
        paths = [L.check_path(parse_path(args.path, L.levels))]
    elif dense:
        paths = [(0,)]
    else:
        paths = L.paths()
    if not dense and (ds.levels, ds.modules_per_level) != (L.levels, L.modules_per_level):
        raise DataError(
            f"dataset {ds.dir} is routed for a {ds.levels}x{ds.modules_per_level} lattice but the run's lattice is "
            f"{L.levels}x{L.modules_per_level}; prepare it with --lattice {L.levels}x{L.modules_per_level}"
        )
    workers = args.workers if args.workers is not None else len(paths)
    if workers < 1:
        raise ConfigError("workers", f"must be >= 1, got {workers}")
    if args.steps < 1:
        raise ConfigError("steps", f"must be >= 1, got {args.steps}")
    outer_steps = not (workers == 1 and len(paths) == 1 and args.inner_steps is None)
    device = pick_device(args.device)
    torch.manual_seed(cfg.seed)

    B, T = cfg.inner.batch_size, L.seq_len

    def batches(k: int, path):
        seed = cfg.seed * 1_000_003 + k
        if dense:
            return ds.dense_batches("train", B, T, seed)
        return ds.path_batches(path, "train", B, T, seed)

    try:
        sim = DiLoCoSimulator(cfg, paths, workers, batches, device=device, outer_steps=outer_steps)
    except ValueError as e:
        raise ConfigError("workers", str(e)) from None
    out = Path(args.out or Path("runs") / time.strftime("%Y%m%d-%H%M%S"))
    console = Console(stderr=True)
    console.log(f"{'dense' if dense else str(len(paths)) + ' path(s)'}, {workers} worker(s), "
                f"{'H=' + str(cfg.outer.inner_steps) + ' codec ' + cfg.outer.codec if outer_steps else 'no outer steps'}, "
                f"{L.path_param_count(paths[0]):,} parameters per path, device {device}, data {ds.dir}")
    history: list[dict] = []
    start = time.monotonic()
    with Progress(TextColumn("[bold]train-local"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("loss {task.fields[loss]:.3f}"), TextColumn("{task.fields[tps]:,.0f} tok/s"),
                  TimeRemainingColumn(), console=console) as bar:
        task = bar.add_task("train", total=args.steps, loss=float("nan"), tps=0.0)
        tokens_seen = [0]

        def on_step(step: int, loss: float, tokens: int) -> None:
            tokens_seen[0] += tokens
            tps = tokens_seen[0] / max(1e-9, time.monotonic() - start)
            bar.update(task, completed=step, loss=loss, tps=tps)
            history.append({"step": step, "loss": loss})

        sim.train(args.steps, on_step)
    elapsed = time.monotonic() - start
    model = sim.global_model().to(device)
    max_docs = args.eval_docs or None
    if dense:
        result = bits_per_byte(model.path_model((0,)), ds.validation_documents(), T, device, max_documents=max_docs)
        result.per_path = {"dense": {"bpb": result.bpb, "bytes": result.n_bytes, "documents": result.documents}}
    else:
        result = routed_evaluation(model.path_model, ds, paths, T, device, max_documents_per_path=max_docs)
    for mid in sim.module_ids:
        save_module(out, mid, model.module_state(mid), L.content_hash(), run_hash=cfg.content_hash(),
                    steps=str(args.steps))
    summary = {
        "config": cfg.to_dict(),
        "config_hash": cfg.content_hash(),
        "lattice_hash": L.content_hash(),
        "dense": dense,
        "paths": [format_path(p) for p in paths],
        "modules": sim.module_ids,
        "workers": workers,
        "outer_steps": outer_steps,
        "steps": args.steps,
        "data": {"dir": str(Path(ds.dir).resolve()), "manifest_hash": ds.manifest_hash},
        "seconds": round(elapsed, 2),
        "tokens_per_s": round(tokens_seen[0] / max(1e-9, elapsed), 1),
        "first_loss": history[0]["loss"] if history else None,
        "final_loss": history[-1]["loss"] if history else None,
        "loss_history": history[:: max(1, len(history) // 100)],
        "eval": result.to_dict(),
    }
    write_summary(out, summary)  # last: a directory without run.json is not a finished run
    for name, r in result.per_path.items():
        if "bpb" in r and r["documents"]:
            console.print(f"path {name}: {r['bpb']:.3f} bits/byte on {r['documents']} validation documents")
    console.print(f"validation: {result.bpb:.3f} bits/byte{' (routed)' if not dense and len(paths) > 1 else ''}; "
                  f"loss {summary['first_loss']:.3f} -> {summary['final_loss']:.3f}; checkpoints in {out}")
    return 0
