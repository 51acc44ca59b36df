"""``hivepath peer join``: join a run as a volunteer peer; ``hivepath peer status``: ask the peer
running on this machine how it is doing (its local status endpoint, ``peer.node.local_status``).

Every flag can come from an environment variable (for containers); a flag on the command line wins
over the variable. The first SIGTERM or SIGINT drains (finish or abandon the round, checkpoint, leave,
exit 0); a second one exits at once, losing nothing already checkpointed.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from hivepath.cli import env_default
from models.errors import HivepathError

__all__ = ["register", "run", "drain_signals", "add_network_flags", "check_status_flags", "read_token"]

DEFAULT_STATUS_PORT = 7702
"""Port of a peer's local status (``peer.node.local_status.DEFAULT_STATUS_PORT``; kept here so that
building the parser imports nothing heavy)."""

log = logging.getLogger(__name__)


def _split(value: str | None) -> list[str]:
    return [v for v in (value or "").replace(",", " ").split() if v]


def add_network_flags(p: argparse.ArgumentParser) -> None:
    """The flags every networked peer role shares (``peer join``, ``archive``): how it reaches the
    coordinator and the DHT. Each reads its ``HIVEPATH_*`` variable."""
    p.add_argument("--coordinator", default=env_default("HIVEPATH_COORDINATOR"), metavar="HOST:PORT",
                   help="the coordinator's gRPC address (env HIVEPATH_COORDINATOR; required)")
    p.add_argument("--token", default=env_default("HIVEPATH_TOKEN"),
                   help="the run token (env HIVEPATH_TOKEN; or --token-file)")
    p.add_argument("--token-file", default=env_default("HIVEPATH_TOKEN_FILE"), metavar="FILE",
                   help="read the run token from FILE (env HIVEPATH_TOKEN_FILE)")
    p.add_argument("--initial-peers", nargs="*", default=_split(env_default("HIVEPATH_INITIAL_PEERS")),
                   metavar="MADDR", help="extra DHT bootstrap multiaddrs (env HIVEPATH_INITIAL_PEERS, space-separated)")
    p.add_argument("--identity", default=env_default("HIVEPATH_IDENTITY"), metavar="FILE",
                   help="identity key file for a stable peer id (env HIVEPATH_IDENTITY; default identity.key in "
                   "the work or archive directory)")
    p.add_argument("--host-maddrs", nargs="*", default=_split(env_default("HIVEPATH_HOST_MADDRS", "/ip4/0.0.0.0/tcp/0")),
                   metavar="MADDR", help="multiaddrs to listen on (env HIVEPATH_HOST_MADDRS)")
    p.add_argument("--announce-maddrs", nargs="*", default=_split(env_default("HIVEPATH_ANNOUNCE_MADDRS")),
                   metavar="MADDR", help="multiaddrs other peers should dial (env HIVEPATH_ANNOUNCE_MADDRS)")
    p.add_argument("--tls-ca", default=env_default("HIVEPATH_TLS_CA"), metavar="FILE",
                   help="CA certificate to verify a TLS coordinator (env HIVEPATH_TLS_CA)")
    p.add_argument("--status-port", type=int, default=env_default("HIVEPATH_STATUS_PORT", DEFAULT_STATUS_PORT, int),
                   metavar="PORT", help="serve /status and /healthz on 127.0.0.1:PORT for health checks "
                   f"(env HIVEPATH_STATUS_PORT; default {DEFAULT_STATUS_PORT}; 0 turns it off)")
    p.add_argument("--stall-timeout", type=float, default=env_default("HIVEPATH_STALL_TIMEOUT", 300.0, float),
                   metavar="S", help="report unhealthy after S seconds without progress outside a waiting state "
                   "(env HIVEPATH_STALL_TIMEOUT; default 300)")


def check_status_flags(args: argparse.Namespace) -> None:
    """Bad ``--status-port``/``--stall-timeout`` values stop the command with one line."""
    if not 0 <= args.status_port <= 65535:
        raise HivepathError(f"--status-port must be a TCP port (1-65535) or 0 to turn it off, got {args.status_port}")
    if not args.stall_timeout > 0:
        raise HivepathError(f"--stall-timeout must be > 0 seconds, got {args.stall_timeout}")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "peer",
        help="run a volunteer peer (hivepath peer join ...)",
        description="Run a volunteer peer of a hivepath run.",
    )
    peer_sub = p.add_subparsers(dest="peer_command", metavar="SUBCOMMAND", required=True)
    j = peer_sub.add_parser(
        "join",
        help="join a run: measure this machine, get work from the coordinator, train and average",
        description=(
            "Join a run through its coordinator: fetch the run spec, find or prepare the dataset, measure "
            "tokens/s on the run's model, join the DHT, train the assigned path with DiLoCo outer rounds, "
            "checkpoint after every round, and follow reassignments. SIGTERM/SIGINT drains and exits 0."
        ),
        epilog="Exit codes: 0 done or drained, 2 bad input, 3 coordinator unreachable or token refused, "
        "4 incompatible data or config, 5 no work fits this machine, 6 identity in use.",
    )
    add_network_flags(j)
    j.add_argument("--device", default=env_default("HIVEPATH_DEVICE", "auto"),
                   help="auto, cpu, cuda or cuda:N (env HIVEPATH_DEVICE; default auto)")
    j.add_argument("--max-memory", type=float, default=env_default("HIVEPATH_MAX_MEMORY", None, float), metavar="GB",
                   help="use at most this much device memory (env HIVEPATH_MAX_MEMORY)")
    j.add_argument("--work-dir", default=env_default("HIVEPATH_WORK_DIR", "~/.hivepath"), metavar="DIR",
                   help="checkpoints, identity and data (env HIVEPATH_WORK_DIR; default ~/.hivepath)")
    j.add_argument("--data", default=env_default("HIVEPATH_DATA"), metavar="DIR",
                   help="a prepared dataset (env HIVEPATH_DATA; default: prepared under WORK_DIR when missing)")
    j.add_argument("--client-mode", action="store_true", default=env_default("HIVEPATH_CLIENT_MODE", False, _bool),
                   help="accept no incoming connections, e.g. behind NAT (env HIVEPATH_CLIENT_MODE=1)")
    j.add_argument("--upload-mbps", type=float, default=env_default("HIVEPATH_UPLOAD_MBPS", None, float),
                   metavar="MBIT", help="upload bandwidth in Mbit/s (env HIVEPATH_UPLOAD_MBPS; default: measured "
                   "against the coordinator at start-up, 2 MiB each way; 100 if that fails)")
    j.add_argument("--progress", default=env_default("HIVEPATH_PROGRESS", "auto"), choices=["auto", "rich", "json"],
                   help="live panel (rich), JSON lines on stdout (json), or rich on a terminal (auto; env HIVEPATH_PROGRESS)")
    j.add_argument("--drain-timeout", type=float, default=env_default("HIVEPATH_DRAIN_TIMEOUT", 60.0, float),
                   metavar="S", help="seconds allowed to finish a round when stopping (env HIVEPATH_DRAIN_TIMEOUT)")
    j.add_argument("--max-steps", type=int, default=env_default("HIVEPATH_MAX_STEPS", 0, int), metavar="N",
                   help="leave after N inner steps (0: run until stopped; env HIVEPATH_MAX_STEPS)")
    j.add_argument("--threads", type=int, default=env_default("HIVEPATH_THREADS", None, int), metavar="N",
                   help="CPU threads for torch (env HIVEPATH_THREADS)")
    j.add_argument("--measure-seconds", type=float, default=env_default("HIVEPATH_MEASURE_SECONDS", 2.0, float),
                   metavar="S", help="seconds spent measuring tokens/s at start-up (env HIVEPATH_MEASURE_SECONDS; default 2)")
    j.add_argument("--spot", default=env_default("HIVEPATH_SPOT", "none"), choices=["none", "aws", "gcp", "auto"],
                   help="watch the cloud's spot/preemption notice and drain on one (env HIVEPATH_SPOT; default none)")
    j.add_argument("--spot-url", default=env_default("HIVEPATH_SPOT_URL"), metavar="URL",
                   help="metadata server base URL (env HIVEPATH_SPOT_URL; default: the provider's own)")
    j.add_argument("--spot-poll-interval", type=float, default=env_default("HIVEPATH_SPOT_POLL_INTERVAL", 5.0, float),
                   metavar="S", help="seconds between notice checks (env HIVEPATH_SPOT_POLL_INTERVAL; default 5)")
    j.add_argument("--coordinator-timeout", type=float, default=env_default("HIVEPATH_COORDINATOR_TIMEOUT", 60.0, float),
                   metavar="S", help="seconds to retry an unreachable coordinator at start-up (env HIVEPATH_COORDINATOR_TIMEOUT)")
    j.add_argument("--keep-checkpoints", type=int, default=env_default("HIVEPATH_KEEP_CHECKPOINTS", 2, int), metavar="K",
                   help="checkpoint snapshots kept in WORK_DIR/checkpoints (env HIVEPATH_KEEP_CHECKPOINTS; default 2)")
    j.set_defaults(func=run)
    st = peer_sub.add_parser(
        "status",
        help="show the local peer's status (what it trains, its round, whether it is healthy)",
        description="Ask the peer (or archive) running on this machine for its local status "
        "(http://127.0.0.1:PORT/status) and print it as one line, or as JSON with --json.",
        epilog="Exit codes: 0 healthy, 1 unhealthy or nothing answers.",
    )
    st.add_argument("--port", type=int, default=env_default("HIVEPATH_STATUS_PORT", DEFAULT_STATUS_PORT, int),
                    help=f"the peer's --status-port (env HIVEPATH_STATUS_PORT; default {DEFAULT_STATUS_PORT})")
    st.add_argument("--json", action="store_true", help="print the whole status document as JSON")
    st.add_argument("--timeout", type=float, default=5.0, metavar="S", help="seconds to wait for an answer (default 5)")
    st.set_defaults(func=run_status)


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(text)


def read_token(token: str | None, token_file: str | None) -> str:
    """The run token from ``--token`` or ``--token-file``; a clear error when neither is given."""
    if token_file:
        try:
            token = Path(token_file).expanduser().read_text().strip()
        except OSError as e:
            raise HivepathError(f"--token-file {token_file}: cannot read it ({e.strerror or e})") from None
    if not token:
        raise HivepathError("no run token: pass --token, --token-file or set HIVEPATH_TOKEN")
    return token


@contextmanager
def drain_signals(on_first) -> Iterator[None]:
    """While inside: the first SIGTERM/SIGINT calls ``on_first(reason)``; a second exits at once with
    status 130. On leaving (drained), SIGTERM is ignored: a late one (a supervisor's, a second
    watcher's) must not kill the interpreter as it exits, when Python resets its handlers to the
    default, and turn exit 0 into 143."""
    count = {"n": 0}

    def handler(signum, _frame):
        count["n"] += 1
        name = signal.Signals(signum).name
        if count["n"] == 1:
            on_first(f"{name} received")
        else:
            sys.stderr.write(f"hivepath: second {name}: exiting now (the last checkpoint is intact)\n")
            sys.stderr.flush()
            os._exit(130)

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


def run(args: argparse.Namespace) -> int:
    from peer.node import PeerNode, PeerOptions

    if args.keep_checkpoints < 1:
        raise HivepathError(f"--keep-checkpoints must be >= 1, got {args.keep_checkpoints}")
    check_status_flags(args)
    if not args.coordinator:
        raise HivepathError("no coordinator address: pass --coordinator HOST:PORT or set HIVEPATH_COORDINATOR")
    opts = PeerOptions(
        coordinator=args.coordinator,
        token=read_token(args.token, args.token_file),
        initial_peers=tuple(args.initial_peers),
        device=args.device,
        max_memory_gb=args.max_memory,
        work_dir=Path(args.work_dir).expanduser(),
        identity=Path(args.identity).expanduser() if args.identity else None,
        data_dir=Path(args.data).expanduser() if args.data else None,
        host_maddrs=tuple(args.host_maddrs),
        announce_maddrs=tuple(args.announce_maddrs),
        client_mode=args.client_mode,
        progress=args.progress,
        tls_ca=args.tls_ca,
        upload_mbps=args.upload_mbps,
        drain_timeout=args.drain_timeout,
        max_steps=args.max_steps,
        threads=args.threads,
        coordinator_timeout=args.coordinator_timeout,
        measure_seconds=args.measure_seconds,
        keep_checkpoints=args.keep_checkpoints,
        status_port=args.status_port,
        stall_timeout=args.stall_timeout,
    )
    from peer.node import SpotOptions, SpotWatcher

    node = PeerNode(opts)
    spot = SpotOptions(provider=args.spot, base_url=args.spot_url, poll_interval=args.spot_poll_interval)
    watcher = SpotWatcher.from_options(spot, lambda notice: node.request_stop(notice.describe(), preempting=True))
    with drain_signals(node.request_stop):
        watcher.start()
        try:
            return node.run()
        finally:
            watcher.stop()


def run_status(args: argparse.Namespace) -> int:
    """``hivepath peer status``: one line (or the JSON document) from the local status endpoint."""
    import json
    import urllib.error
    import urllib.request

    url = f"http://127.0.0.1:{args.port}/status"
    try:
        with urllib.request.urlopen(url, timeout=args.timeout) as resp:
            doc = json.loads(resp.read())
    except (OSError, ValueError) as e:
        reason = getattr(e, "reason", None) or e
        sys.stderr.write(f"hivepath: no peer status at {url} ({reason}): is a peer or archive running here "
                         f"with --status-port {args.port}?\n")
        return 1
    if args.json:
        sys.stdout.write(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    else:
        sys.stdout.write(_status_line(doc) + "\n")
    return 0 if doc.get("healthy") else 1


def _status_line(doc: dict) -> str:
    loss = doc.get("loss")
    heartbeat = doc.get("seconds_since_heartbeat")
    parts = [
        f"{doc.get('role', 'peer')} {str(doc.get('peer_id') or '?')[:16]}",
        f"{doc.get('state')} {doc.get('mode')} {doc.get('assignment') or '-'}",
        f"round {doc.get('round_no')} step {doc.get('step')}",
        f"loss {loss:.3f}" if isinstance(loss, (int, float)) else "loss -",
        f"{doc.get('tokens', 0):,} tokens",
        "coordinator " + (f"answered {heartbeat:.0f}s ago" if heartbeat is not None else "not heard from yet"),
        ("healthy: " if doc.get("healthy") else "UNHEALTHY: ") + str(doc.get("reason", "")),
    ]
    if doc.get("checkpoint_error"):
        parts.append(f"last checkpoint failed: {doc['checkpoint_error']}")
    return " | ".join(parts)
