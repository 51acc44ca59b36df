"""Whether a TCP port accepts connections: the one plain-socket probe shared by the coordinator (is a
joining peer reachable?) and the peer (is a peer back after a cut, before libp2p dials it?), and the
multiaddr parsing that finds the port to probe."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
from typing import Optional

__all__ = ["relay_of", "tcp_accepts", "tcp_target"]


async def tcp_accepts(host: str, port: int, timeout: float, again_every: Optional[float] = None) -> bool:
    """Whether a plain TCP connection to ``host:port`` opens within ``timeout`` seconds; it is closed
    at once (nothing is sent). ``again_every``: an attempt that has not opened after so many seconds
    is dropped for a fresh one, until one opens or ``timeout``. A connection whose SYN was lost waits a whole
    second (the kernel's first retransmission) before it tries again: probing a link that is coming
    back (a healed cut), the answer comes within ``again_every`` of the heal, not a second or more
    later."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while True:
        step_end = end if again_every is None else min(end, loop.time() + again_every)
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), max(0.0, step_end - loop.time()))
        except (OSError, asyncio.TimeoutError):
            if again_every is None or loop.time() >= end:
                return False
            await asyncio.sleep(max(0.0, step_end - loop.time()))  # refused at once: the next attempt when due
            continue
        writer.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(writer.wait_closed(), 1.0)
        return True


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


def relay_of(maddr: str) -> Optional[tuple[str, str]]:
    """``(relay transport multiaddr, relay peer id)`` of a circuit ``.../p2p/RELAY/p2p-circuit[/p2p/ME]``;
    None for anything else."""
    head, sep, _ = maddr.partition("/p2p-circuit")
    transport, p2p, relay = head.rpartition("/p2p/")
    if not sep or not p2p or not relay or "/" in relay or not transport:
        return None
    return transport, relay
