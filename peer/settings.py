"""The ``HIVEPATH_*`` environment variables the peer package reads itself, and the :class:`Setting`
that describes one variable (the command line's table, ``hivepath.settings``, uses it too).

Variables only wire deployments (a container, a supervisor); a flag given on the command line wins
over its variable, and the variable over the default written here. Code reads a variable only
through :func:`read` (or :meth:`Setting.read`), never from ``os.environ``: so the table in
``docs/cli.md``, generated from these entries, is every variable there is.

Stdlib and ``models.errors`` only: the spot supervisor and the progress view read it, and importing
it must stay as cheap as the command line's ``--help``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from models.errors import ConfigError

__all__ = ["Setting", "KINDS", "PEER_SETTINGS", "read", "setting"]

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
    """One ``HIVEPATH_*`` variable: its name, kind, default, what it does and who reads it."""

    name: str
    kind: str
    """One of :data:`KINDS`."""
    default: Any
    """The value when the variable is unset or empty (``None``: nothing, the reader decides)."""
    doc: str
    """What it does, one sentence for the table."""
    flag: str = ""
    """The command-line flag it is the default of (``--spot``), if any: the flag wins over it."""
    read_by: str = ""
    """Who reads it: commands (``peer join``) or a script of the images (``deploy/healthcheck.py``)."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"{self.name}: kind {self.kind!r} is not one of {', '.join(KINDS)}")

    def parse(self, raw: str) -> Any:
        """``raw`` as this setting's kind; a bad value is a :class:`ConfigError` naming the variable
        (its field is the flag without dashes where there is one, so errors match the flag's)."""
        try:
            return KINDS[self.kind](raw)
        except (TypeError, ValueError):
            field = self.flag.lstrip("-") or self.name
            raise ConfigError(field, f"environment variable {self.name}={raw!r} is not a valid {self.kind}") from None

    def read(self, environ: Optional[Mapping[str, str]] = None) -> Any:
        """The variable's value from ``environ`` (default ``os.environ``), else :attr:`default`.
        Surrounding blanks are ignored; an empty variable counts as unset."""
        raw = (os.environ if environ is None else environ).get(self.name, "").strip()
        if raw:
            return self.parse(raw)
        return list(self.default) if isinstance(self.default, list) else self.default  # never share the table's


_SPOT = "peer join; python -m peer.node.spot (the images' supervisor)"

PEER_SETTINGS: tuple[Setting, ...] = (
    Setting("HIVEPATH_SPOT", "text", "none",
            "watch the cloud's spot/preemption notice and drain on one: none, aws, gcp or auto",
            flag="--spot", read_by=_SPOT),
    Setting("HIVEPATH_SPOT_URL", "text", None,
            "metadata server base URL (default: the provider's own)",
            flag="--spot-url", read_by=_SPOT),
    Setting("HIVEPATH_SPOT_POLL_INTERVAL", "number", 5.0,
            "seconds between spot-notice checks",
            flag="--spot-poll-interval", read_by=_SPOT),
    Setting("HIVEPATH_PROGRESS_INTERVAL", "number", 5.0,
            "least seconds between two JSON progress lines (--progress json)",
            read_by="peer join"),
)
"""The variables of the peer package, each read where its code needs it (see ``read_by``)."""

_BY_NAME = {s.name: s for s in PEER_SETTINGS}


def setting(name: str) -> Setting:
    """The peer's :class:`Setting` called ``name`` (a ``KeyError`` for a variable it does not own)."""
    return _BY_NAME[name]


def read(name: str, environ: Optional[Mapping[str, str]] = None) -> Any:
    """The value of the peer's variable ``name`` (see :meth:`Setting.read`)."""
    return _BY_NAME[name].read(environ)
