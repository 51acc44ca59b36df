"""Every ``HIVEPATH_*`` environment variable of the command line, in one table, and the table of all.

A flag of ``hivepath`` that a variable can set takes its default from here (:func:`env_default`);
its ``--help`` names the variable. Precedence, highest first: the flag on the command line, the
variable, the default below. The run token is the one exception to "flag default": ``--token`` and
``--token-file`` have none, and :func:`hivepath.options.read_token` reads ``--token``, then
``--token-file``, then ``HIVEPATH_TOKEN``, then ``HIVEPATH_TOKEN_FILE``.

:data:`ALL_SETTINGS` joins these to the peer's own (:data:`peer.settings.PEER_SETTINGS`) and to the
variables only the container images read (:data:`IMAGE_SETTINGS`); ``docs/cli.md`` holds it as a
Markdown table (``python -m hivepath.settings --update docs/cli.md`` rewrites it; a test checks it is
current). The coordinator package reads no variable (see ``coordinator.settings``).

Imports nothing heavy: building the parser reads this.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

from hivepath.paths import FromVariable
from models.settings import COORDINATOR_HTTP_PORT, COORDINATOR_PORT, Setting

try:
    from peer.settings import PEER_SETTINGS
except ImportError:  # the coordinator's image holds no peer package; its commands refuse there anyway
    PEER_SETTINGS = ()

__all__ = ["CLI_SETTINGS", "IMAGE_SETTINGS", "ALL_SETTINGS", "setting", "env_default", "markdown_table",
           "update_markdown", "pass_on", "BEGIN_MARKER", "END_MARKER", "main"]

_NET = "peer join, archive"

CLI_SETTINGS: tuple[Setting, ...] = (
    Setting("HIVEPATH_LOG_LEVEL", "text", "INFO", "logging verbosity: DEBUG, INFO, WARNING or ERROR",
            flag="--log-level", read_by="every command"),
    Setting("HIVEPATH_LOG_FORMAT", "text", "text",
            "log lines: text, or json (one JSON object per line: time, event, level, logger, message)",
            flag="--log-format", read_by="every command"),
    Setting("HIVEPATH_COORDINATOR", "text", None,
            f"the coordinator's gRPC HOST[:PORT], PORT {COORDINATOR_PORT} if left out (required by peer join and "
            f"archive; the operator commands coordinator status/drain/ban/unban default to 127.0.0.1:{COORDINATOR_PORT})",
            flag="--coordinator", read_by=f"{_NET}, coordinator status/drain/ban/unban"),
    Setting("HIVEPATH_TOKEN", "text", None,
            "the run token, read after --token and --token-file (a flag shows in ps; prefer this or a file)",
            read_by=f"{_NET}, coordinator serve/status/drain/ban/unban"),
    Setting("HIVEPATH_TOKEN_FILE", "path", None, "a file holding the run token, read after HIVEPATH_TOKEN",
            read_by=f"{_NET}, coordinator serve/status/drain/ban/unban"),
    Setting("HIVEPATH_INITIAL_PEERS", "list", [], "extra DHT bootstrap multiaddrs besides the coordinator's",
            flag="--initial-peers", read_by=_NET),
    Setting("HIVEPATH_IDENTITY", "path", None,
            "identity key file for a stable peer id (default identity.key in the work or archive directory)",
            flag="--identity", read_by=f"{_NET}, deploy/healthcheck.py"),
    Setting("HIVEPATH_HOST_MADDRS", "list", ["/ip4/0.0.0.0/tcp/0"], "multiaddrs the DHT node listens on",
            flag="--host-maddrs", read_by=f"{_NET}, deploy/entrypoint.sh"),
    Setting("HIVEPATH_ANNOUNCE_MADDRS", "list", [],
            "multiaddrs other peers should dial (the images' entrypoint turns 'auto' into the container's "
            "addresses)", flag="--announce-maddrs", read_by=f"{_NET}, deploy/entrypoint.sh"),
    Setting("HIVEPATH_LANE_PORT", "integer", 0,
            "TCP port of the direct lane that carries averaging parts outside the p2p daemon (0: an ephemeral "
            "port)", flag="--lane-port", read_by=_NET),
    Setting("HIVEPATH_TLS_CA", "path", None, "CA certificate to verify a TLS coordinator", flag="--tls-ca",
            read_by=_NET),
    Setting("HIVEPATH_STATUS_PORT", "integer", 7702,
            "serve /status and /healthz on 127.0.0.1 at this port (0 turns it off)",
            flag="--status-port", read_by=f"{_NET}, peer status, deploy/healthcheck.py"),
    Setting("HIVEPATH_STALL_TIMEOUT", "number", 300.0,
            "report unhealthy after this many seconds without progress outside a waiting state",
            flag="--stall-timeout", read_by=_NET),
    Setting("HIVEPATH_DEVICE", "text", "auto", "auto (a GPU no other peer of this machine uses, the CPU without "
            "one), cpu, cuda or cuda:N", flag="--device", read_by="peer join"),
    Setting("HIVEPATH_MAX_MEMORY", "number", None, "use at most this many GB of device memory (default: the "
            "device's free memory divided among the peers of this machine on it)",
            flag="--max-memory", read_by="peer join"),
    Setting("HIVEPATH_PEER_ROLE", "text", None,
            "ask the coordinator for a role: path, stage or trainer (default: it decides from memory, compute and "
            "link)", flag="--role", read_by="peer join"),
    Setting("HIVEPATH_WORK_DIR", "path", "~/.hivepath", "checkpoints, identity and data of a peer",
            flag="--work-dir", read_by="peer join, deploy/healthcheck.py"),
    Setting("HIVEPATH_DATA", "path", None,
            "a prepared dataset (peer join: prepared under the work directory when the corpus is here, else the "
            "assigned path's shards are fetched from seeders; archive: seeded to peers)",
            flag="--data", read_by=_NET),
    Setting("HIVEPATH_NO_SEED", "boolean", False, "do not seed the dataset files held to other peers",
            flag="--no-seed", read_by=_NET),
    Setting("HIVEPATH_MAX_DATA_GB", "number", None,
            "disk budget in GB for fetched shards of paths trained before (least recently used out first; "
            "default: keep all)", flag="--max-data-gb", read_by="peer join"),
    Setting("HIVEPATH_CLIENT_MODE", "boolean", False, "accept no incoming connections, e.g. behind NAT",
            flag="--client-mode", read_by="peer join"),
    Setting("HIVEPATH_UPLOAD_MBPS", "number", None,
            "upload bandwidth in Mbit/s (default: measured against the coordinator at start-up)",
            flag="--upload-mbps", read_by="peer join"),
    Setting("HIVEPATH_PROGRESS", "text", "auto", "progress display: auto, rich or json", flag="--progress",
            read_by="peer join"),
    Setting("HIVEPATH_DRAIN_TIMEOUT", "number", 60.0, "seconds from the start of a drain allowed to finish the round in flight; then it is abandoned (not applied) and the peer leaves",
            flag="--drain-timeout", read_by="peer join"),
    Setting("HIVEPATH_MAX_STEPS", "integer", 0, "leave after this many inner steps (0: run until stopped)",
            flag="--max-steps", read_by="peer join"),
    Setting("HIVEPATH_THREADS", "integer", None, "CPU threads for torch (peer join: the machine's cores divided among its running peers; otherwise torch's choice)",
            flag="--threads", read_by="peer join, train-local, eval, generate"),
    Setting("HIVEPATH_MEASURE_SECONDS", "number", 2.0, "seconds spent measuring tokens/s at start-up",
            flag="--measure-seconds", read_by="peer join"),
    Setting("HIVEPATH_CPU_LIMIT", "number", 1.0,
            "share of the time the peer trains, from 0 (exclusive) to 1: it rests between inner steps so "
            "that computing is at most this share (a machine its owner also uses); 1: no rest",
            flag="--cpu-limit", read_by="peer join"),
    Setting("HIVEPATH_COORDINATOR_TIMEOUT", "number", 60.0,
            "seconds to retry an unreachable coordinator at start-up (set: also where nothing answers yet, "
            "which is otherwise given up after 10 s)", flag="--coordinator-timeout",
            read_by="peer join, archive"),
    Setting("HIVEPATH_KEEP_CHECKPOINTS", "integer", 2, "checkpoint snapshots kept in WORK_DIR/checkpoints",
            flag="--keep-checkpoints", read_by="peer join"),
    Setting("HIVEPATH_ARCHIVE_DIR", "path", None, "where the archive writes its snapshots (required)",
            flag="--dir", read_by="archive, deploy/healthcheck.py (default /data/archive there)"),
    Setting("HIVEPATH_ARCHIVE_KEEP", "integer", 3, "archive snapshots kept", flag="--keep", read_by="archive"),
    Setting("HIVEPATH_ARCHIVE_EVAL_DOCS", "integer", 4,
            "validation documents per path the archive scores on a new snapshot for the status page (0: no scoring)",
            flag="--eval-docs", read_by="archive"),
    Setting("HIVEPATH_ARCHIVE_EVAL_INTERVAL", "number", 120.0,
            "seconds between two of the archive's scorings at least (it often shares a machine with trainers)",
            flag="--eval-interval", read_by="archive"),
)
"""The command line's variables, each the default of the flag it names."""

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
    Setting("HIVEPATH_GRPC_PUBLISH", "integer", 7700, "host port Compose publishes the coordinator's gRPC on",
            read_by="deploy/compose.yaml"),
    Setting("HIVEPATH_HTTP_PUBLISH", "integer", 7701, "host port Compose publishes the status page on",
            read_by="deploy/compose.yaml"),
)
"""Variables no Python package reads: the images' entrypoint (which turns the coordinator's into
``coordinator serve`` flags), their health check and the Compose file. Listed so the table is whole."""

ALL_SETTINGS: tuple[Setting, ...] = CLI_SETTINGS + PEER_SETTINGS + IMAGE_SETTINGS
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
    if name not in _BY_NAME and not PEER_SETTINGS:
        return None
    s = _BY_NAME[name]
    value = s.read()
    if s.kind == "path" and s.is_set():
        return FromVariable(value, name)
    return value


def _cell(value: Any) -> str:
    if value is None or value == []:
        return ""
    if isinstance(value, list):
        value = " ".join(value)
    return f"`{value}`"


def markdown_table(settings: Sequence[Setting] = ALL_SETTINGS) -> str:
    """The variables as a Markdown table: variable, flag, kind, default, who reads it, what it does."""
    lines = ["| variable | flag | kind | default | read by | what it does |", "| --- | --- | --- | --- | --- | --- |"]
    for s in settings:
        doc = s.doc.replace("|", "\\|")
        lines.append(f"| `{s.name}` | {_cell(s.flag or None)} | {s.kind} | {_cell(s.default)} | {s.read_by} | {doc} |")
    return "\n".join(lines) + "\n"


def update_markdown(text: str, table: Optional[str] = None) -> str:
    """``text`` with the part between :data:`BEGIN_MARKER` and :data:`END_MARKER` replaced by the table."""
    start, end = text.find(BEGIN_MARKER), text.find(END_MARKER)
    if start < 0 or end < start:
        raise ValueError(f"no '{BEGIN_MARKER}' ... '{END_MARKER}' block to fill")
    head = text[: start + len(BEGIN_MARKER)]
    return head + "\n\n" + (table if table is not None else markdown_table()) + "\n" + text[end:]


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m hivepath.settings --markdown`` prints the table; ``--update FILE`` rewrites it in FILE."""
    parser = argparse.ArgumentParser(prog="python -m hivepath.settings", description=main.__doc__)
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--markdown", action="store_true", help="print the table of every HIVEPATH_* variable")
    group.add_argument("--update", metavar="FILE", help="rewrite the table between the markers in FILE")
    args = parser.parse_args(argv)
    if args.markdown:
        sys.stdout.write(markdown_table())
        return 0
    path = Path(args.update)
    path.write_text(update_markdown(path.read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
