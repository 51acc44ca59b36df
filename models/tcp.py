"""Whether a TCP port accepts connections: the one plain-socket probe shared by the coordinator (is a
joining peer reachable?) and the peer (is a peer back after a cut, before libp2p dials it?)."""

from __future__ import annotations

import asyncio
import contextlib

__all__ = ["tcp_accepts"]


async def tcp_accepts(host: str, port: int, timeout: float) -> bool:
    """Whether a plain TCP connection to ``host:port`` opens within ``timeout`` seconds; it is closed
    at once (nothing is sent)."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except (OSError, asyncio.TimeoutError):
        return False
    writer.close()
    with contextlib.suppress(Exception):
        await asyncio.wait_for(writer.wait_closed(), 1.0)
    return True
