"""``hivepath generate``: continue a prompt with a trained run or an exported path.

The router picks the path for the prompt from its prefix (DiPaCo's coarse routing), optionally
re-routing every W generated tokens; then the path samples with temperature and top-k.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from hivepath.numbers import count, natural, positive, seed
from hivepath.paths import dataset, read_dir
from hivepath.settings import add_flag
from models import strict_json
from models.errors import DataError

__all__ = ["register", "run", "open_source"]

log = logging.getLogger(__name__)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="continue a prompt: the router picks the path, the path samples",
        description=(
            "Load a run directory (written by 'hivepath train-local') or an exported path (written by "
            "'hivepath export'), route the prompt to a path by its first 32 tokens, and sample a continuation "
            "with temperature and top-k. A path whose modules the run lacks falls back to the nearest complete "
            "path (logged). Prints the prompt followed by the continuation."
        ),
    )
    p.add_argument("prompt", metavar="PROMPT", help="text to continue")
    p.add_argument("--from", dest="source", type=read_dir(), required=True, metavar="DIR",
                   help="a run directory or an exported path")
    p.add_argument("--max-tokens", type=count(), default=64, metavar="N", help="tokens to generate (default 64)")
    p.add_argument("--temperature", type=positive(), default=0.8, metavar="T", help="sampling temperature > 0 (default 0.8)")
    p.add_argument("--top-k", type=natural(), default=40, metavar="K", help="sample among the K likeliest tokens (0: all; default 40)")
    p.add_argument("--seed", type=seed(), default=0, metavar="S", help="sampling seed (default 0)")
    p.add_argument("--reroute-every", type=natural(), default=0, metavar="W",
                   help="re-route on the last 32 tokens every W generated tokens (default 0: route once)")
    p.add_argument("--path", metavar="I,J", help="force a path, e.g. 0,1 (no routing)")
    p.add_argument("--data", type=dataset(), metavar="DIR",
                   help="the run's dataset (default: the one recorded in run.json)")
    p.add_argument("--device", default="auto", help="auto (CUDA if available), cpu or cuda")
    add_flag(p, "HIVEPATH_THREADS", help="CPU threads for torch")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.set_defaults(func=run)


def open_source(directory: str | Path, data_dir: str | None = None):
    """A :class:`models.generate.PathSource` for a run directory, an exported path, or a checkpoint
    root of a peer or the archive (its newest snapshot)."""
    from models.checkpoint import (
        EXPORT_CONFIG_FILE,
        RUN_FILE,
        is_run_dir,
        resolve_snapshot,
    )
    from models.export import load_export
    from models.run_dir import load_run_dir

    directory = resolve_snapshot(Path(directory))
    if not is_run_dir(directory) and (directory / EXPORT_CONFIG_FILE).exists():
        return load_export(directory)
    if directory.is_dir() and not is_run_dir(directory):
        from models.run_dir import no_snapshot_yet

        if no_snapshot_yet(directory):
            raise DataError(no_snapshot_yet(directory))
        raise DataError(f"{directory} holds neither {RUN_FILE} nor {EXPORT_CONFIG_FILE}; pass a run directory "
                        "('hivepath train-local --out') or an export ('hivepath export --out')")
    return load_run_dir(directory, data_dir=data_dir)


def run(args: argparse.Namespace) -> int:
    import torch

    from models.config import format_path, parse_path
    from models.errors import ConfigError
    from models.generate import PromptError, SamplingConfig, generate
    if args.threads is not None:
        if args.threads < 1:
            raise ConfigError("threads", f"must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    sampling = SamplingConfig(max_new_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                              seed=args.seed, reroute_every=args.reroute_every)
    if not args.prompt:
        raise PromptError('the prompt is empty; give some text to continue, e.g. "To be, or not"')
    source = open_source(args.source, args.data)
    path = source.lattice.check_path(parse_path(args.path, source.lattice.levels)) if args.path else None
    result = generate(source, args.prompt, sampling, path=path, device=_device(args.device))
    for d in result.decisions:
        if d.reason == "fallback":
            log.warning("token %d: the router chose path %s, absent here; used the nearest complete path %s",
                        d.at_token, format_path(d.routed), format_path(d.path))
    if args.json:
        strict_json.dump(result.to_dict(), sys.stdout, sort_keys=True)
        print()
    else:
        print(_describe_paths(result.decisions), file=sys.stderr)
        print(result.prompt + result.text)
    return 0


def _describe_paths(decisions) -> str:
    """``[path 0,1 (router); 1,1 from token 8]``: the path changes of a generation, on one line."""
    parts, last = [], None
    for d in decisions:
        if d.path != last:
            where = f"({d.reason})" if not parts else f"from token {d.at_token} ({d.reason})"
            parts.append(f"{','.join(map(str, d.path))} {where}")
            last = d.path
    return f"[path {'; '.join(parts)}]"


def _device(name: str):
    """``--device`` as a torch device, refusing unknown names and CUDA on a machine without it."""
    import torch

    from models.errors import ConfigError
    from models.training import pick_device

    try:
        device = pick_device(name)
    except RuntimeError:
        raise ConfigError("device", f"'{name}' is not a device; use auto, cpu or cuda") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device", "cuda was asked for but no CUDA device is available; use --device cpu or auto")
    return device
