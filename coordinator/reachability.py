"""Can others dial a joining peer? The coordinator dials its announced addresses back, at join.

A volunteer behind a home router or a firewall announces addresses nobody outside can reach (its
private address, a port the router does not forward). Left undetected it joins, reports itself
healthy, and averages with nobody. At join the coordinator opens a plain TCP connection to each
announced ``/ip4/.../tcp/N`` or ``/ip6/.../tcp/N`` address (a few at once, within
:data:`DIAL_TIMEOUT`), closes it at once, and records the verdict:

- ``reachable``: one accepted (``addr`` says which, in announce order);
- ``relayed``: none did, but the peer announced relay circuits (``.../p2p/RELAY/p2p-circuit``) and a
  circuit's relay accepted (``addr`` says which circuit): peers reach it through that relay;
- ``unreachable``: none did (refused, no route, or silent past the timeout);
- ``not_listening``: the peer announced no address (``--client-mode``): nobody can dial it.

An unreachable peer is handed relays in its join reply (reachable peers, the least loaded first:
:func:`relay_load`), reserves a slot on them and joins again announcing the circuits.

Loopback addresses are dialled only when the join itself came from loopback (peer and coordinator on
one host): dialled from elsewhere they would reach the coordinator's own host. The coordinator opens
connections only to the addresses an admitted peer (the run token checked) announces, at most
:data:`MAX_DIALS` per join, so it is no open port scanner. A TCP connect is not a libp2p handshake,
but what NAT breaks is the connect.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from dataclasses import dataclass
from typing import Sequence

from models.tcp import relay_of, tcp_accepts, tcp_target

__all__ = ["Reachability", "dial_back", "tcp_target", "observed_host", "relay_of", "relay_load", "dialable",
           "RELAYS_PER_PEER",
           "REACHABLE", "RELAYED", "UNREACHABLE", "NOT_LISTENING", "UNKNOWN", "STATES"]

log = logging.getLogger(__name__)

REACHABLE, RELAYED, UNREACHABLE = "reachable", "relayed", "unreachable"
NOT_LISTENING, UNKNOWN = "not_listening", "unknown"
STATES = (REACHABLE, RELAYED, UNREACHABLE, NOT_LISTENING, UNKNOWN)
"""Every verdict; ``unknown`` for a peer recorded before the coordinator dialled back (an old store)."""

DIAL_TIMEOUT = 2.0
"""Seconds the dial-back of one join may take in all."""
MAX_DIALS = 8
"""Announced addresses dialled per join at most (the first ones, in announce order)."""
RELAYS_PER_PEER = 2
"""Relays handed to an unreachable peer: two, so that one leaving does not cut it off."""


@dataclass(frozen=True)
class Reachability:
    """The coordinator's verdict on one peer at its latest join."""

    state: str = UNKNOWN
    addr: str = ""
    """The announced multiaddr that accepted the dial (``reachable``), or the circuit (``relayed``)."""
    observed: str = ""
    """The address the join came from, as the coordinator saw it (a NATed peer's public address)."""


def relay_load(reachable_addrs: Sequence[str]) -> dict[str, int]:
    """How many peers each relay carries: peer id -> count, from the circuits that relayed peers were
    found reachable through (their recorded ``reachable_addr``)."""
    load: dict[str, int] = {}
    for addr in reachable_addrs:
        found = relay_of(addr)
        if found is not None:
            load[found[1]] = load.get(found[1], 0) + 1
    return load


def dialable(state: str) -> bool:
    """Whether a peer in ``state`` may be handed out to be dialled directly (a bootstrap peer, a relay)."""
    return state not in (UNREACHABLE, RELAYED)


def observed_host(grpc_peer: str) -> str:
    """The host of grpc's ``context.peer()`` (``ipv4:1.2.3.4:5``, ``ipv6:[::1]:5``); '' if none."""
    kind, _, rest = grpc_peer.partition(":")
    if kind == "ipv4":
        return rest.rsplit(":", 1)[0]
    if kind == "ipv6":
        return rest.rsplit(":", 1)[0].strip("[]").split("%")[0]
    return ""


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
    circuits = []
    for maddr in maddrs:
        found = relay_of(maddr)
        target = tcp_target(found[0]) if found else None
        if target is not None and (from_loopback or not _is_loopback(target[0])) and len(circuits) < MAX_DIALS:
            circuits.append((maddr, target))
    if not maddrs:
        return Reachability(NOT_LISTENING, "", observed)
    if not targets and not circuits:
        return Reachability(UNREACHABLE, "", observed)
    accepted = await asyncio.gather(*(tcp_accepts(h, p, timeout) for _, (h, p) in targets + circuits))
    for i, ((maddr, _), ok) in enumerate(zip(targets + circuits, accepted)):
        if ok:
            return Reachability(REACHABLE if i < len(targets) else RELAYED, maddr, observed)
    return Reachability(UNREACHABLE, "", observed)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
