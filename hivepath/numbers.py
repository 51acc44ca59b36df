"""The numeric flags' types: every number a flag takes has a range, checked before any work starts.
The ranges are :mod:`models.settings`'s (a setting's declaration names its range); this module
re-exports them for the flags that no ``HIVEPATH_*`` variable sets.

``type=int`` accepts ``--threads 0`` and ``--max-steps -1``, and ``type=float`` accepts ``nan``; a flag
of ``hivepath`` takes one of these instead (``tests/hivepath/test_cli_sweep.py`` fails on a plain ``int`` or
``float``). A value out of range is an argparse error (one line, exit 2) naming the flag, the range
and the value. :func:`check_defaults` applies the same ranges to values that came from a
``HIVEPATH_*`` variable, which argparse does not convert.
"""

from __future__ import annotations

import argparse
from typing import Any

from models.errors import ConfigError
from models.settings import Number, count, natural, non_negative, port, positive, seconds, seed, share

__all__ = ["Number", "count", "natural", "seconds", "positive", "port", "non_negative", "seed", "share",
           "check_defaults"]


def check_defaults(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: list[str]) -> None:
    """Apply each numeric flag's range, and each flag's choices, to its value when it did not come
    from the command line (a ``HIVEPATH_*`` variable set it): a :class:`ConfigError` naming the flag
    and the variable."""
    from hivepath.settings import ALL_SETTINGS

    by_flag = {s.flag: s.name for s in ALL_SETTINGS if s.flag}
    given = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
    for action in _actions(parser, args):
        if not action.option_strings or set(action.option_strings) & given:
            continue
        value: Any = getattr(args, action.dest, None)
        if action.choices is not None and value is not None and value not in action.choices:
            var = next((by_flag[o] for o in action.option_strings if o in by_flag), "")
            raise ConfigError(action.option_strings[0].lstrip("-"), f"{value!r}{f' (from {var})' if var else ''} "
                              f"must be one of {', '.join(map(str, action.choices))}")
        if not isinstance(action.type, Number):
            continue
        if value is None or action.type.holds(value):
            continue
        var = next((by_flag[o] for o in action.option_strings if o in by_flag), "")
        raise ConfigError(action.option_strings[0].lstrip("-"),
                          f"{value!r}{f' (from {var})' if var else ''} must be {action.type.describe()}")


def _actions(parser: argparse.ArgumentParser, args: argparse.Namespace):
    """The actions of ``parser`` and of the subcommands ``args`` chose."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            chosen = getattr(args, action.dest, None)
            if chosen in action.choices:
                yield from _actions(action.choices[chosen], args)
        else:
            yield action
