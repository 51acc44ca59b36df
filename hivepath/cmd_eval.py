"""``hivepath eval``: routed validation bits per byte of a trained run, per path and overall."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hivepath.numbers import natural
from hivepath.paths import dataset, read_dir
from hivepath.settings import add_flag
from models import strict_json

__all__ = ["register", "run", "load_run"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "eval",
        help="routed validation bits per byte of a trained run, per path and overall",
        description=(
            "Load a run directory written by 'hivepath train-local' (run.json and modules/*.safetensors), "
            "route every validation document of its dataset to a path by its prefix, and report bits per "
            "byte per path and pooled over the paths the run trained."
        ),
    )
    p.add_argument("--from", dest="run_dir", type=read_dir(), required=True, metavar="DIR",
                   help="a train-local output directory")
    p.add_argument("--data", type=dataset(), metavar="DIR",
                   help="dataset directory (default: the one recorded in run.json)")
    p.add_argument("--max-docs", type=natural(), default=0, metavar="N", help="validation documents per path (0: all)")
    p.add_argument("--device", default="auto", help="auto (CUDA if available), cpu or cuda")
    add_flag(p, "HIVEPATH_THREADS", help="CPU threads for torch")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.set_defaults(func=run)


def load_run(run_dir: str | Path):
    """``(summary, RunConfig, ModularLM)`` of a train-local run directory (CPU, global weights)."""
    from models.run_dir import load_run_dir

    return load_run_dir(run_dir, with_data=False).as_tuple()


def run(args: argparse.Namespace) -> int:
    import torch

    from models.config import parse_path
    from models.data import Dataset
    from models.evaluate import evaluate_lattice
    from models.run_dir import load_run_dir
    from models.training import pick_device

    if args.threads:
        torch.set_num_threads(args.threads)
    rd = load_run_dir(args.run_dir, data_dir=args.data)  # refuses a dataset with another manifest
    summary, cfg, model = rd.as_tuple()
    ds = Dataset(rd.data_dir)
    device = pick_device(args.device)
    model.to(device)
    paths = [] if summary["dense"] else [parse_path(p, cfg.lattice.levels) for p in summary["paths"]]
    result = evaluate_lattice(model, ds, paths, cfg.lattice.seq_len, device, dense=summary["dense"],
                              max_documents_per_path=args.max_docs or None)
    if args.json:
        strict_json.dump(result.to_dict(), sys.stdout, sort_keys=True)
        print()
        return 0
    print(f"{'path':>8} {'bits/byte':>10} {'documents':>10} {'bytes':>10}")
    for name, r in result.per_path.items():
        if "bpb" in r:
            bpb = f"{r['bpb']:>10.4f}" if r["documents"] else f"{'-':>10}"
            print(f"{name:>8} {bpb} {r['documents']:>10} {r['bytes']:>10}")
    if "unrouted" in result.per_path:
        print(f"({result.per_path['unrouted']['documents']} documents route to paths this run did not train)")
    print(f"{'overall':>8} {result.bpb:>10.4f} {result.documents:>10} {result.n_bytes:>10}")
    return 0
