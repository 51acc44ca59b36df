"""``hivepath demo``: a coordinator, an archive and N peers on this machine, training for a few minutes."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hivepath.numbers import count, natural, positive
from hivepath.paths import dataset, write_dir

__all__ = ["register", "run"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="run a whole network on this machine for a few minutes and report what it learned",
        description=(
            "Start a coordinator, an archive peer and N peers (and --small-peers more, too small for a path: stage "
            "servers and pipeline trainers) as real processes on loopback, train the demo preset's 2x2 lattice on "
            "the built-in corpus, show a live table of peers, their roles and rounds, and at the end print routed "
            "validation bits per byte before and after, the bytes exchanged against synchronous data-parallel "
            "training and each peer's role and tokens. Writes runs/ID/report.md (with loss curves) and runs/ID/summary.json. "
            "Ctrl-C stops every process cleanly; a second Ctrl-C kills them."
        ),
    )
    p.add_argument("--peers", type=count(), default=4, help="volunteer peers to start (default 4)")
    p.add_argument("--small-peers", type=natural(), default=0, metavar="N",
                   help="more peers with a --max-memory too small for a path but enough for a pipeline stage or "
                        "trainer: they serve stages and drive pipelines on the same lattice (3 or more form a "
                        "pipeline on a 2x2 lattice; default 0)")
    p.add_argument("--minutes", type=positive(), default=3.0, help="training time in minutes (default 3)")
    p.add_argument("--preset", default="demo", help="run preset: demo (default), tiny or dense")
    p.add_argument("--out", type=write_dir(), metavar="DIR", help="run directory (default runs/demo-<time>)")
    p.add_argument("--data", type=dataset(prepare=True), metavar="DIR",
                   help="prepared dataset (default data/default-bytes-2x2, prepared once)")
    p.add_argument("--eval-docs", type=count(), default=40, metavar="N",
                   help="validation documents per path for before/after bits per byte (default 40)")
    p.add_argument("--no-live", action="store_true",
                   help="no live table: a progress line every HIVEPATH_PROGRESS_INTERVAL seconds (default 5) and one "
                        "line per event of a peer, through the log (what the demo does when stderr is not a terminal, "
                        "or with --log-format json)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from peer.demo import DemoOptions, role_lines, run_demo

    summary = run_demo(DemoOptions(
        peers=args.peers, small_peers=args.small_peers, minutes=args.minutes, preset=args.preset,
        out=Path(args.out) if args.out else None, data=Path(args.data) if args.data else None,
        eval_documents=args.eval_docs,
        live=not args.no_live and sys.stderr.isatty() and getattr(args, "log_format", "text") != "json",
    ))
    ratio = summary["ddp_bytes_equivalent"] / max(1, summary["bytes_exchanged"])
    if summary["bpb_after"] is None:
        print(f"routed validation bits per byte: {summary['bpb_before']:.3f} before; stopped ({summary['stopped_by']}) "
              "before any module finished an averaging round, so nothing trained to score")
    else:
        print(f"routed validation bits per byte: {summary['bpb_before']:.3f} before -> {summary['bpb_after']:.3f} after")
    print(f"bytes exchanged: {summary['bytes_exchanged'] / 1e6:.1f} MB; synchronous data-parallel would have sent "
          f"{summary['ddp_bytes_equivalent'] / 1e6:.1f} MB ({ratio:,.0f}x more) for the same {summary['tokens']:,} tokens")
    print("peers (role, work, tokens):")
    for line in role_lines(summary):
        print(f"  {line}")
    print(f"report: {summary['report']}")
    return 0
