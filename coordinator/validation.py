"""Checks on every field a peer sends, before anything reaches the coordinator's state.

Each check raises :class:`coordinator.errors.InvalidArgument` naming the field, so the peer gets
INVALID_ARGUMENT with a message it can act on. Numbers must be finite and in range; strings have
length limits; multiaddrs are parsed (the coordinator does not import the multiaddr library).
"""

from __future__ import annotations

import ipaddress
import math
import re
from typing import Iterable, Sequence

from coordinator.errors import InvalidArgument
from coordinator.records import Capabilities

__all__ = [
    "MAX_STRING",
    "MAX_MULTIADDRS",
    "MAX_PROGRESS",
    "MAX_PUBLIC_KEY",
    "MAX_MEMORY",
    "MAX_RATE",
    "check_unique",
    "check_peer_id",
    "check_lease_id",
    "check_text",
    "check_multiaddr",
    "check_capabilities",
    "check_number",
    "MAX_OVERHEAD_S",
]

MAX_STRING = 256
MAX_MULTIADDRS = 16
MAX_PROGRESS = 256
MAX_PUBLIC_KEY = 2048
MAX_MEMORY = 1 << 50
"""1 PiB: larger memory is a bug in the peer's measurement."""
MAX_RATE = 1e12
"""Tokens/s and bytes/s above this are not credible."""
MAX_OVERHEAD_S = 86400.0
"""A day: a round's exchange overhead above this is not credible."""

_PEER_ID_RE = re.compile(r"^[1-9A-HJ-NP-Za-km-z]{16,128}$")
_LEASE_RE = re.compile(r"^[0-9a-f]{32}$")
# protocol -> kind of value: None (no value), "ip4", "ip6", "port", "name", "peer"
_PROTOCOLS = {
    "ip4": "ip4", "ip6": "ip6", "dns": "name", "dns4": "name", "dns6": "name", "dnsaddr": "name",
    "tcp": "port", "udp": "port", "quic": None, "quic-v1": None, "ws": None, "wss": None, "tls": None,
    "noise": None, "webtransport": None, "p2p": "peer", "ipfs": "peer", "p2p-circuit": None,
}


def check_text(field: str, value: str, max_len: int = MAX_STRING, allow_empty: bool = True) -> str:
    if not allow_empty and not value:
        raise InvalidArgument(field, "is required")
    if len(value) > max_len:
        raise InvalidArgument(field, f"is {len(value)} characters, the limit is {max_len}")
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise InvalidArgument(field, "contains control characters")
    return value


def check_peer_id(value: str, field: str = "peer_id") -> str:
    """A base58 libp2p peer id such as ``12D3KooW...`` or ``Qm...``."""
    if not value:
        raise InvalidArgument(field, "is required (the peer's libp2p id, base58)")
    if not _PEER_ID_RE.match(value):
        raise InvalidArgument(field, f"{value[:64]!r} is not a base58 libp2p peer id (16-128 characters)")
    return value


def check_lease_id(value: str) -> str:
    if not _LEASE_RE.match(value):
        raise InvalidArgument("lease_id", "is not a lease id from a Join reply (32 hex digits); join again")
    return value


def check_number(field: str, value: float, lo: float, hi: float, allow_zero: bool = True) -> float:
    if not math.isfinite(value):
        raise InvalidArgument(field, f"must be a finite number, got {value}")
    if value < lo or value > hi or (value == 0 and not allow_zero):
        raise InvalidArgument(field, f"{value} is out of range ({'0' if allow_zero else '>0'} .. {hi:g})")
    return value


def check_multiaddr(value: str, field: str = "capabilities.multiaddrs") -> str:
    """A libp2p multiaddr such as ``/ip4/1.2.3.4/tcp/31337/p2p/12D3KooW...``."""
    check_text(field, value)
    parts = value.split("/")
    if len(parts) < 3 or parts[0] != "":
        raise InvalidArgument(field, f"{value!r} is not a multiaddr like /ip4/1.2.3.4/tcp/31337")
    i, parts = 0, parts[1:]
    while i < len(parts):
        proto = parts[i]
        if proto not in _PROTOCOLS:
            raise InvalidArgument(field, f"{value!r}: unknown protocol {proto!r}")
        kind = _PROTOCOLS[proto]
        if kind is None:
            i += 1
            continue
        if i + 1 >= len(parts) or not parts[i + 1]:
            raise InvalidArgument(field, f"{value!r}: /{proto} needs a value")
        arg = parts[i + 1]
        try:
            if kind == "ip4":
                ipaddress.IPv4Address(arg)
            elif kind == "ip6":
                ipaddress.IPv6Address(arg)
            elif kind == "port":
                if not arg.isdigit() or int(arg) > 65535:
                    raise ValueError
            elif kind == "name":
                if not re.fullmatch(r"[A-Za-z0-9.-]{1,253}", arg):
                    raise ValueError
            elif kind == "peer":
                check_peer_id(arg, field)
        except ValueError:
            raise InvalidArgument(field, f"{value!r}: {arg!r} is not a valid /{proto} value") from None
        i += 2
    return value


def check_capabilities(
    device: str, memory_bytes: int, tokens_per_s: float, upload_bps: float, download_bps: float,
    multiaddrs: Sequence[str], trains: bool = True,
) -> Capabilities:
    """Validated :class:`Capabilities`, or InvalidArgument naming the first bad field. A peer that
    ``trains`` must report memory and throughput; an archive peer may report zero."""
    check_text("capabilities.device", device, 64, allow_empty=False)
    if memory_bytes < (1 if trains else 0) or memory_bytes > MAX_MEMORY:
        raise InvalidArgument("capabilities.memory_bytes", f"{memory_bytes} is out of range (1 .. {MAX_MEMORY})")
    check_number("capabilities.tokens_per_s", tokens_per_s, 0.0, MAX_RATE, allow_zero=not trains)
    check_number("capabilities.upload_bps", upload_bps, 0.0, MAX_RATE)
    check_number("capabilities.download_bps", download_bps, 0.0, MAX_RATE)
    if len(multiaddrs) > MAX_MULTIADDRS:
        raise InvalidArgument("capabilities.multiaddrs", f"{len(multiaddrs)} given, the limit is {MAX_MULTIADDRS}")
    for addr in multiaddrs:
        check_multiaddr(addr)
    return Capabilities(device, int(memory_bytes), float(tokens_per_s), float(upload_bps), float(download_bps),
                        tuple(multiaddrs))


def check_unique(field: str, values: Iterable[str]) -> None:
    seen: set[str] = set()
    for v in values:
        if v in seen:
            raise InvalidArgument(field, f"{v!r} appears twice")
        seen.add(v)

