"""``hivepath data``: prepare token shards routed to lattice paths, and describe a prepared dataset."""

from __future__ import annotations

import argparse
import re
import sys

from hivepath.numbers import count, seed
from hivepath.paths import dataset, source, write_dir
from hivepath.progress import prepare_with_progress
from models import strict_json
from models.errors import DataError

__all__ = ["register", "run", "parse_lattice"]


def parse_lattice(text: str) -> tuple[int, int]:
    """``"2x2"`` -> ``(levels, modules_per_level)``."""
    m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", text)
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise DataError(f"--lattice '{text}' is not LEVELSxMODULES (e.g. 2x2)")
    return int(m.group(1)), int(m.group(2))


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "data",
        help="prepare token shards routed to lattice paths; describe a prepared dataset",
        description="Prepare and inspect datasets. See docs/data.md.",
    )
    dsub = p.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    prep = dsub.add_parser(
        "prepare",
        help="tokenise documents, route them to paths with prefix k-means, write shards and a manifest",
        description=(
            "Read documents from SRC files and directories (.txt .md .py .rst whole; .jsonl one document "
            "per line with a 'text' field), or the built-in corpus with --corpus default; split train/"
            "validation by a hash of each document; tokenise; cluster each document's first 32 tokens per "
            "lattice level (DiPaCo routing); write one memory-mapped shard per path and split, the router and "
            "a manifest. Identical input gives byte-identical output."
        ),
    )
    prep.add_argument("sources", nargs="*", type=source(), metavar="SRC", help="files or directories of documents")
    prep.add_argument("--corpus", choices=["default"], help="use the built-in corpus (Shakespeare, KJV Bible, Python stdlib)")
    prep.add_argument("--out", type=write_dir(atomic=True), required=True, metavar="DIR",
                      help="output directory (written atomically)")
    shape = prep.add_mutually_exclusive_group()
    shape.add_argument("--paths", type=count(), metavar="N", help="one level of N modules: N paths")
    shape.add_argument("--lattice", metavar="LxM", help="LEVELS x MODULES per level, e.g. 2x2 (default 2x2)")
    prep.add_argument("--tokenizer", default="bytes", metavar="SPEC", help="bytes (default) or bpe:VOCAB, BPE trained on the training split")
    prep.add_argument("--seed", type=seed(), default=0, metavar="N", help="k-means seed (default 0)")
    prep.set_defaults(func=run)

    info = dsub.add_parser("info", help="summarise a prepared dataset", description="Print a dataset's manifest summary.")
    info.add_argument("dir", type=dataset(), metavar="DIR", help="a directory written by 'hivepath data prepare'")
    info.add_argument("--json", action="store_true", help="print the whole manifest as JSON")
    info.add_argument("--verify", action="store_true", help="also check every file's sha256 against the manifest")
    info.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.data_command == "prepare":
        return _prepare(args)
    return _info(args)


def _prepare(args: argparse.Namespace) -> int:
    from models.data import Dataset

    if args.paths is not None:
        if args.paths < 1:
            raise DataError(f"--paths must be >= 1, got {args.paths}")
        levels, modules = 1, args.paths
    else:
        levels, modules = parse_lattice(args.lattice or "2x2")
    if not args.sources and not args.corpus:
        raise DataError("no sources given; pass files or directories, or --corpus default")
    prepare_with_progress(args.sources, args.corpus, args.out, levels, modules, args.tokenizer, args.seed)
    ds = Dataset(args.out)
    t = ds.manifest["totals"]
    print(f"prepared {args.out}: {t['train']['documents']} training and {t['validation']['documents']} validation "
          f"documents, {t['train']['tokens']} training tokens, {levels}x{modules} lattice, manifest {ds.manifest_hash}")
    return 0


def _info(args: argparse.Namespace) -> int:
    from models.data import Dataset

    ds = Dataset(args.dir)
    if args.verify:
        ds.verify()
    m = ds.manifest
    if args.json:
        strict_json.dump({"manifest_hash": ds.manifest_hash, **m}, sys.stdout, indent=1, sort_keys=True)
        print()
        return 0
    print(f"dataset {args.dir}  manifest {ds.manifest_hash}")
    print(f"corpus {m['corpus']}  tokenizer {m['tokenizer']}  lattice {ds.levels}x{ds.modules_per_level}")
    if m["documents_skipped"]:
        print("skipped: " + ", ".join(f"{n} {why}" for why, n in m["documents_skipped"].items()))
    print(f"{'path':>8} {'train docs':>10} {'train tokens':>13} {'val docs':>9} {'val tokens':>11}  sources (train tokens)")
    for name, s in sorted(m["shards"].items()):
        src = ", ".join(f"{k} {v}" for k, v in s["train"]["sources"].items())
        print(f"{name.replace('-', ','):>8} {s['train']['documents']:>10} {s['train']['tokens']:>13} "
              f"{s['validation']['documents']:>9} {s['validation']['tokens']:>11}  {src}")
    if args.verify:
        print("all files match the manifest")
    return 0
