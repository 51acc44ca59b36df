"""``hivepath peer join``: join a run as a volunteer peer; ``hivepath peer status``: ask the peer
running on this machine how it is doing (its local status endpoint, ``peer.node.local_status``).

Every flag can come from an environment variable (for containers; ``hivepath.settings``); a flag on
the command line wins over the variable. The first SIGTERM, SIGINT or SIGHUP drains (finish or abandon
the round, checkpoint, leave, exit 0); a second one exits at once, losing nothing already checkpointed
(``peer.node.startup``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hivepath.numbers import port, seconds
from hivepath.options import add_network_flags, network_options
from hivepath.paths import dataset, write_dir
from hivepath.settings import add_flag
from models import strict_json

__all__ = ["register", "run", "run_status"]


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
            "Join a run through its coordinator: fetch the run spec, find or prepare the dataset (or fetch the "
            "assigned path's shards from seeders, verified, when the run's corpus is not here), measure "
            "tokens/s on the run's model, join the DHT, train the assigned path with DiLoCo outer rounds, "
            "checkpoint after every round, and follow reassignments. SIGTERM, SIGINT or SIGHUP drains and exits 0."
        ),
        epilog="Exit codes: 0 done or drained, 2 bad input, 3 coordinator unreachable or token refused, "
        "4 incompatible data or config, 5 no work fits this machine, 6 identity in use.",
    )
    add_network_flags(j)
    for name in ("HIVEPATH_DEVICE", "HIVEPATH_MAX_MEMORY", "HIVEPATH_PEER_ROLE"):
        add_flag(j, name)
    add_flag(j, "HIVEPATH_WORK_DIR", type=write_dir())
    add_flag(j, "HIVEPATH_DATA", type=dataset(prepare=True),
             help="a prepared dataset (default: prepared under WORK_DIR when the run's corpus is on this machine, else "
             "the assigned path's shards are fetched from the network, verified)")
    add_flag(j, "HIVEPATH_NO_SEED", help="do not seed the dataset files this peer holds to other peers")
    for name in ("HIVEPATH_MAX_DATA_GB", "HIVEPATH_CLIENT_MODE", "HIVEPATH_UPLOAD_MBPS", "HIVEPATH_PROGRESS",
                 "HIVEPATH_DRAIN_TIMEOUT", "HIVEPATH_MAX_STEPS", "HIVEPATH_THREADS", "HIVEPATH_CPU_LIMIT",
                 "HIVEPATH_MEASURE_SECONDS", "HIVEPATH_SPOT", "HIVEPATH_SPOT_URL", "HIVEPATH_SPOT_POLL_INTERVAL",
                 "HIVEPATH_KEEP_CHECKPOINTS"):
        add_flag(j, name)
    j.set_defaults(func=run)
    st = peer_sub.add_parser(
        "status",
        help="show the local peer's status (what it trains, its round, whether it is healthy)",
        description="Ask the peer (or archive) running on this machine for its local status "
        "(http://127.0.0.1:PORT/status) and print it as one line, or as JSON with --json.",
        epilog="Exit codes: 0 healthy, 1 unhealthy or nothing answers.",
    )
    add_flag(st, "HIVEPATH_STATUS_PORT", flag="--port", type=port(allow_zero=False), metavar="PORT",
             help="the peer's --status-port")
    st.add_argument("--json", action="store_true", help="print the whole status document as JSON")
    st.add_argument("--timeout", type=seconds(), default=5.0, metavar="S", help="seconds to wait for an answer (default 5)")
    st.set_defaults(func=run_status)


def run(args: argparse.Namespace) -> int:
    """``hivepath peer join``: the flags as :class:`peer.node.PeerOptions`, run until drained."""
    network = network_options(args, client_mode=args.client_mode)  # bad flags: one line before torch loads
    from peer.node import PeerNode, PeerOptions, SpotOptions, run_until_stopped

    opts = PeerOptions(
        network=network,
        device=args.device,
        max_memory_gb=args.max_memory,
        work_dir=Path(args.work_dir).expanduser(),
        data_dir=Path(args.data).expanduser() if args.data else None,
        seed=not args.no_seed,
        max_data_gb=args.max_data_gb,
        # JSON logs ask for lines a machine reads: no live panel, whatever the terminal
        progress="json" if args.progress == "auto" and getattr(args, "log_format", "text") == "json" else args.progress,
        upload_mbps=args.upload_mbps,
        drain_timeout=args.drain_timeout,
        max_steps=args.max_steps,
        threads=args.threads,
        cpu_limit=args.cpu_limit,
        measure_seconds=args.measure_seconds,
        keep_checkpoints=args.keep_checkpoints,
        role=args.role or "",
    )
    spot = SpotOptions(provider=args.spot, base_url=args.spot_url, poll_interval=args.spot_poll_interval)
    return run_until_stopped(PeerNode(opts), spot)


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
        sys.stdout.write(strict_json.dumps(doc, indent=1, sort_keys=True) + "\n")
    else:
        sys.stdout.write(_status_line(doc) + "\n")
    return 0 if doc.get("healthy") else 1


def _status_line(doc: dict) -> str:
    loss = doc.get("loss")
    heartbeat = doc.get("seconds_since_heartbeat")
    parts = [
        f"{doc.get('role', 'peer')} {str(doc.get('peer_id') or '?')[:16]} (hivepath {doc.get('version') or '?'})",
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
