"""``hivepath coordinator``: run the coordinator service, or ask a running one for status or a drain.

- ``serve --run-config run.toml --db state.db --port P --http-port Q``: the run token comes from
  ``--token``, ``--token-file``, ``HIVEPATH_TOKEN`` or ``HIVEPATH_TOKEN_FILE`` (first found, in that
  order: :func:`hivepath.options.read_token`, as in every command).
  ``--key FILE`` (default ``<db>.key``) is the Ed25519 key that signs peers' credentials.
- ``status [--json]``, ``drain PEER_ID``, ``ban PEER_ID`` and ``unban PEER_ID``: operator commands
  over gRPC (``--coordinator`` or ``HIVEPATH_COORDINATOR``, same token sources). ``status`` shows
  peer ids shortened to :data:`SHORT_ID` characters; ``drain``, ``ban`` and ``unban`` take any
  unique start of the id of a peer it lists (:func:`resolve_peer_id`), ``ban`` and ``unban`` also a
  whole id it does not list (a banned peer is not listed); one that matches no peer, or several,
  is bad input (exit 2).
"""

from __future__ import annotations

import argparse
import logging
import sys

from hivepath.numbers import port
from hivepath.options import add_token_flags, read_token
from hivepath.paths import certificate, database, dataset, key_file, private_key, text_file
from hivepath.settings import env_default
from models import strict_json
from models.errors import ConfigError, HivepathError
from models.settings import COORDINATOR_HTTP_PORT, COORDINATOR_PORT

__all__ = ["register", "run", "resolve_peer_id", "short_id", "SHORT_ID"]

SHORT_ID = 16
"""Characters of a peer id ``coordinator status`` shows (``12D3KooWAbCdEfGh``: unique among a run's
peers in practice; ``--json`` and ``--full-ids`` show whole ids)."""

_TOKEN_ENV = "env HIVEPATH_TOKEN or HIVEPATH_TOKEN_FILE, read after --token and --token-file"

log = logging.getLogger(__name__)


def _add_client(p: argparse.ArgumentParser) -> None:
    p.add_argument("--coordinator", default=env_default("HIVEPATH_COORDINATOR") or f"127.0.0.1:{COORDINATOR_PORT}",
                   help=f"HOST[:PORT] of the coordinator (env HIVEPATH_COORDINATOR; default 127.0.0.1:{COORDINATOR_PORT}; "
                        f"PORT defaults to {COORDINATOR_PORT})")
    p.add_argument("--tls-ca", type=certificate(), metavar="FILE",
                   help="PEM CA certificate to verify a TLS coordinator")
    add_token_flags(p)


def _add_peer_id(p: argparse.ArgumentParser) -> None:
    p.add_argument("peer_id", metavar="PEER_ID",
                   help="the peer's id, or any unique start of it (as 'coordinator status' shows it)")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "coordinator", help="run or query the coordinator service",
        description="Run the coordinator service, or ask a running one for its status or to drain a peer.",
    )
    sub = parser.add_subparsers(dest="coordinator_command", metavar="ACTION", required=True)

    serve = sub.add_parser(
        "serve", help="run the coordinator (gRPC + status page)",
        description="Run the coordinator: admit peers with the run token, hand out work, hold leases, serve the "
                    "status page and metrics. The process reads no environment variable but the token's "
                    "(HIVEPATH_TOKEN, HIVEPATH_TOKEN_FILE); in the container image deploy/entrypoint.sh turns the "
                    "variables named in each flag's help into the flag.",
        epilog="Exit codes: 0 stopped by SIGTERM/SIGINT, 2 bad input (a flag, run.toml, a port in use), 4 --data "
               "differs from the pinned manifest hash. See docs/coordinator.md.")
    serve.add_argument("--run-config", type=text_file(), required=True, metavar="FILE",
                       help="run.toml: the run and its [coordinator] section (image: HIVEPATH_RUN_CONFIG)")
    serve.add_argument("--data", type=dataset(), metavar="DIR",
                       help="the run's prepared dataset: its manifest hash fills an empty [data] manifest_hash (and must "
                            "equal a pinned one); needed when the corpus is not the built-in one and no hash is pinned")
    serve.add_argument("--db", type=database(), required=True, metavar="FILE",
                       help="SQLite state file in an existing directory (created if missing; ':memory:' for none; "
                            "image: HIVEPATH_DB)")
    serve.add_argument("--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0)")
    serve.add_argument("--port", type=port(), default=COORDINATOR_PORT,
                       help=f"gRPC port (default {COORDINATOR_PORT}; image: HIVEPATH_PORT)")
    serve.add_argument("--http-port", type=port(), default=COORDINATOR_HTTP_PORT,
                       help=f"status page / metrics port (default {COORDINATOR_HTTP_PORT}; image: HIVEPATH_HTTP_PORT)")
    serve.add_argument("--tls-cert", type=certificate(), metavar="FILE",
                       help="PEM certificate chain: serve gRPC over TLS (with --tls-key; image: HIVEPATH_TLS_CERT)")
    serve.add_argument("--tls-key", type=private_key(), metavar="FILE",
                       help="PEM private key of --tls-cert (image: HIVEPATH_TLS_KEY)")
    serve.add_argument("--key", type=key_file(pem="private key"), metavar="FILE",
                       help="Ed25519 key file signing peer credentials (default <db>.key; created if missing)")
    add_token_flags(serve)
    serve.set_defaults(func=run)

    status = sub.add_parser("status", help="show a running coordinator's view of the run")
    _add_client(status)
    status.add_argument("--json", action="store_true", help="print the status as JSON (whole peer ids)")
    status.add_argument("--full-ids", action="store_true", help=f"show whole peer ids (default: the first {SHORT_ID} "
                        "characters, which drain, ban and unban accept)")
    status.set_defaults(func=run)

    drain = sub.add_parser("drain", help="tell a peer to finish its round and leave")
    _add_peer_id(drain)
    drain.add_argument("--reason", default="drained by the operator")
    _add_client(drain)
    drain.set_defaults(func=run)

    ban = sub.add_parser("ban", help="ban a peer: its lease is dropped and its joins refused")
    _add_peer_id(ban)
    ban.add_argument("--reason", default="banned by the operator")
    _add_client(ban)
    ban.set_defaults(func=run)

    unban = sub.add_parser("unban", help="lift a peer's ban")
    _add_peer_id(unban)
    _add_client(unban)
    unban.set_defaults(func=run)


def _port(value: int, flag: str) -> int:
    if not 0 <= value <= 65535:
        raise ConfigError(flag, f"{value} is not a port (0-65535)")
    return value


def run(args: argparse.Namespace) -> int:
    if args.coordinator_command == "serve":
        return _serve(args)
    try:
        from peer.coordinator_client import CoordinatorClient
    except ModuleNotFoundError as e:
        if e.name != "peer":
            raise
        # the coordinator's image holds the service only (deploy/Dockerfile.coordinator)
        raise HivepathError(f"'hivepath coordinator {args.coordinator_command}' is a client and needs the peer "
                            "package, which this installation (the coordinator image) leaves out; run it from a "
                            "peer image or a full install (pip install hivepath)") from None

    client = CoordinatorClient(args.coordinator, read_token(args.token, args.token_file), tls_ca=args.tls_ca,
                               retry_timeout=10.0)
    try:
        if args.coordinator_command in ("drain", "ban", "unban"):
            known = [p["peer_id"] for p in client.status().get("peers", [])]
            # a whole id the coordinator does not list may still be banned ahead of its join, or unbanned
            peer_id = resolve_peer_id(args.peer_id, known, allow_unknown=args.coordinator_command != "drain")
            try:
                if args.coordinator_command == "drain":
                    state = client.drain(peer_id, args.reason)
                elif args.coordinator_command == "ban":
                    state = client.ban(peer_id, args.reason)
                else:
                    state = client.unban(peer_id)
            except HivepathError as e:
                if "NOT_FOUND" not in str(e):
                    raise
                raise HivepathError(f"{args.coordinator_command} {args.peer_id}: {e}") from None
            sys.stdout.write(f"{peer_id}: {state}\n")
            return 0
        status = client.status()
        if args.json:
            sys.stdout.write(strict_json.dumps(status, indent=2, sort_keys=True) + "\n")
        else:
            _print_status(status, full_ids=args.full_ids)
        return 0
    finally:
        client.close()


def short_id(peer_id: str) -> str:
    """A peer id as ``coordinator status`` shows it: its first :data:`SHORT_ID` characters."""
    return peer_id[:SHORT_ID]


def resolve_peer_id(text: str, known: list[str], allow_unknown: bool = False) -> str:
    """The one id of ``known`` that ``text`` is, or starts (an id as ``coordinator status`` shortens
    it, a trailing ``…`` or ``...`` allowed). ``allow_unknown``: a whole id (40 characters or more) that
    matches none is returned as given. Otherwise no match, or several, is a :class:`HivepathError`
    (exit 2) naming the fix."""
    given = text.strip()
    prefix = given.rstrip(".…")
    if not prefix:
        raise HivepathError(f"{text!r} is not a peer id; 'hivepath coordinator status' lists the run's peers")
    if given in known:
        return given
    matches = sorted({k for k in known if k.startswith(prefix)})
    if len(matches) == 1:
        return matches[0]
    if len(matches) > 1:
        shown = ", ".join(short_id(m) + "…" for m in matches[:5])
        raise HivepathError(f"{text!r} starts {len(matches)} peer ids ({shown}); give more of the id")
    if allow_unknown and len(prefix) >= 40:
        return prefix
    raise HivepathError(f"no peer of this run has an id starting {prefix!r}; 'hivepath coordinator status' lists "
                        "them (any unique start of an id will do)")


def _print_status(s: dict, full_ids: bool = False) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(f"run [bold]{s['run_id']}[/] config {s['run_config_hash']} · {s['live_leases']} live leases · "
                  f"{s['total_tokens_per_s']:.0f} tokens/s")
    peers = Table("peer", "device", "state", "work", "tokens/s", "tokens")
    for p in s["peers"]:
        peers.add_row(p["peer_id"] if full_ids else short_id(p["peer_id"]), p["device"], p["state"], p["work"], f"{p['tokens_per_s']:.0f}", str(p["tokens"]))
    console.print(peers)
    modules = Table("module", "holders", "round")
    for m in s["modules"]:
        modules.add_row(m["module_id"], str(len(m["holders"])), str(m["round"]))
    console.print(modules)


def _serve(args: argparse.Namespace) -> int:
    from coordinator.server import ServeOptions, run_server
    from coordinator.settings import load_run_and_settings, pin_dataset

    run_cfg, settings = load_run_and_settings(args.run_config)
    run_cfg = pin_dataset(run_cfg, args.data)
    opts = ServeOptions(
        db=args.db, port=_port(args.port, "port"), http_port=_port(args.http_port, "http-port"),
        token=read_token(args.token, args.token_file), host=args.host, tls_cert=args.tls_cert, tls_key=args.tls_key,
        key=args.key,
    )
    return run_server(run_cfg, settings, opts)
