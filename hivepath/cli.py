"""Entry point of the ``hivepath`` command.

Configuration precedence, highest first: command-line flags, ``HIVEPATH_*`` environment variables
(for containers; each flag's help names its variable, ``hivepath.settings`` holds them all), the run
config file, the named preset. Errors a user can fix (:class:`models.errors.HivepathError`) print one
line and exit with the error's code; see ``docs/cli.md`` for the codes.

Each command is a module of :data:`COMMANDS` that parses its flags and calls one function of
``peer``, ``coordinator`` or ``models``; they import those only when they run, so ``hivepath --help``
imports neither torch nor hivemind.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Optional, Sequence

from hivepath import (
    cmd_archive,
    cmd_coordinator,
    cmd_data,
    cmd_demo,
    cmd_eval,
    cmd_export,
    cmd_generate,
    cmd_peer,
    cmd_train_local,
)
from hivepath.numbers import check_defaults
from hivepath.settings import env_default
from models.errors import HivepathError

__all__ = ["main", "build_parser", "COMMANDS"]

log = logging.getLogger("hivepath")

COMMANDS = (cmd_archive, cmd_coordinator, cmd_data, cmd_demo, cmd_eval, cmd_export, cmd_generate, cmd_peer,
            cmd_train_local)
"""The command modules, each with ``register(subparsers)``, in the order ``--help`` lists them."""


class Parser(argparse.ArgumentParser):
    """argparse with the project's error format: one line naming the problem and where the fix is
    (``hivepath: error: argument --threads: must be an integer >= 1, got '0' (see 'hivepath peer join
    --help')``, the same prefix as every other user error),
    exit 2; the subcommands' parsers are of this class too."""

    def error(self, message: str):  # noqa: D102 - argparse's hook
        self.exit(2, f"hivepath: error: {message} (see '{self.prog} --help')\n")


class _ShowVersion(argparse.Action):
    """``--version``: :func:`protos.versions.describe` on one line (argparse's own action wraps it)."""

    def __call__(self, parser, namespace, values, option_string=None):  # noqa: D102 - argparse's hook
        from protos.versions import describe  # imports grpc's stubs: not for every --help

        print(describe())
        parser.exit(0)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="hivepath",
        description=(
            "Train one language model together with volunteers: a DiPaCo lattice of modules, "
            "averaged DiLoCo-style over a DHT, coordinated by a small service."
        ),
        epilog="Run 'hivepath COMMAND --help' for a command's options.",
    )
    parser.add_argument("--version", action=_ShowVersion, nargs=0,
                        help="show the release, the commit when run from a checkout, and each contract's "
                             "protocol version, then exit")
    parser.add_argument(
        "--log-level",
        default=env_default("HIVEPATH_LOG_LEVEL"),
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="logging verbosity (env HIVEPATH_LOG_LEVEL; default INFO)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in COMMANDS:
        command.register(sub)
    return parser


class _Opening(logging.Formatter):
    """Writes ``opening`` as a line of its own before the first record it formats: the first line of a
    long-running process's log names its release and protocols, and a command that stops on bad input
    before logging anything still answers with one line."""

    def __init__(self, fmt: str, datefmt: str, opening: str):
        super().__init__(fmt, datefmt)
        self._opening = opening

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        opening, self._opening = self._opening, ""
        if not opening:
            return line
        first = logging.LogRecord("hivepath", logging.INFO, __file__, 0, opening, None, None)
        first.created = record.created
        return super().format(first) + "\n" + line


def _setup_logging(level: str, opening: str = "") -> None:
    """Log to stderr at ``level``; ``opening``: the first line of the log (on the handler set up here only)."""
    before = list(logging.getLogger().handlers)
    logging.basicConfig(
        level=getattr(logging, level),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )
    if opening:
        for handler in set(logging.getLogger().handlers) - set(before):
            handler.setFormatter(_Opening("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S", opening))


LONG_RUNNING = {("coordinator", "serve"), ("peer", "join"), ("archive", None), ("demo", None), ("data", "serve")}
"""The commands whose log opens with :func:`protos.versions.describe` (release, commit, protocols)."""


def _opening(args: argparse.Namespace) -> str:
    """The first line of a long-running command's log (release, commit, protocols); '' for the others."""
    if (args.command, getattr(args, f"{args.command}_command", None)) not in LONG_RUNNING:
        return ""
    from protos.versions import describe

    return describe()


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Parse, run the chosen subcommand, and turn user errors into one clear line and an exit code."""
    try:
        parser = build_parser()
        argv = list(sys.argv[1:] if argv is None else argv)
        args = parser.parse_args(argv)
        check_defaults(parser, args, argv)  # ranges of numbers a HIVEPATH_* variable set
        _setup_logging(args.log_level, opening=_opening(args))
        return int(args.func(args) or 0)
    except HivepathError as e:
        print(f"hivepath: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("hivepath: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
