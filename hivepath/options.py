"""Flags and flag handling that several commands share: the run token and the network flags.

- :func:`add_token_flags` and :func:`read_token`: ``--token`` and ``--token-file``, with one
  precedence in every command (``peer join``, ``archive``, ``coordinator serve`` and the operator
  commands): ``--token``, then ``--token-file``, then ``HIVEPATH_TOKEN``, then ``HIVEPATH_TOKEN_FILE``.
  A flag on the command line beats a variable, as everywhere else.
- :func:`add_network_flags` and :func:`network_options`: how a long-running peer process (``peer
  join``, ``archive``) reaches the coordinator and the DHT, and its local status page; the options
  become a :class:`peer.node.startup.NetworkOptions`.

Each flag's default comes from its ``HIVEPATH_*`` variable (:mod:`hivepath.settings`). Imports
nothing heavy: building the parser runs this.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Mapping, Optional

from hivepath.paths import certificate, key_file, text_file
from hivepath.settings import add_flag, is_set, setting
from models.errors import HivepathError
from models.settings import COORDINATOR_PORT, check_address

__all__ = ["add_token_flags", "read_token", "add_network_flags", "network_options"]

_TOKEN_ORDER = "--token, then --token-file, then HIVEPATH_TOKEN, then HIVEPATH_TOKEN_FILE"


def add_token_flags(p: argparse.ArgumentParser) -> None:
    """``--token`` and ``--token-file``; no variable is their default: :func:`read_token` reads the
    variables after both flags."""
    p.add_argument("--token", help=f"the run token (shows in ps: prefer a file or a variable; read {_TOKEN_ORDER})")
    p.add_argument("--token-file", type=text_file(), metavar="FILE",
                   help="read the run token from FILE (HIVEPATH_TOKEN_FILE names one too; see --token for the order)")


def _token_from_file(path: str, source: str) -> str:
    file = Path(path).expanduser()
    problem = text_file().problem(file)  # the --token-file flag's check, for HIVEPATH_TOKEN_FILE too
    if problem:
        raise HivepathError(f"token file {file} ({source}) {problem}; pass a UTF-8 text file holding the run token")
    text = file.read_text(encoding="utf-8").strip()
    if not text:
        raise HivepathError(f"token file {file} ({source}) is empty; write the run token into it")
    return text


def read_token(token: Optional[str], token_file: Optional[str], environ: Optional[Mapping[str, str]] = None) -> str:
    """The run token: ``token`` (``--token``), else the file ``token_file`` (``--token-file``), else
    ``HIVEPATH_TOKEN``, else the file ``HIVEPATH_TOKEN_FILE`` names (``environ``: default ``os.environ``).

    The first source given is the one used: an empty or unreadable token file is an error naming
    the file, not a reason to look further.
    """
    if token and token.strip():
        return token.strip()
    if token_file:
        return _token_from_file(token_file, "--token-file")
    from_env = setting("HIVEPATH_TOKEN").read(environ)
    if from_env:
        return from_env
    env_file = setting("HIVEPATH_TOKEN_FILE").read(environ)
    if env_file:
        return _token_from_file(env_file, "HIVEPATH_TOKEN_FILE")
    raise HivepathError("no run token: pass --token or --token-file, or set HIVEPATH_TOKEN or HIVEPATH_TOKEN_FILE")


def add_network_flags(p: argparse.ArgumentParser) -> None:
    """The flags every long-running peer process shares (``peer join``, ``archive``): how it reaches
    the coordinator and the DHT, and its local status page. Each reads its ``HIVEPATH_*`` variable."""
    add_flag(p, "HIVEPATH_COORDINATOR", help=f"the coordinator's gRPC address, PORT {COORDINATOR_PORT} if left out; "
             "required")
    add_token_flags(p)
    add_flag(p, "HIVEPATH_INITIAL_PEERS")
    add_flag(p, "HIVEPATH_IDENTITY", type=key_file(lock=True, parent_exists=False))
    add_flag(p, "HIVEPATH_HOST_MADDRS")
    add_flag(p, "HIVEPATH_ANNOUNCE_MADDRS")
    add_flag(p, "HIVEPATH_LANE_PORT")
    add_flag(p, "HIVEPATH_TLS_CA", type=certificate())
    add_flag(p, "HIVEPATH_STATUS_PORT")
    add_flag(p, "HIVEPATH_STALL_TIMEOUT")
    add_flag(p, "HIVEPATH_COORDINATOR_TIMEOUT", action=_WaitAsked)
    p.set_defaults(coordinator_wait=is_set("HIVEPATH_COORDINATOR_TIMEOUT"))


class _WaitAsked(argparse.Action):
    """``--coordinator-timeout`` given: wait that long even where nothing answers yet (a coordinator
    being started beside this process) instead of giving up after 10 s."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: Optional[str] = None) -> None:
        setattr(namespace, self.dest, values)
        namespace.coordinator_wait = True


def network_options(args: argparse.Namespace, **extra: Any):
    """The :class:`peer.node.startup.NetworkOptions` of parsed :func:`add_network_flags` flags, the
    token read by :func:`read_token`; ``extra``: fields only some commands have flags for. The address
    and the token are checked before the peer package (torch, hivemind: seconds of CPU) is imported."""
    if not args.coordinator:
        raise HivepathError("no coordinator address: pass --coordinator HOST:PORT or set HIVEPATH_COORDINATOR")
    check_address(args.coordinator)
    token = read_token(args.token, args.token_file)
    from peer.node.startup import NetworkOptions

    return NetworkOptions(
        coordinator=args.coordinator,
        token=token,
        initial_peers=tuple(args.initial_peers),
        identity=Path(args.identity).expanduser() if args.identity else None,
        host_maddrs=tuple(args.host_maddrs),
        announce_maddrs=tuple(args.announce_maddrs),
        lane_port=args.lane_port,
        tls_ca=args.tls_ca,
        status_port=args.status_port,
        stall_timeout=args.stall_timeout,
        coordinator_timeout=args.coordinator_timeout,
        coordinator_wait=args.coordinator_wait,
        **extra,
    )
