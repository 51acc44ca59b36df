"""The numeric flags' types: every number a flag takes has a range, checked before any work starts.

``type=int`` accepts ``--threads 0`` and ``--max-steps -1``, and ``type=float`` accepts ``nan``; a flag
of ``hivepath`` takes one of these instead (``tests/test_cli_sweep.py`` fails on a plain ``int`` or
``float``). A value out of range is an argparse error (one line, exit 2) naming the flag, the range
and the value. :func:`check_defaults` applies the same ranges to values that came from a
``HIVEPATH_*`` variable, which argparse does not convert.
"""

from __future__ import annotations

import argparse
import math
from typing import Any, Optional, Union

from models.errors import ConfigError

__all__ = ["Number", "count", "natural", "seconds", "positive", "port", "non_negative", "seed", "share",
           "check_defaults"]


class Number:
    """An argparse type: an int or a finite float within ``[low, high]`` (``low_open``: ``> low``)."""

    def __init__(self, kind: type, low: Optional[float] = None, high: Optional[float] = None,
                 low_open: bool = False, what: str = ""):
        self.kind, self.low, self.high, self.low_open = kind, low, high, low_open
        self.__name__ = what or self.describe()  # argparse names the type in its message

    def describe(self) -> str:
        noun = "an integer" if self.kind is int else "a number"
        if self.low is not None and self.high is not None:
            return f"{noun} from {self.low:g}{' (exclusive)' if self.low_open else ''} to {self.high:g}"
        if self.low is not None:
            return f"{noun} {'>' if self.low_open else '>='} {self.low:g}"
        return noun

    def __call__(self, text: Union[str, int, float]) -> Union[int, float]:
        try:
            value = self.kind(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"must be {self.describe()}, got {text!r}") from None
        if isinstance(value, float) and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be {self.describe()}, got {text!r}")
        below = self.low is not None and (value <= self.low if self.low_open else value < self.low)
        if below or (self.high is not None and value > self.high):
            raise argparse.ArgumentTypeError(f"must be {self.describe()}, got {text!r}")
        return value


def count(low: int = 1) -> Number:
    """A whole number of things, at least ``low`` (peers, steps, threads, snapshots kept)."""
    return Number(int, low)


def natural() -> Number:
    """A whole number >= 0, where 0 has a meaning the flag's help gives (all, off, unlimited)."""
    return Number(int, 0)


def seconds() -> Number:
    """A duration or an interval: a finite number of seconds > 0."""
    return positive()


def positive() -> Number:
    """A finite number > 0 (a rate, a size, a temperature, a learning rate)."""
    return Number(float, 0.0, low_open=True)


def non_negative() -> Number:
    """A finite number >= 0."""
    return Number(float, 0.0)


def share() -> Number:
    """A fraction of a whole: a number > 0 and <= 1."""
    return Number(float, 0.0, 1.0, low_open=True)


def port(allow_zero: bool = True) -> Number:
    """A TCP port; 0 where the flag's help gives it a meaning (off, or any free port)."""
    return Number(int, 0 if allow_zero else 1, 65535)


def seed() -> Number:
    """A random seed: a whole number from 0 to 2**32 - 1."""
    return Number(int, 0, 2**32 - 1)


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
        if value is None or _in_range(action.type, value):
            continue
        var = next((by_flag[o] for o in action.option_strings if o in by_flag), "")
        raise ConfigError(action.option_strings[0].lstrip("-"),
                          f"{value!r}{f' (from {var})' if var else ''} must be {action.type.describe()}")


def _in_range(kind: Number, value: Any) -> bool:
    try:
        kind(value)
    except argparse.ArgumentTypeError:
        return False
    return True


def _actions(parser: argparse.ArgumentParser, args: argparse.Namespace):
    """The actions of ``parser`` and of the subcommands ``args`` chose."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            chosen = getattr(args, action.dest, None)
            if chosen in action.choices:
                yield from _actions(action.choices[chosen], args)
        else:
            yield action
