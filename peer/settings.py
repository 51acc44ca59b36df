"""The settings of the peer package's processes, each declared once as a
:class:`models.settings.Setting` (variable, kind, default, range or choices, help, flag):

- :data:`NETWORK_SETTINGS`: how a long-running peer process (``peer join``, ``archive``) reaches the
  run (:class:`peer.node.startup.NetworkOptions`);
- :data:`JOIN_SETTINGS`: ``peer join``'s own (:class:`peer.node.PeerOptions`);
- :data:`ARCHIVE_SETTINGS`: ``archive``'s own (:class:`peer.node.ArchiveOptions`);
- :data:`PEER_SETTINGS`: the variables the peer package reads itself (spot notices, the machine
  share, progress lines, test protocols).

The command line builds each flag from its declaration (``hivepath.settings.add_flag``), the option
dataclasses take their defaults from it (:func:`default`), and ``docs/cli.md``'s table is generated
from it (``hivepath.settings``), so a default is written here and nowhere else.

Variables only wire deployments (a container, a supervisor); a flag given on the command line wins
over its variable, and the variable over the default written here. Code reads a variable only
through :func:`read` (or :meth:`Setting.read`), never from ``os.environ``: so the table in
``docs/cli.md``, generated from these entries, is every variable there is.

Stdlib and ``models.settings`` only: the spot supervisor and the progress view read it, and importing
it must stay as cheap as the command line's ``--help``.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from models.settings import KINDS, Setting, count, natural, non_negative, port, positive, seconds, share

__all__ = ["Setting", "KINDS", "NETWORK_SETTINGS", "JOIN_SETTINGS", "ARCHIVE_SETTINGS", "PEER_SETTINGS",
           "PROCESS_SETTINGS", "read", "setting", "default"]

_NET = "peer join, archive"

NETWORK_SETTINGS: tuple[Setting, ...] = (
    Setting("HIVEPATH_INITIAL_PEERS", "list", [], "extra DHT bootstrap multiaddrs besides the coordinator's "
            "(a variable: separated by spaces or commas)", flag="--initial-peers", read_by=_NET, metavar="MADDR"),
    Setting("HIVEPATH_IDENTITY", "path", None,
            "identity key file for a stable peer id (default identity.key in the work or archive directory)",
            flag="--identity", read_by=f"{_NET}, deploy/healthcheck.py", metavar="FILE"),
    Setting("HIVEPATH_HOST_MADDRS", "list", ["/ip4/0.0.0.0/tcp/0"], "multiaddrs the DHT node listens on",
            flag="--host-maddrs", read_by=f"{_NET}, deploy/entrypoint.sh", metavar="MADDR"),
    Setting("HIVEPATH_ANNOUNCE_MADDRS", "list", [],
            "multiaddrs other peers should dial (the images' entrypoint turns 'auto' into the container's "
            "addresses)", flag="--announce-maddrs", read_by=f"{_NET}, deploy/entrypoint.sh", metavar="MADDR"),
    Setting("HIVEPATH_LANE_PORT", "integer", 0,
            "TCP port of the direct lane that carries averaging parts outside the p2p daemon, on the --host-maddrs "
            "hosts, offered at the announced addresses; 0 picks an ephemeral port; forward it beside the p2p port "
            "behind a router", flag="--lane-port", read_by=_NET, range=port(), metavar="PORT"),
    Setting("HIVEPATH_TLS_CA", "path", None, "CA certificate to verify a TLS coordinator", flag="--tls-ca",
            read_by=_NET, metavar="FILE"),
    Setting("HIVEPATH_STATUS_PORT", "integer", 7702,
            "serve /status and /healthz on 127.0.0.1 at this port for health checks (0 turns it off)",
            flag="--status-port", read_by=f"{_NET}, peer status, deploy/healthcheck.py", range=port(),
            metavar="PORT"),
    Setting("HIVEPATH_STALL_TIMEOUT", "number", 300.0,
            "report unhealthy after this many seconds without progress outside a waiting state",
            flag="--stall-timeout", read_by=_NET, range=seconds(), metavar="S"),
    Setting("HIVEPATH_COORDINATOR_TIMEOUT", "number", 60.0,
            "seconds to retry an unreachable coordinator at start-up; given (flag or variable), also where nothing "
            "answers yet, which is otherwise given up after 10 s", flag="--coordinator-timeout",
            read_by=_NET, range=non_negative(), metavar="S"),
)
"""How ``peer join`` and ``archive`` reach the coordinator and the DHT, and their status page."""

_JOIN = "peer join"

JOIN_SETTINGS: tuple[Setting, ...] = (
    Setting("HIVEPATH_DEVICE", "text", "auto", "auto (a GPU no other peer of this machine uses, or the CPU without "
            "one), cpu, cuda or cuda:N", flag="--device", read_by=_JOIN),
    Setting("HIVEPATH_MAX_MEMORY", "number", None, "use at most this many GB of device memory (default: the "
            "device's free memory divided among the peers of this machine on it)",
            flag="--max-memory", read_by=_JOIN, range=positive(), metavar="GB"),
    Setting("HIVEPATH_PEER_ROLE", "text", None,
            "ask the coordinator for this role instead of letting it choose from memory, compute and link: train a "
            "whole path, serve one module as a pipeline stage, or drive a pipeline through stage servers (default: "
            "the coordinator decides)", flag="--role", read_by=_JOIN, choices=("path", "stage", "trainer")),
    Setting("HIVEPATH_WORK_DIR", "path", "~/.hivepath", "checkpoints, identity and data of a peer",
            flag="--work-dir", read_by=f"{_JOIN}, deploy/healthcheck.py", metavar="DIR"),
    Setting("HIVEPATH_DATA", "path", None,
            "a prepared dataset (peer join: prepared under the work directory when the corpus is here, else the "
            "assigned path's shards are fetched from seeders; archive: seeded to peers)",
            flag="--data", read_by=_NET, metavar="DIR"),
    Setting("HIVEPATH_NO_SEED", "boolean", False, "do not seed the dataset files held to other peers",
            flag="--no-seed", read_by=_NET),
    Setting("HIVEPATH_MAX_DATA_GB", "number", None,
            "disk budget in GB for fetched shards of paths trained before, least recently used out first; the "
            "path being trained is never removed (default: keep all)", flag="--max-data-gb", read_by=_JOIN,
            range=positive(), metavar="GB"),
    Setting("HIVEPATH_CLIENT_MODE", "boolean", False, "accept no incoming connections, e.g. behind NAT",
            flag="--client-mode", read_by=_JOIN),
    Setting("HIVEPATH_UPLOAD_MBPS", "number", None,
            "upload bandwidth in Mbit/s (default: measured against the coordinator at start-up, 2 MiB each way; "
            "100 if that fails)", flag="--upload-mbps", read_by=_JOIN, range=positive(), metavar="MBIT"),
    Setting("HIVEPATH_PROGRESS", "text", "auto", "live panel (rich), JSON lines on stdout (json), or rich on a "
            "terminal unless --log-format json (auto)", flag="--progress", read_by=_JOIN,
            choices=("auto", "rich", "json")),
    Setting("HIVEPATH_DRAIN_TIMEOUT", "number", 60.0, "seconds from the start of a drain allowed to finish the "
            "round in flight; then it is abandoned (not applied: the last global state is checkpointed) and the peer "
            "leaves", flag="--drain-timeout", read_by=_JOIN, range=non_negative(), metavar="S"),
    Setting("HIVEPATH_MAX_STEPS", "integer", 0, "leave after this many inner steps (0: run until stopped)",
            flag="--max-steps", read_by=_JOIN, range=natural(), metavar="N"),
    Setting("HIVEPATH_THREADS", "integer", None, "CPU threads for torch (peer join: the machine's cores divided "
            "among the peers running on it, which register in HIVEPATH_PEERS_DIR; otherwise torch's choice)",
            flag="--threads", read_by=f"{_JOIN}, train-local, eval, generate", range=count(), metavar="N"),
    Setting("HIVEPATH_MEASURE_SECONDS", "number", 2.0, "seconds spent measuring tokens/s at start-up",
            flag="--measure-seconds", read_by=_JOIN, range=seconds(), metavar="S"),
    Setting("HIVEPATH_CPU_LIMIT", "number", 1.0,
            "share of the time the peer trains, from 0 (exclusive) to 1: it rests between inner steps so that "
            "computing is at most this share (e.g. 0.5 on a machine its owner also uses; 1 never rests); the tokens/s "
            "reported to the coordinator are the rested ones, so the work assigned fits",
            flag="--cpu-limit", read_by=_JOIN, range=share(), metavar="SHARE"),
    Setting("HIVEPATH_KEEP_CHECKPOINTS", "integer", 2, "checkpoint snapshots kept in WORK_DIR/checkpoints",
            flag="--keep-checkpoints", read_by=_JOIN, range=count(), metavar="K"),
)
"""``peer join``'s own settings (``HIVEPATH_DATA`` and ``HIVEPATH_NO_SEED`` are the archive's too)."""

_ARCHIVE = "archive"

ARCHIVE_SETTINGS: tuple[Setting, ...] = (
    Setting("HIVEPATH_ARCHIVE_DIR", "path", None, "where the archive writes its snapshots (required)",
            flag="--dir", read_by="archive, deploy/healthcheck.py (default /data/archive there)", metavar="DIR"),
    Setting("HIVEPATH_ARCHIVE_KEEP", "integer", 3, "archive snapshots kept", flag="--keep", read_by=_ARCHIVE,
            range=count(), metavar="K"),
    Setting("HIVEPATH_ARCHIVE_EVAL_DOCS", "integer", 4,
            "validation documents per path the archive scores on a new snapshot, shown on the coordinator's status "
            "page (0: no scoring; needs --data)", flag="--eval-docs", read_by=_ARCHIVE, range=natural(), metavar="N"),
    Setting("HIVEPATH_ARCHIVE_EVAL_INTERVAL", "number", 120.0,
            "seconds between two of the archive's scorings at least (it often shares a machine with trainers)",
            flag="--eval-interval", read_by=_ARCHIVE, range=seconds(), metavar="S"),
)
"""``archive``'s own settings."""

_SPOT = "peer join; python -m peer.node.spot (the images' supervisor)"

PEER_SETTINGS: tuple[Setting, ...] = (
    Setting("HIVEPATH_SPOT", "text", "none",
            "watch the cloud's spot/preemption notice and drain on one: none, aws, gcp or auto",
            flag="--spot", read_by=_SPOT, choices=("none", "aws", "gcp", "auto")),
    Setting("HIVEPATH_SPOT_URL", "text", None,
            "metadata server base URL (default: the provider's own)",
            flag="--spot-url", read_by=_SPOT, metavar="URL"),
    Setting("HIVEPATH_SPOT_POLL_INTERVAL", "number", 5.0,
            "seconds between spot-notice checks",
            flag="--spot-poll-interval", read_by=_SPOT, range=seconds(), metavar="S"),
    Setting("HIVEPATH_PEERS_DIR", "text", None,
            "where the peers of this machine register to share its cores, memory and GPUs (default "
            "$XDG_RUNTIME_DIR/hivepath-UID/peers, else the temp dir's)",
            read_by="peer join"),
    Setting("HIVEPATH_PROGRESS_INTERVAL", "number", 5.0,
            "least seconds between two progress lines: a peer's JSON lines (--progress json), the demo's plain "
            "lines (off a terminal or --no-live)", read_by="peer join, demo"),
    Setting("HIVEPATH_TEST_PROTOCOL", "text", None,
            "tests only: speak these protocol versions instead of this release's, e.g. 'all=2.0' or "
            "'dht=1.0,averaging=1.0' (protos.versions)",
            read_by="every peer process (peer join, archive)"),
)
"""The variables of the peer package, each read where its code needs it (see ``read_by``)."""

PROCESS_SETTINGS: tuple[Setting, ...] = NETWORK_SETTINGS + JOIN_SETTINGS + ARCHIVE_SETTINGS + PEER_SETTINGS
"""Every setting of the peer package, each once."""

_BY_NAME = {s.name: s for s in PROCESS_SETTINGS}


def setting(name: str) -> Setting:
    """The peer's :class:`Setting` called ``name`` (a ``KeyError`` for a variable it does not own)."""
    return _BY_NAME[name]


def default(name: str) -> Any:
    """The declared default of the peer's setting ``name``: what an option takes when nothing sets it."""
    return _BY_NAME[name].default


def read(name: str, environ: Optional[Mapping[str, str]] = None) -> Any:
    """The value of the peer's variable ``name`` (see :meth:`Setting.read`)."""
    return _BY_NAME[name].read(environ)
