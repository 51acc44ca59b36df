"""``hivepath archive``: keep every module's latest state on disk and serve it to newcomers.

Shares ``peer join``'s network flags and start-up (``hivepath.options``, ``peer.node.startup``): the
first SIGTERM, SIGINT or SIGHUP stops it cleanly (leave, exit 0), a second at once.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hivepath.numbers import seconds
from hivepath.options import add_network_flags, network_options
from hivepath.paths import dataset, write_dir
from hivepath.settings import add_flag
from models.errors import HivepathError

__all__ = ["register", "run"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "archive",
        help="run an archive peer: follow every module's rounds, keep states on disk, serve newcomers",
        description=(
            "Run an archive peer on a stable machine. It trains nothing: it follows every module's outer "
            "rounds, fetches each module's state when its holders move ahead, writes a snapshot (a run "
            "directory readable by eval/generate/export) and keeps the last K, and serves module states "
            "to newcomers, so the run survives the loss of every trainer of a module."
        ),
    )
    add_flag(p, "HIVEPATH_ARCHIVE_DIR", type=write_dir())
    add_network_flags(p)
    add_flag(p, "HIVEPATH_DATA", type=dataset(), help="the run's prepared dataset, recorded in snapshots for eval and "
             "seeded to peers, who then need no data of their own")
    add_flag(p, "HIVEPATH_NO_SEED", help="do not seed --data to peers")
    add_flag(p, "HIVEPATH_ARCHIVE_KEEP")
    p.add_argument("--poll-interval", type=seconds(), default=1.0, metavar="S",
                   help="seconds between looks at the modules' rounds (default 1)")
    add_flag(p, "HIVEPATH_ARCHIVE_EVAL_DOCS")
    add_flag(p, "HIVEPATH_ARCHIVE_EVAL_INTERVAL")
    p.add_argument("--progress", default="json", choices=["json"], help=argparse.SUPPRESS)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """``hivepath archive``: the flags as :class:`peer.node.ArchiveOptions`, run until stopped."""
    if not args.dir:
        raise HivepathError("no archive directory: pass --dir DIR or set HIVEPATH_ARCHIVE_DIR")
    network = network_options(args)  # bad flags: one line before torch loads
    from peer.node import ArchiveOptions, ArchivePeer, run_until_stopped

    opts = ArchiveOptions(
        network=network,
        directory=Path(args.dir),
        data_dir=Path(args.data).expanduser() if args.data else None,
        seed=not args.no_seed,
        keep=args.keep,
        poll_interval=args.poll_interval,
        eval_documents=args.eval_docs,
        eval_interval=args.eval_interval,
    )
    return run_until_stopped(ArchivePeer(opts))
