"""``hivepath archive``: keep every module's latest state on disk and serve it to newcomers."""

from __future__ import annotations

import argparse
from pathlib import Path

from hivepath.cli import env_default
from hivepath.cmd_peer import add_network_flags, check_status_flags, drain_signals, read_token
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
    p.add_argument("--dir", default=env_default("HIVEPATH_ARCHIVE_DIR"), metavar="DIR",
                   help="where snapshots go (env HIVEPATH_ARCHIVE_DIR; required)")
    add_network_flags(p)
    p.add_argument("--data", default=env_default("HIVEPATH_DATA"), metavar="DIR",
                   help="the run's prepared dataset, recorded in snapshots for eval (env HIVEPATH_DATA)")
    p.add_argument("--keep", type=int, default=env_default("HIVEPATH_ARCHIVE_KEEP", 3, int), metavar="K",
                   help="snapshots to keep (env HIVEPATH_ARCHIVE_KEEP; default 3)")
    p.add_argument("--poll-interval", type=float, default=1.0, metavar="S",
                   help="seconds between looks at the modules' rounds (default 1)")
    p.add_argument("--progress", default="json", choices=["json"], help=argparse.SUPPRESS)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from peer.node import ArchiveOptions, ArchivePeer

    if not args.dir:
        raise HivepathError("no archive directory: pass --dir DIR or set HIVEPATH_ARCHIVE_DIR")
    if not args.coordinator:
        raise HivepathError("no coordinator address: pass --coordinator HOST:PORT or set HIVEPATH_COORDINATOR")
    check_status_flags(args)
    opts = ArchiveOptions(
        coordinator=args.coordinator,
        token=read_token(args.token, args.token_file),
        directory=Path(args.dir),
        initial_peers=tuple(args.initial_peers),
        identity=Path(args.identity).expanduser() if args.identity else None,
        data_dir=Path(args.data).expanduser() if args.data else None,
        host_maddrs=tuple(args.host_maddrs),
        announce_maddrs=tuple(args.announce_maddrs),
        keep=args.keep,
        poll_interval=args.poll_interval,
        tls_ca=args.tls_ca,
        status_port=args.status_port,
        stall_timeout=args.stall_timeout,
    )
    archive = ArchivePeer(opts)
    with drain_signals(archive.request_stop):
        return archive.run()
