"""Entry point of the ``hivepath`` command.

Configuration precedence, highest first: command-line flags, ``HIVEPATH_*`` environment variables
(for containers; each flag's help names its variable), the run config file, the named preset.
Errors a user can fix (:class:`models.errors.HivepathError`) print one line and exit with the
error's code; see ``docs/cli.md`` for the codes.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import pkgutil
import sys
from typing import Optional, Sequence

from models.errors import HivepathError

__all__ = ["main", "build_parser", "env_default"]

log = logging.getLogger("hivepath")


def env_default(var: str, default=None, cast=str):
    """The value of environment variable ``var`` cast with ``cast``, else ``default``."""
    raw = os.environ.get(var)
    if raw is None or raw == "":
        return default
    try:
        return cast(raw)
    except (TypeError, ValueError):
        raise HivepathError(f"environment variable {var}={raw!r} is not a valid {cast.__name__}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hivepath",
        description=(
            "Train one language model together with volunteers: a DiPaCo lattice of modules, "
            "averaged DiLoCo-style over a DHT, coordinated by a small service."
        ),
        epilog="Run 'hivepath COMMAND --help' for a command's options.",
    )
    parser.add_argument(
        "--log-level",
        default=env_default("HIVEPATH_LOG_LEVEL", "INFO"),
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="logging verbosity (env HIVEPATH_LOG_LEVEL; default INFO)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    import hivepath

    for info in sorted(pkgutil.iter_modules(hivepath.__path__), key=lambda m: m.name):
        if info.name.startswith("cmd_"):
            importlib.import_module(f"hivepath.{info.name}").register(sub)
    return parser


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Parse, run the chosen subcommand, and turn user errors into one clear line and an exit code."""
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        _setup_logging(args.log_level)
        return int(args.func(args) or 0)
    except HivepathError as e:
        print(f"hivepath: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("hivepath: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
