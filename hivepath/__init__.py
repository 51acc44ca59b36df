"""The ``hivepath`` command line: one command, many subcommands, no logic of its own.

- ``cli``: ``main`` and the parser; :data:`hivepath.cli.COMMANDS` lists the command modules.
- ``cmd_<name>``: one command each, with ``register(subparsers)``: it parses its flags, calls one
  function of ``models``, ``peer`` or ``coordinator``, and leaves errors to ``cli`` (one line and an
  exit code). Command modules do not import each other.
- ``options``: flags several commands share: the run token (one precedence everywhere) and the
  network flags of the long-running peer processes.
- ``settings``: every ``HIVEPATH_*`` variable of the command line, and the table of all of them.
- ``numbers`` and ``paths``: the types of the numeric and path flags (a range; a kind of path, checked
  before any work starts).
- ``progress``: the dataset preparation display that ``data prepare`` and ``train-local`` share.

Importing the command line and building its parser pulls in neither torch nor hivemind.
"""

from models.grpc_fork import grpc_fork_safe

grpc_fork_safe()  # before anything imports grpc: children started by fork must not be aborted by it

__all__ = ["main"]


def main(argv=None) -> int:
    """The ``hivepath`` command (see :func:`hivepath.cli.main`)."""
    from hivepath.cli import main as _main

    return _main(argv)
