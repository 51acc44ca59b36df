"""Who volunteers: devices, memory, links, NAT and how long each peer stays, drawn from one seed.

These are models (inputs), not measurements: the shares and ranges below are the benchmark's targets (uplinks
10-100 Mbit/s, a share behind NAT, GPUs and CPUs of different speeds, 10% of peers leaving per hour)
and round numbers for the rest, stated in ``docs/BENCHMARKS.md``."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

__all__ = ["PeerSpec", "DEVICES", "draw_peer", "draw_peers", "peer_id", "LEAVE_KINDS"]

DEVICES = (
    # (name, share, tokens/s range on the simulated model, memory bytes range)
    ("gpu-datacenter", 0.10, (40_000.0, 80_000.0), (40 << 30, 80 << 30)),
    ("gpu-consumer", 0.45, (8_000.0, 30_000.0), (8 << 30, 24 << 30)),
    ("cpu", 0.42, (400.0, 2_000.0), (4 << 30, 32 << 30)),
    ("small", 0.02, (300.0, 800.0), (120 << 20, 200 << 20)),  # fits one module, not a path: stage mode
    ("tiny", 0.01, (100.0, 200.0), (8 << 20, 16 << 20)),  # fits nothing: refused with a reason
)
"""Device classes with their share of volunteers."""

NAT_SHARE = 0.3
"""Share of peers that cannot accept connections (client mode, relayed)."""

LEAVE_KINDS = (("preempt", 0.5), ("kill", 0.3), ("leave", 0.2))
"""How a leaving peer goes: spot preemption with notice, killed without a word, or a clean leave."""

PREEMPT_NOTICE = 120.0
"""Seconds between a spot preemption notice and the machine going away (AWS gives two minutes)."""

_ALPHABET = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"


def peer_id(i: int) -> str:
    """A base58 peer id (as :func:`peer.network.records.is_peer_id` accepts) unique to ``i``."""
    s = ""
    for _ in range(10):
        i, r = divmod(i, 58)
        s += _ALPHABET[r]
    return "12D3KooWsim" + s


@dataclass(frozen=True)
class PeerSpec:
    """One simulated volunteer."""

    index: int
    peer_id: str
    device: str
    tokens_per_s: float
    memory_bytes: int
    upload_bps: float
    """Bytes/s."""
    download_bps: float
    natted: bool
    arrival: float
    """Simulated second it joins."""
    lifetime: float
    """Seconds it stays (exponential: a constant share leaves per hour)."""
    leave_kind: str


def draw_peer(rng: random.Random, index: int, arrival: float, leave_per_hour: float) -> PeerSpec:
    r, acc = rng.random(), 0.0
    for name, share, tps, mem in DEVICES:
        acc += share
        if r < acc:
            break
    up_mbit = math.exp(rng.uniform(math.log(10.0), math.log(100.0)))
    down_mbit = up_mbit * rng.uniform(2.0, 5.0)
    lifetime = rng.expovariate(leave_per_hour / 3600.0) if leave_per_hour > 0 else math.inf
    k, acc = rng.random(), 0.0
    for kind, share in LEAVE_KINDS:
        acc += share
        if k < acc:
            break
    return PeerSpec(
        index=index, peer_id=peer_id(index), device=name, tokens_per_s=rng.uniform(*tps),
        memory_bytes=rng.randint(*mem), upload_bps=up_mbit * 1e6 / 8, download_bps=down_mbit * 1e6 / 8,
        natted=rng.random() < NAT_SHARE, arrival=arrival, lifetime=lifetime, leave_kind=kind,
    )


def draw_peers(rng: random.Random, n: int, ramp: float, leave_per_hour: float) -> list[PeerSpec]:
    """``n`` peers arriving uniformly over the first ``ramp`` seconds."""
    return [draw_peer(rng, i, rng.uniform(0.0, ramp), leave_per_hour) for i in range(n)]
