"""The command line's ``HIVEPATH_*`` settings (logging, the coordinator's address, the run token), the
images' variables, and the table of all of them.

A flag of ``hivepath`` that a variable can set is built from the setting's one declaration
(:func:`add_flag`: its default, range as the type, choices, value name and help, to which the help adds
the variable and the default); its ``--help`` names the variable. Precedence, highest first: the flag
on the command line, the variable, the declared default. The run token is the one exception to "flag
default": ``--token`` and ``--token-file`` have none, and :func:`hivepath.options.read_token` reads
``--token``, then ``--token-file``, then ``HIVEPATH_TOKEN``, then ``HIVEPATH_TOKEN_FILE``.

:data:`ALL_SETTINGS` joins these to the peer processes' declarations
(:data:`peer.settings.PROCESS_SETTINGS`: network, ``peer join``, ``archive`` and the peer's own) and to
the variables only the container images read (:data:`IMAGE_SETTINGS`); ``docs/cli.md`` holds it as a
Markdown table (``python -m hivepath.settings --update docs/cli.md`` rewrites it; a test checks it is
current). The coordinator package reads no variable (see ``coordinator.settings``).

Imports nothing heavy: building the parser reads this.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Optional, Sequence

from hivepath.paths import FromVariable
from models.log_format import LOG_FORMATS
from models.settings import COORDINATOR_HTTP_PORT, COORDINATOR_PORT, Setting, fill_between, table_main

try:
    from peer.settings import PROCESS_SETTINGS
except ImportError:  # the coordinator's image holds no peer package; its commands refuse there anyway
    PROCESS_SETTINGS = ()

__all__ = ["CLI_SETTINGS", "IMAGE_SETTINGS", "ALL_SETTINGS", "setting", "env_default", "add_flag", "is_set", "shown_default",
           "markdown_table", "update_markdown", "pass_on", "BEGIN_MARKER", "END_MARKER", "main"]

_NET = "peer join, archive"
_TOKEN_READERS = f"{_NET}, coordinator serve/status/drain/ban/unban"

CLI_SETTINGS: tuple[Setting, ...] = (
    Setting("HIVEPATH_LOG_LEVEL", "text", "INFO", "logging verbosity: DEBUG, INFO, WARNING or ERROR",
            flag="--log-level", read_by="every command", choices=("DEBUG", "INFO", "WARNING", "ERROR")),
    Setting("HIVEPATH_LOG_FORMAT", "text", "text",
            "log lines as text, or json: one JSON object per line with the fields of the events (time, event, "
            "level, logger, message); the processes a command starts log the same way",
            flag="--log-format", read_by="every command", choices=LOG_FORMATS),
    Setting("HIVEPATH_COORDINATOR", "text", None,
            f"the coordinator's gRPC HOST[:PORT], PORT {COORDINATOR_PORT} if left out (required by peer join and "
            f"archive; the operator commands coordinator status/drain/ban/unban default to 127.0.0.1:{COORDINATOR_PORT})",
            flag="--coordinator", read_by=f"{_NET}, coordinator status/drain/ban/unban", metavar="HOST[:PORT]"),
    Setting("HIVEPATH_TOKEN", "text", None,
            "the run token, read after --token and --token-file (a flag shows in ps; prefer this or a file)",
            read_by=_TOKEN_READERS),
    Setting("HIVEPATH_TOKEN_FILE", "path", None, "a file holding the run token, read after HIVEPATH_TOKEN",
            read_by=_TOKEN_READERS),
)
"""The variables every command line reads, whatever the installation: logging, the coordinator's
address, the run token. The peer's processes declare theirs in ``peer.settings``."""

_IMAGE = "deploy/entrypoint.sh"
_HEALTH = "deploy/healthcheck.py"

IMAGE_SETTINGS: tuple[Setting, ...] = (
    Setting("HIVEPATH_ROLE", "text", "peer", "which health check to run: coordinator, peer or archive",
            read_by=_HEALTH),
    Setting("HIVEPATH_RUN_CONFIG", "path", None, "the run's run.toml (coordinator serve --run-config)",
            flag="--run-config", read_by=_IMAGE),
    Setting("HIVEPATH_DB", "path", None, "the coordinator's SQLite file (coordinator serve --db)", flag="--db",
            read_by=_IMAGE),
    Setting("HIVEPATH_PORT", "integer", COORDINATOR_PORT, "the coordinator's gRPC port (coordinator serve --port)",
            flag="--port", read_by=f"{_IMAGE}, {_HEALTH}"),
    Setting("HIVEPATH_HTTP_PORT", "integer", COORDINATOR_HTTP_PORT, "the coordinator's status page port (coordinator serve "
            "--http-port)", flag="--http-port", read_by=f"{_IMAGE}, {_HEALTH}"),
    Setting("HIVEPATH_TLS_CERT", "path", None, "serve gRPC over TLS with this certificate chain "
            "(coordinator serve --tls-cert)", flag="--tls-cert", read_by=f"{_IMAGE}, {_HEALTH}"),
    Setting("HIVEPATH_TLS_KEY", "path", None, "the private key of HIVEPATH_TLS_CERT (coordinator serve --tls-key)",
            flag="--tls-key", read_by=_IMAGE),
    Setting("HIVEPATH_IMAGE_TAG", "text", "latest", "tag of the images Compose runs", read_by="deploy/compose.yaml"),
    Setting("HIVEPATH_BASE_IMAGE", "text", "python:3.11-slim-bookworm",
            "base image of the CPU images (CI: local/hivepath-base:bookworm)",
            read_by="deploy/compose.yaml, deploy/ci/docker-setup.sh"),
    Setting("HIVEPATH_CUDA_BASE_IMAGE", "text", "nvidia/cuda:12.8.1-base-ubuntu24.04", "base image of the CUDA image",
            read_by="deploy/compose.yaml"),
    Setting("HIVEPATH_RUN_TOML", "path", "./run.example.toml", "the run config Compose mounts into the coordinator",
            read_by="deploy/compose.yaml"),
    Setting("HIVEPATH_GRPC_PUBLISH", "integer", COORDINATOR_PORT, "host port Compose publishes the coordinator's gRPC on",
            read_by="deploy/compose.yaml"),
    Setting("HIVEPATH_HTTP_PUBLISH", "integer", COORDINATOR_HTTP_PORT, "host port Compose publishes the status page on",
            read_by="deploy/compose.yaml"),
)
"""Variables no Python package reads: the images' entrypoint (which turns the coordinator's into
``coordinator serve`` flags), their health check and the Compose file. Listed so the table is whole."""

ALL_SETTINGS: tuple[Setting, ...] = CLI_SETTINGS + PROCESS_SETTINGS + IMAGE_SETTINGS
"""Every variable there is, each once."""

_BY_NAME = {s.name: s for s in ALL_SETTINGS}

BEGIN_MARKER = "<!-- settings table: generated by python -m hivepath.settings; do not edit -->"
END_MARKER = "<!-- end of settings table -->"


def setting(name: str) -> Setting:
    """The :class:`Setting` called ``name`` (any of :data:`ALL_SETTINGS`)."""
    return _BY_NAME[name]


def pass_on(name: str, value: str) -> None:
    """Set variable ``name`` in this process's environment, so the processes it starts read ``value``."""
    os.environ[setting(name).name] = value


def env_default(name: str) -> Any:
    """The default of the flag that variable ``name`` stands for: the variable's value when set, else
    the table's default (see :meth:`models.settings.Setting.read`). Without the peer package (the
    coordinator's image) the peer's own variables are unknown and their flags have no default.

    A path the variable sets is a :class:`hivepath.paths.FromVariable`: argparse passes a flag's text
    default through the flag's type, and the path kinds name the variable when they refuse it."""
    if name not in _BY_NAME and not PROCESS_SETTINGS:
        return None
    s = _BY_NAME[name]
    value = s.read()
    if s.kind == "path" and s.is_set():
        return FromVariable(value, name)
    return value


def shown_default(s: Setting) -> str:
    """The declared default as a flag's help and the docs write it ('' for none)."""
    value = s.default
    if value is None or value == []:
        return ""
    if isinstance(value, list):
        return " ".join(value)
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def add_flag(p: argparse.ArgumentParser, name: str, *, help: Optional[str] = None, flag: Optional[str] = None,
             **overrides: Any) -> None:
    """Add the flag of setting ``name`` to ``p``, built from its declaration: the flag, the default
    (the variable's value when set, :func:`env_default`), the range as the type, the choices, the
    value's name, and the help, which ends with ``(env NAME; default D)``. ``help`` replaces the
    declaration's sentence where a command says more about it (the variable and the default are
    still added); ``flag`` names the flag where a command reads the setting under another name
    (``peer status --port``); ``overrides`` are argparse's own (a path kind as ``type``, ``action``).

    Without the peer package (the coordinator's image) a peer process's setting is not declared and
    its flag is left out: the commands that would read it cannot run there."""
    s = _BY_NAME.get(name)
    if s is None:
        if PROCESS_SETTINGS:
            raise KeyError(name)
        return
    kwargs: dict[str, Any] = {"default": env_default(name)}
    if s.kind == "boolean":
        kwargs["action"] = "store_true"
    elif s.kind == "list":
        kwargs["nargs"] = "*"
    if s.range is not None:
        kwargs["type"] = s.range
    if s.choices:
        kwargs["choices"] = list(s.choices)
    if s.metavar:
        kwargs["metavar"] = s.metavar
    kwargs.update(overrides)
    shown = shown_default(s)
    if s.kind == "boolean":
        where = f"env {name}=1"
    else:
        where = f"env {name}; default {shown}" if shown else f"env {name}"
    text = help if help is not None else s.doc
    p.add_argument(flag or s.flag, help=f"{text} ({where})", **kwargs)


def is_set(name: str) -> bool:
    """Whether the environment sets variable ``name`` (False for one not declared in this installation)."""
    s = _BY_NAME.get(name)
    return s is not None and s.is_set()


def _cell(value: Any) -> str:
    if value is None or value == []:
        return ""
    if isinstance(value, list):
        value = " ".join(value)
    return f"`{value}`"


def markdown_table(settings: Sequence[Setting] = ALL_SETTINGS) -> str:
    """The variables as a Markdown table: variable, flag, kind, default, range or choices, who reads
    it, what it does."""
    lines = ["| variable | flag | kind | default | range | read by | what it does |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for s in settings:
        doc = s.doc.replace("|", "\\|")
        lines.append(f"| `{s.name}` | {_cell(s.flag or None)} | {s.kind} | {_cell(s.default)} | {s.range_text()} | "
                     f"{s.read_by} | {doc} |")
    return "\n".join(lines) + "\n"


def update_markdown(text: str, table: Optional[str] = None) -> str:
    """``text`` with the part between :data:`BEGIN_MARKER` and :data:`END_MARKER` replaced by the table."""
    return fill_between(text, BEGIN_MARKER, END_MARKER, table if table is not None else markdown_table())


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m hivepath.settings --markdown`` prints the table; ``--update FILE`` rewrites it in FILE."""
    return table_main(list(argv) if argv is not None else None, "hivepath.settings", "every HIVEPATH_* variable",
                      markdown_table, update_markdown)


if __name__ == "__main__":
    sys.exit(main())
