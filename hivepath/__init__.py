"""The ``hivepath`` command line: one command, many subcommands, no logic of its own.

Each subcommand lives in ``hivepath/cmd_<name>.py`` and exposes ``register(subparsers)``; the
work itself is done by ``models``, ``peer`` and ``coordinator``.
"""

__all__ = ["main"]


def main(argv=None) -> int:
    from hivepath.cli import main as _main

    return _main(argv)
