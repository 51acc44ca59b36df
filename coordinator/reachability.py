"""Can others dial a joining peer? The coordinator dials its announced addresses back, at join.

A volunteer behind a home router or a firewall announces addresses nobody outside can reach (its
private address, a port the router does not forward). Left undetected it joins, reports itself
healthy, and averages with nobody. At join the coordinator opens a plain TCP connection to each
announced ``/ip4/.../tcp/N`` or ``/ip6/.../tcp/N`` address (a few at once, within
:data:`DIAL_TIMEOUT`), closes it at once, and records the verdict:

- ``reachable``: one accepted (``addr`` says which, in announce order);
- ``unreachable``: none did (refused, no route, or silent past the timeout);
- ``not_listening``: the peer announced no address (``--client-mode``): nobody can dial it.

Loopback addresses are dialled only when the join itself came from loopback (peer and coordinator on
one host): dialled from elsewhere they would reach the coordinator's own host. The coordinator opens
connections only to the addresses an admitted peer (the run token checked) announces, at most
:data:`MAX_DIALS` per join, so it is no open port scanner. A TCP connect is not a libp2p handshake,
but what NAT breaks is the connect.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
from dataclasses import dataclass
from typing import Optional, Sequence

__all__ = ["Reachability", "dial_back", "tcp_target", "observed_host", "REACHABLE", "UNREACHABLE",
           "NOT_LISTENING", "UNKNOWN", "STATES"]

log = logging.getLogger(__name__)

REACHABLE, UNREACHABLE, NOT_LISTENING, UNKNOWN = "reachable", "unreachable", "not_listening", "unknown"
STATES = (REACHABLE, UNREACHABLE, NOT_LISTENING, UNKNOWN)
"""Every verdict; ``unknown`` for a peer recorded before the coordinator dialled back (an old store)."""

DIAL_TIMEOUT = 2.0
"""Seconds the dial-back of one join may take in all."""
MAX_DIALS = 8
"""Announced addresses dialled per join at most (the first ones, in announce order)."""


@dataclass(frozen=True)
class Reachability:
    """The coordinator's verdict on one peer at its latest join."""

    state: str = UNKNOWN
    addr: str = ""
    """The announced multiaddr that accepted the dial (``reachable`` only)."""
    observed: str = ""
    """The address the join came from, as the coordinator saw it (a NATed peer's public address)."""


def tcp_target(maddr: str) -> Optional[tuple[str, int]]:
    """``(host, port)`` of a ``/ip4|ip6/HOST/tcp/PORT[/...]`` multiaddr; None for anything else
    (a relay circuit, DNS, UDP, an unspecified host or port 0)."""
    parts = maddr.split("/")
    if len(parts) < 5 or parts[0] != "" or parts[1] not in ("ip4", "ip6") or parts[3] != "tcp":
        return None
    if "p2p-circuit" in parts:
        return None
    try:
        host = ipaddress.ip_address(parts[2])
        port = int(parts[4])
    except ValueError:
        return None
    if host.is_unspecified or not 0 < port < 65536:
        return None
    return str(host), port


def observed_host(grpc_peer: str) -> str:
    """The host of grpc's ``context.peer()`` (``ipv4:1.2.3.4:5``, ``ipv6:[::1]:5``); '' if none."""
    kind, _, rest = grpc_peer.partition(":")
    if kind == "ipv4":
        return rest.rsplit(":", 1)[0]
    if kind == "ipv6":
        return rest.rsplit(":", 1)[0].strip("[]").split("%")[0]
    return ""


async def _accepts(host: str, port: int, timeout: float) -> bool:
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except (OSError, asyncio.TimeoutError):
        return False
    writer.close()
    with contextlib.suppress(Exception):
        await asyncio.wait_for(writer.wait_closed(), 1.0)
    return True


async def dial_back(maddrs: Sequence[str], observed: str = "", timeout: float = DIAL_TIMEOUT) -> Reachability:
    """The verdict on a peer announcing ``maddrs`` whose join came from ``observed`` (see the module)."""
    from_loopback = _is_loopback(observed)
    targets = []
    for maddr in maddrs:
        target = tcp_target(maddr)
        if target is None or (_is_loopback(target[0]) and not from_loopback):
            continue
        targets.append((maddr, target))
        if len(targets) >= MAX_DIALS:
            break
    if not maddrs:
        return Reachability(NOT_LISTENING, "", observed)
    if not targets:
        return Reachability(UNREACHABLE, "", observed)
    accepted = await asyncio.gather(*(_accepts(h, p, timeout) for _, (h, p) in targets))
    for (maddr, _), ok in zip(targets, accepted):
        if ok:
            return Reachability(REACHABLE, maddr, observed)
    return Reachability(UNREACHABLE, "", observed)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
