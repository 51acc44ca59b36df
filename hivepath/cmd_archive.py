"""``hivepath archive``: keep every module's latest state on disk and serve it to newcomers.

Shares ``peer join``'s network flags and start-up (``hivepath.options``, ``peer.node.startup``): the
first SIGTERM, SIGINT or SIGHUP stops it cleanly (leave, exit 0), a second at once.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hivepath.numbers import count, natural, seconds
from hivepath.options import add_network_flags, network_options
from hivepath.paths import dataset, write_dir
from hivepath.settings import env_default
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
    p.add_argument("--dir", type=write_dir(), default=env_default("HIVEPATH_ARCHIVE_DIR"), metavar="DIR",
                   help="where snapshots go (env HIVEPATH_ARCHIVE_DIR; required)")
    add_network_flags(p)
    p.add_argument("--data", type=dataset(), default=env_default("HIVEPATH_DATA"), metavar="DIR",
                   help="the run's prepared dataset, recorded in snapshots for eval and seeded to peers, who then need "
                   "no data of their own (env HIVEPATH_DATA)")
    p.add_argument("--no-seed", action="store_true", default=env_default("HIVEPATH_NO_SEED"),
                   help="do not seed --data to peers (env HIVEPATH_NO_SEED=1)")
    p.add_argument("--keep", type=count(), default=env_default("HIVEPATH_ARCHIVE_KEEP"), metavar="K",
                   help="snapshots to keep (env HIVEPATH_ARCHIVE_KEEP; default 3)")
    p.add_argument("--poll-interval", type=seconds(), default=1.0, metavar="S",
                   help="seconds between looks at the modules' rounds (default 1)")
    p.add_argument("--eval-docs", type=natural(), default=env_default("HIVEPATH_ARCHIVE_EVAL_DOCS"), metavar="N",
                   help="validation documents per path scored on a new snapshot, shown on the coordinator's status "
                   "page; 0 scores nothing (env HIVEPATH_ARCHIVE_EVAL_DOCS; default 4; needs --data)")
    p.add_argument("--eval-interval", type=seconds(), default=env_default("HIVEPATH_ARCHIVE_EVAL_INTERVAL"),
                   metavar="S", help="seconds between two scorings at least (env HIVEPATH_ARCHIVE_EVAL_INTERVAL; "
                   "default 120)")
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
