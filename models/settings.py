"""The :class:`Setting` that declares one setting once: its ``HIVEPATH_*`` environment variable, kind,
default, range or choices, help and flag, and who reads it. Each package keeps its own table of them
(``peer.settings``, ``hivepath.settings``); the command line builds each flag from its declaration
(:func:`hivepath.settings.add_flag`), the options the peer's processes take read their defaults from
it, and ``docs/cli.md``'s table is generated from it. This type is shared, torch-free and stdlib-only,
so that the command line's table loads where the peer package is absent (the coordinator's image).
The coordinator's ports and :func:`check_address`, the check of a ``--coordinator`` address, live here
for the same reason, and so do the ranges (:class:`Number`) a declaration names.
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Union

from models.errors import ConfigError, HivepathError

__all__ = ["Setting", "KINDS", "COORDINATOR_PORT", "COORDINATOR_HTTP_PORT", "check_address", "Number", "count",
           "natural", "seconds", "positive", "non_negative", "share", "port", "seed", "fill_between", "table_main"]

COORDINATOR_PORT = 7700
"""The coordinator's gRPC port unless ``coordinator serve --port`` says otherwise; a ``--coordinator``
address without a port means this one."""
COORDINATOR_HTTP_PORT = 7701
"""The coordinator's status page and metrics port unless ``--http-port`` says otherwise."""


def check_address(address: str) -> str:
    """``address`` as the ``HOST:PORT`` to dial, else a :class:`HivepathError` (exit 2) naming what is
    wrong. ``HOST`` alone (``[IPV6]`` for IPv6) means the coordinator's default port
    (:data:`models.settings.COORDINATOR_PORT`). A malformed address is bad input, refused at once; what
    answers at a well-formed one is found out when the client first calls it
    (:func:`peer.coordinator_client.transport.what_answers`). Torch- and grpc-free: the command line checks
    ``--coordinator`` with it before it imports the peer."""
    fix = (f"pass --coordinator HOST[:PORT] (e.g. coord.example.org:{COORDINATOR_PORT}) or set "
           "HIVEPATH_COORDINATOR")
    text = (address or "").strip()
    if "://" in text:
        raise HivepathError(f"coordinator address {address!r} has a scheme; {fix}")
    bare_ipv6 = text.startswith("[") and text.endswith("]")
    if text and (":" not in text or bare_ipv6):
        text = f"{text}:{COORDINATOR_PORT}"
    host, sep, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or any(c.isspace() for c in text) or (":" in host and not text.startswith("[")):
        raise HivepathError(f"coordinator address {address!r} is not HOST[:PORT]; {fix}")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise HivepathError(f"coordinator address {address!r}: the port must be 1-65535; {fix}")
    return text


class Number:
    """A range of numbers, and the argparse type that checks it: an int or a finite float within
    ``[low, high]`` (``low_open``: ``> low``)."""

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

    def holds(self, value: Any) -> bool:
        """Whether ``value`` is within the range."""
        try:
            self(value)
        except argparse.ArgumentTypeError:
            return False
        return True


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


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _boolean(text: str) -> bool:
    if text.lower() in _TRUE:
        return True
    if text.lower() in _FALSE:
        return False
    raise ValueError(text)


def _words(text: str) -> list[str]:
    return [w for w in text.replace(",", " ").split() if w]


KINDS = {
    "text": str, "path": str, "integer": int, "number": float, "boolean": _boolean, "list": _words,
}
"""How each kind of value is written in a variable, by its name in the table: ``boolean`` is one of
1/true/yes/on or 0/false/no/off, ``list`` is separated by spaces or commas, ``path`` stays text (the
reader expands ``~``)."""


@dataclass(frozen=True)
class Setting:
    """One setting, declared once: its ``HIVEPATH_*`` variable, kind, default, help, the flag it is
    the default of, its range or choices, and who reads it."""

    name: str
    kind: str
    """One of :data:`KINDS`."""
    default: Any
    """The value when the variable is unset or empty (``None``: nothing, the reader decides)."""
    doc: str
    """What it does: the table's sentence and the flag's help (which adds the variable and the default)."""
    flag: str = ""
    """The command-line flag it is the default of (``--spot``), if any: the flag wins over it."""
    read_by: str = ""
    """Who reads it: commands (``peer join``) or a script of the images (``deploy/healthcheck.py``)."""
    range: Optional[Number] = None
    """The values a number may take; the flag's type checks them (and a variable's value, see
    :func:`hivepath.numbers.check_defaults`)."""
    choices: tuple = ()
    """The values a text may take (none: any)."""
    metavar: str = ""
    """How the flag's help names its value (``S``, ``DIR``)."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"{self.name}: kind {self.kind!r} is not one of {', '.join(KINDS)}")
        if self.range is not None and self.default is not None and not self.range.holds(self.default):
            raise ValueError(f"{self.name}: default {self.default!r} is not {self.range.describe()}")
        if self.choices and self.default is not None and self.default not in self.choices:
            raise ValueError(f"{self.name}: default {self.default!r} is not one of {', '.join(self.choices)}")

    def range_text(self) -> str:
        """The range or the choices in words ('' for neither), for the docs' table."""
        if self.range is not None:
            return self.range.describe()
        return ", ".join(self.choices)

    def parse(self, raw: str) -> Any:
        """``raw`` as this setting's kind; a bad value is a :class:`ConfigError` naming the variable
        (its field is the flag without dashes where there is one, so errors match the flag's)."""
        try:
            return KINDS[self.kind](raw)
        except (TypeError, ValueError):
            field = self.flag.lstrip("-") or self.name
            raise ConfigError(field, f"environment variable {self.name}={raw!r} is not a valid {self.kind}") from None

    def is_set(self, environ: Optional[Mapping[str, str]] = None) -> bool:
        """Whether ``environ`` (default ``os.environ``) gives the variable a value (blank counts as unset)."""
        return bool((os.environ if environ is None else environ).get(self.name, "").strip())

    def read(self, environ: Optional[Mapping[str, str]] = None) -> Any:
        """The variable's value from ``environ`` (default ``os.environ``), else :attr:`default`.
        Surrounding blanks are ignored; an empty variable counts as unset."""
        raw = (os.environ if environ is None else environ).get(self.name, "").strip()
        if raw:
            return self.parse(raw)
        return list(self.default) if isinstance(self.default, list) else self.default  # never share the table's


def fill_between(text: str, begin: str, end: str, table: str) -> str:
    """``text`` with the part between the ``begin`` and ``end`` markers replaced by ``table`` (a generated
    table in a doc); ValueError when ``text`` has no such block."""
    start, stop = text.find(begin), text.find(end)
    if start < 0 or stop < start:
        raise ValueError(f"no '{begin}' ... '{end}' block to fill")
    return text[: start + len(begin)] + "\n\n" + table + "\n" + text[stop:]


def table_main(argv: Optional[list[str]], prog: str, what: str, table: Any, update: Any) -> int:
    """The ``python -m PROG --markdown | --update FILE`` command of a generated settings table: prints
    ``table()`` (the table of ``what``), or rewrites FILE's text through ``update(text)``."""
    import sys
    from pathlib import Path

    parser = argparse.ArgumentParser(prog=f"python -m {prog}",
                                     description=f"print the table of {what}, or rewrite it in a doc")
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--markdown", action="store_true", help=f"print the table of {what}")
    group.add_argument("--update", metavar="FILE", help="rewrite the table between the markers in FILE")
    args = parser.parse_args(argv)
    if args.markdown:
        sys.stdout.write(table())
        return 0
    path = Path(args.update)
    path.write_text(update(path.read_text()))
    return 0
