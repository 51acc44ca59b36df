"""How a group splits a module's flat vector for the all-reduce (:mod:`peer.averaging.allreduce`).

Everything here is a pure function of the group, identical on every member: the pipeline segments
of the vector, each member's part of a segment (block-aligned, sized by upload bandwidth), and the
fallback reducer of a failed part. Boundaries are multiples of :data:`models.codec_spec.BLOCK`, so
encoding a part gives the same values as encoding the whole vector.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from models.codec_spec import BLOCK

__all__ = ["Group", "part_bounds", "segment_bounds", "relayed_segment_bounds", "fallback_reducer", "SEGMENT_BLOCKS",
           "MAX_SEGMENTS", "RELAY_PIECE_BYTES"]


def part_bounds(numel: int, bandwidths: Sequence[float]) -> list[tuple[int, int]]:
    """Split ``numel`` elements into one ``(start, end)`` part per member, proportional to bandwidth,
    with every boundary a multiple of ``BLOCK`` (the last end is ``numel``). Members with bandwidth
    0 get empty parts; if every bandwidth is 0 the first member takes everything."""
    n_blocks = math.ceil(numel / BLOCK)
    bw = [max(0.0, float(b)) if math.isfinite(b) else 0.0 for b in bandwidths]
    if not bw:
        raise ValueError("a group has at least one member")
    if sum(bw) <= 0:
        bw = [1.0] + [0.0] * (len(bw) - 1)
    total = sum(bw)
    shares = [b / total * n_blocks for b in bw]
    counts = [int(s) for s in shares]
    # largest remainder, ties to the lower index: the same on every member
    order = sorted(range(len(bw)), key=lambda i: (-(shares[i] - counts[i]), i))
    for i in order[: n_blocks - sum(counts)]:
        counts[i] += 1
    bounds, start = [], 0
    for c in counts:
        end = min(numel, start + c * BLOCK)
        bounds.append((start, end))
        start = end
    return bounds


SEGMENT_BLOCKS = 256
"""Smallest segment, in blocks; a vector is cut into at most :data:`MAX_SEGMENTS` of at least this size."""
MAX_SEGMENTS = 4
"""Most segments of a vector. Each segment opens one stream per pair of members through the p2p
daemons, which costs a fixed amount of CPU per stream: with the all-reduce's segment-after-segment
sending, more segments than 4 gave no better link efficiency and cost the event-loop thread more CPU
(measured by ``bench.comm``'s ``cpu_s_per_mb``)."""


def segment_bounds(numel: int, max_segments: int = MAX_SEGMENTS,
                   min_blocks: int = SEGMENT_BLOCKS) -> list[tuple[int, int]]:
    """Cut ``numel`` elements into pipeline segments at multiples of ``BLOCK`` (at least one), each of at
    least ``min_blocks`` blocks."""
    n_blocks = max(1, math.ceil(numel / BLOCK))
    per = max(min_blocks, math.ceil(n_blocks / max_segments))
    starts = list(range(0, n_blocks, per))
    return [(s * BLOCK, min(numel, (s + per) * BLOCK)) for s in starts] or [(0, 0)]


RELAY_PIECE_BYTES = 32 * 1024
"""Most encoded bytes of one part that crosses a relay. A relay between private addresses resets a
relayed connection after 128 KiB each way (``peer.network.relays``); a contribution and an average
of this size each way, in flight at once, leave room for a second one before the reset, and a part
cut by it is sent again whole."""


def relayed_segment_bounds(numel: int, group: "Group", encoded_size: Callable[[int], int],
                           piece_bytes: int = RELAY_PIECE_BYTES) -> list[tuple[int, int]]:
    """The segments of a group in which two members are dialled through relays: as few as keep every
    part a relayed member reduces within ``piece_bytes`` encoded (``encoded_size(numel)``), down to one
    block a part. Pure, as :func:`segment_bounds`."""
    def fits(segments: list[tuple[int, int]]) -> bool:
        largest = max((b - a for s0, s1 in segments
                       for i, (a, b) in enumerate(part_bounds(s1 - s0, group.bandwidths)) if group.relayed[i]),
                      default=0)
        return encoded_size(largest) <= piece_bytes

    n_blocks = max(1, math.ceil(numel / BLOCK))
    segments = segment_bounds(numel)  # the usual cut when its parts fit already
    k = len(segments)
    while not fits(segments) and len(segments) < n_blocks:
        k *= 2
        segments = segment_bounds(numel, k, min_blocks=1)
    return segments


def fallback_reducer(failed: int, bounds: Sequence[tuple[int, int]]) -> Optional[int]:
    """Index of the member that retries part ``failed``: the first other member with a non-empty part."""
    for i, (a, b) in enumerate(bounds):
        if i != failed and b > a:
            return i
    return None


@dataclass(frozen=True)
class Group:
    """A formed averaging group: the same on every member (the leader sent it)."""

    group_id: str
    members: tuple[str, ...]
    """Peer ids, sorted; member i reduces part i."""
    bandwidths: tuple[float, ...]
    allreduce_timeout: float
    """Seconds the reduction may take, counted from when the member got the group."""
    relayed: tuple[bool, ...] = ()
    """Per member, whether it can be dialled only through a circuit relay (empty: none can)."""
    weights: tuple[float, ...] = ()
    """Per member, the tokens behind its contribution as it said when joining (empty: not said); a
    bucket's delegate sums its contributors' for the top group (:mod:`peer.averaging.hierarchy`)."""

    def relayed_pairs(self) -> bool:
        """Whether two members that can be dialled only through relays are in the group (their parts
        cross a relay, which resets a connection after 128 KiB: ``peer.network.relays``)."""
        return sum(1 for r in self.relayed if r) >= 2

    def relayed_between(self, i: int, j: int) -> bool:
        """Whether what members ``i`` and ``j`` send each other crosses a relay (both are relayed)."""
        return bool(self.relayed) and self.relayed[i] and self.relayed[j]
