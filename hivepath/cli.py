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
from hivepath.settings import add_flag, pass_on
from models.errors import HivepathError
from models.log_format import event_extra, setup_logging

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
    add_flag(parser, "HIVEPATH_LOG_LEVEL", help="logging verbosity")
    add_flag(parser, "HIVEPATH_LOG_FORMAT")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in COMMANDS:
        command.register(sub)
    return parser


class _Opening(logging.Formatter):
    """Writes ``opening`` as a line of its own, in ``inner``'s format, before the first record it
    formats: the first line of a long-running process's log names its release and protocols, and a
    command that stops on bad input before logging anything still answers with one line."""

    def __init__(self, inner: logging.Formatter, opening: str):
        super().__init__()
        self._inner = inner
        self._opening = opening

    def format(self, record: logging.LogRecord) -> str:
        line = self._inner.format(record)
        opening, self._opening = self._opening, ""
        if not opening:
            return line
        first = logging.LogRecord("hivepath", logging.INFO, __file__, 0, opening, None, None)
        first.created = record.created
        return self._inner.format(first) + "\n" + line


def _open_log_with(opening: str) -> None:
    """``opening`` first on the log handler :func:`models.log_format.setup_logging` installed."""
    if not opening:
        return
    for handler in logging.getLogger().handlers:
        if getattr(handler, "hivepath", False) and handler.formatter is not None:
            handler.setFormatter(_Opening(handler.formatter, opening))


LONG_RUNNING = {("coordinator", "serve"), ("peer", "join"), ("archive", None), ("demo", None), ("data", "serve")}
"""The commands whose log opens with :func:`protos.versions.describe` (release, commit, protocols)."""


def _opening(args: argparse.Namespace) -> str:
    """The first line of a long-running command's log (release, commit, protocols); '' for the others."""
    if (args.command, getattr(args, f"{args.command}_command", None)) not in LONG_RUNNING:
        return ""
    from protos.versions import describe

    return describe()


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Parse, run the chosen subcommand, and turn user errors into one clear line and an exit code
    (with ``--log-format json``, a JSON ``error`` line: ``message``, ``exit_code``)."""
    json_lines = False
    try:
        parser = build_parser()
        argv = list(sys.argv[1:] if argv is None else argv)
        args = parser.parse_args(argv)
        check_defaults(parser, args, argv)  # ranges and choices of what a HIVEPATH_* variable set
        setup_logging(args.log_level, args.log_format)
        _open_log_with(_opening(args))
        json_lines = args.log_format == "json"
        if json_lines:  # the peers, coordinator and archive a command starts log alike
            pass_on("HIVEPATH_LOG_FORMAT", args.log_format)
        return int(args.func(args) or 0)
    except HivepathError as e:
        _last_words(str(e), e.exit_code, json_lines)
        return e.exit_code
    except KeyboardInterrupt:
        _last_words("interrupted", 130, json_lines)
        return 130


def _last_words(message: str, exit_code: int, json_lines: bool) -> None:
    """The line a command ends with on an error: ``hivepath: error: ...``, or a JSON ``error`` line."""
    if json_lines:
        log.error(message, extra=event_extra("error", exit_code=exit_code))
    elif exit_code == 130:
        print(f"hivepath: {message}", file=sys.stderr)
    else:
        print(f"hivepath: error: {message}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
