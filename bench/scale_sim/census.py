"""A design for control traffic per peer that does not grow with the swarm, modelled in the simulator
only (``SimConfig.census``): the peers' code still reads a module's whole holders key.

Three reads of a split round in the peers' code grow with the module's holders N: the count of the holders (one
read of the holders key, for :func:`peer.network.records.split_levels`), the matchmaking polls of the
holders key (who of the bucket is at this round), and the pacing polls of the module's group key,
where every member that computed its whole round declares. The design replaces each:

1. **A census by sample.** A holder writes its record under the census keys of levels 0 .. ``tz``
   (:func:`census_key`), ``tz`` the trailing zero bits of a hash of (module, peer) that does not change
   between rounds (:func:`census_depth`): level s holds about N / 2^s holders, level s + 1 a subset of
   level s. Every reader takes the smallest level of at most :func:`census_bound` entries
   (:func:`census_level`: it reads that level and the one below) and estimates N as its entries times
   2^s (:func:`census_estimate`). Everyone reads the same keys, so every holder's count is the same
   (as the whole key's count is in the peers' code, up to the DHT's staleness); a reader reads at most about three
   times the bound. A writer writes only the levels from two below the one it last read, about two
   records a round.
2. **Bucket holder keys.** A holder writes its record for round r under its bucket's holders key of
   that round (:func:`bucket_holders_key`, the bucket of the census's count), and a member's
   matchmaking polls read only its bucket's key (about ``max_group_size`` entries).
3. **Few pacers.** A member that computed its whole round declares under the module's group key only
   while fewer than :data:`PACERS` declarations are there (it reads the key first): the pacing polls of
   every holder read at most that many.

What stays: the bucket's own group key, the keys of the groups of delegates and of the top group
(each at most ``max_group_size`` entries), and the one read of the top group's key for the digest of
the average a member checks.
"""

from __future__ import annotations

import hashlib
from typing import Callable

__all__ = ["PACERS", "census_key", "bucket_holders_key", "census_depth", "census_bound", "census_level",
           "census_estimate"]

PACERS = 4
"""Most full-round declarations under a module's group key in a split round (pacing needs one)."""
MAX_LEVEL = 40


def census_key(run_id: str, module_id: str, level: int) -> str:
    """The census key of ``level`` (holders whose :func:`census_depth` is at least ``level``)."""
    return f"{run_id}_{module_id}_census{level}"


def bucket_holders_key(run_id: str, module_id: str, round_no: int, bucket: int) -> str:
    """The holders of ``module_id`` at ``round_no`` in ``bucket`` of that round."""
    return f"{run_id}_{module_id}_r{round_no}_b{bucket}_holders"


def census_depth(module_id: str, peer_id: str) -> int:
    """The last census level ``peer_id`` writes for ``module_id``: the trailing zero bits of a hash of
    both (level s holds about 1 / 2^s of the holders)."""
    h = int.from_bytes(hashlib.blake2b(f"{module_id}/{peer_id}".encode(), digest_size=8).digest(), "big")
    return min(MAX_LEVEL, (h & -h).bit_length() - 1) if h else MAX_LEVEL


def census_bound(max_group_size: int) -> int:
    """Most entries a census level read for the count has: twice the cap (an estimate from at least
    ``max_group_size`` entries, to within about an eighth at the cap's 64)."""
    return 2 * max(1, max_group_size)


def census_level(count: Callable[[int], int], bound: int, start: int = 0) -> int:
    """The smallest level whose census holds at most ``bound`` entries, searched from ``start`` (the
    level read last): ``count(s)`` is the entries of level s (non-increasing in s)."""
    s = max(0, min(MAX_LEVEL, start))
    while s < MAX_LEVEL and count(s) > bound:
        s += 1
    while s > 0 and count(s - 1) <= bound:
        s -= 1
    return s


def census_estimate(entries: int, level: int) -> int:
    """The holders a census level's ``entries`` stand for."""
    return entries << level
