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
    at once (nothing is sent). ``again_every``: a fresh attempt starts every so many seconds beside
    the ones under way, until one opens or ``timeout``. A connection whose SYN was lost waits a whole
    second (the kernel's first retransmission) before it tries again: probing a link that is coming
    back (a healed cut), the answer comes within ``again_every`` of the heal, not a second or more
    later."""
    async def once() -> bool:
        try:
            _, writer = await asyncio.open_connection(host, port)
        except OSError:
            return False
        writer.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(writer.wait_closed(), 1.0)
        return True

    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    attempts: set[asyncio.Future] = set()
    try:
        while True:
            attempts.add(asyncio.ensure_future(once()))
            next_attempt = end if again_every is None else min(end, loop.time() + again_every)
            while attempts and loop.time() < next_attempt:
                done, attempts = await asyncio.wait(attempts, timeout=next_attempt - loop.time(),
                                                    return_when=asyncio.FIRST_COMPLETED)
                if any(t.result() for t in done):
                    return True
            if loop.time() >= end or again_every is None:
                return False
            if not attempts:  # refused at once: the next attempt when it is due
                await asyncio.sleep(max(0.0, next_attempt - loop.time()))
    finally:
        for t in attempts:
            t.cancel()


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
