"""The :class:`Setting` that describes one ``HIVEPATH_*`` environment variable: its name, kind,
default, what it does and who reads it. Each package keeps its own table of them (``peer.settings``,
``hivepath.settings``); this type is shared, torch-free and stdlib-only, so that the command line's
table loads where the peer package is absent (the coordinator's image). The coordinator's ports and
:func:`check_address`, the check of a ``--coordinator`` address, live here for the same reason.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from models.errors import ConfigError, HivepathError

__all__ = ["Setting", "KINDS", "COORDINATOR_PORT", "COORDINATOR_HTTP_PORT", "check_address"]

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
