"""``hivepath export``: one path of a trained run as a standalone model (safetensors + config)."""

from __future__ import annotations

import argparse
import logging

from hivepath.paths import dataset, read_dir, write_dir

__all__ = ["register", "run"]

log = logging.getLogger(__name__)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export",
        help="write one path of a trained run as a standalone model",
        description=(
            "Write path --path of the run in --from as a standalone model directory: model.safetensors with "
            "every tensor of the path's modules under '{module_id}.{name}', config.json (lattice, path, module "
            "ids, tokenizer) and the tokenizer files needed to decode. Written to a temporary directory and "
            "renamed. 'hivepath generate --from OUT' runs it."
        ),
    )
    p.add_argument("--from", dest="source", type=read_dir(), required=True, metavar="DIR", help="a run directory")
    p.add_argument("--path", required=True, metavar="I,J", help="the path to export, e.g. 0,1 or L0M0-L1M1")
    p.add_argument("--out", type=write_dir(atomic=True), required=True, metavar="OUT",
                   help="output directory (replaced if an earlier export)")
    p.add_argument("--data", type=dataset(), metavar="DIR",
                   help="the run's dataset (default: the one recorded in run.json)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from models.config import format_path, parse_path
    from models.export import export_path
    from models.run_dir import load_run_dir

    run_dir = load_run_dir(args.source, data_dir=args.data)
    L = run_dir.lattice
    path = L.check_path(parse_path(args.path, L.levels))
    out = export_path(run_dir, path, args.out)
    n = L.path_param_count(path)
    print(f"exported path {format_path(path)} ({' -> '.join(L.path_modules(path))}, {n:,} parameters) to {out}")
    return 0
