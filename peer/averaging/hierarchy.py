"""Split rounds: a module held by more peers than ``outer.max_group_size`` averages in levels of groups,
none larger than the cap, and every holder still applies the same bytes.

A group of thousands would cut the vector into thousands of parts, each member dialling every other
and every matchmaking read carrying every declaration (``bench.scale``: 82 MB of DHT reads per peer and
round at 1,000 peers). With ``max_group_size`` > 0 a round of a module with more live holders splits:

1. **Buckets.** Each holder counts the module's live holders and draws its bucket of this round,
   :func:`peer.network.records.group_bucket` of :func:`peer.network.records.group_buckets` buckets (a new
   draw every round). Each bucket matchmakes and all-reduces on its own key as a whole module's group
   would (:mod:`peer.averaging.matchmaking`, :mod:`peer.averaging.allreduce`); every member of the bucket
   then holds the bucket's mean, identical bits, and the tokens behind it (the members' join weights).
   A holder alone in its bucket carries its own encoded delta.
2. **Levels and the top group.** The bucket's delegate (:func:`delegate`: its smallest contributing peer
   id that accepts connections) carries the bucket's mean up. :func:`peer.network.records.split_levels`
   says how many groups each level has (:class:`SplitPlan`): while the buckets outnumber the cap, the
   delegates of the buckets whose index agrees modulo the next level's count meet in a group of that
   level (at most the cap of them; :func:`peer.network.records.level_group_key`), all-reduce their
   means weighted by their tokens, and their own delegate carries that mean on up; a delegate alone
   in its group carries its mean up as it is. The delegates of the last level form the top group
   (:meth:`peer.averaging.matchmaking.Matchmaker.form_top_group`), which all-reduces their means. The
   top group needs more than half of the last level's groups that hold a live holder, counted from
   the holder records every holder counted the buckets from (whatever round each announces), so two
   top groups of one round cannot both apply. Each level has an equal slice of the round's time
   between the buckets' all-reduce and the top group's end
   (:func:`peer.averaging.split_round.level_shares`).
3. **Down the tree.** The top group's average is a list of encoded parts, the same bytes at every
   delegate. Each group, at every level, passes them down a binary tree rooted at its delegate (:func:`tree`):
   a member asks its parent (:class:`~peer.averaging.result_relay.ResultRelay`, the ``Result`` rpc),
   passes each part on to its own children as it arrives, and decodes them. The fastest uploads are the tree's inner nodes.
   Every holder of the module decodes the same bytes: replicas stay identical.

**A tree that cannot lie.** Each top group member states the digest of the round's average
(:func:`result_digest`: the codec, the parts' bounds and lengths and each part's :func:`part_digest`)
on the DHT once its all-reduce ended (:meth:`peer.averaging.matchmaking.Matchmaker.announce_result`).
Every member that gets the average from another peer takes as agreed only a digest that more than half
of the round's buckets' delegates state (the top group's own majority, so no fewer peers can make one
up), and checks what it is sent against it before it passes a byte on or applies one: the head's digest
first, then each part against its part digest as it arrives. A parent caught sending other bytes
(:class:`LyingPeer`) is reported as a suspect (``NetAverager(on_suspect=...)``, as a peer whose
contribution a reducer dropped) and the member asks the bucket's delegate instead; an honest inner node
never passes bad bytes on, so its children never report it. In a two-level round where one bucket
alone holds holders (no top group), every member checks the average against the bucket mean its own
all-reduce computed; in a deeper one whose last level has one group with holders, the delegate that
carried the only mean states its digest (a majority of one).

**Late, not lost.** A bucket whose delegate comes after the group above it formed (at any level), or a
member that missed its bucket's group, asks a top group member for the round's average (each serves it,
under :func:`~peer.averaging.result_relay.round_key`, to any admitted peer; a late member asks only those
that declared the state it holds) and applies it with nothing of its own in it: its ``own_decoded`` is
zero, so error feedback carries its whole delta into its next round (:attr:`RoundResult.late`). A holder that gets no average at all (the top group failed, so nobody
applied the round; or its parent and delegate are gone) fails the round and keeps its local
progress, as after any failed round.

**Pacing.** A member that computed its whole round also declares under the module's own group key
(:meth:`peer.averaging.matchmaking.Matchmaker.announce_full_round`), which every holder's
``NetAverager.others_waiting`` reads: the first to finish paces the holders of every bucket.

Costs, per round: a member sends its vector once up and once down its bucket (the all-reduce) and
receives the encoded average once; an inner node of the tree uploads it to at most two children (the
faster half of the bucket; the rest upload nothing more); a delegate also runs the all-reduce of each level it
carries a mean through, up to the top group's
all-reduce. The bucket mean is encoded again for the top group with the run's codec; what that
second encoding drops is not fed back (error feedback covers each member's own delta in its bucket).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Optional, Sequence

from torch import Tensor

from peer.averaging.partition import Group
from peer.compression import Codec

__all__ = ["RoundResult", "LyingPeer", "SplitPlan", "delegate", "tree", "tree_parent", "tree_depth", "bucket_weight",
           "part_digest", "result_digest", "check_head", "PART_DIGEST_BYTES"]

PART_DIGEST_BYTES = 16
"""Bytes of a part's :func:`part_digest` (blake2b)."""


def part_digest(data: bytes) -> bytes:
    """The digest of one encoded part of a round's average (blake2b, :data:`PART_DIGEST_BYTES`)."""
    return hashlib.blake2b(data, digest_size=PART_DIGEST_BYTES).digest()


def result_digest(codec_name: str, bounds: Sequence[int], lengths: Sequence[int], part_digests: Sequence[bytes]) -> str:
    """The hex digest of a round's average: its codec, the parts' flattened (start, end) ``bounds``, their
    blob ``lengths`` and their :func:`part_digest` s. What the top group states on the DHT and every
    member checks a received average against (the contributors and the ``late`` mark are not in it:
    they differ from bucket to bucket)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(codec_name.encode() + b"\0")
    for x in (*bounds, *lengths):
        h.update(int(x).to_bytes(8, "big"))
    for d in part_digests:
        h.update(bytes(d))
    return h.hexdigest()


class LyingPeer(RuntimeError):
    """A peer sent a round's average other than the one the top group agreed on (``peer``: who)."""

    def __init__(self, peer: str, why: str):
        super().__init__(f"{peer[-8:]} sent other bytes than the top group's average: {why}")
        self.peer = peer
        self.why = why



@dataclass(frozen=True)
class RoundResult:
    """The average of a split round, as its encoded parts: what every holder decodes."""

    codec: str
    parts: tuple[tuple[int, int, bytes], ...]
    """(start, end, encoded average) of each part of the module's flat vector, in order, covering it."""
    contributors: tuple[str, ...]
    """Our bucket's contributors and the top group's delegates, sorted."""
    late: bool = False
    """Our bucket missed the top group: its members' deltas are not in this average (each carries its
    own into its next round, so the replicas stay identical and the work is not lost)."""

    def check(self, numel: int, codec: Codec) -> str:
        """Why these parts cannot be this module's average in ``codec`` ('' if they can)."""
        return check_head(self.codec, [x for a, b, _ in self.parts for x in (a, b)],
                          [len(d) for *_, d in self.parts], numel, codec)

    def decode(self, codec: Codec, out: Tensor) -> Tensor:
        """Decode every part into ``out`` (numel,) and return it."""
        for a, b, data in self.parts:
            codec.decode_average_into(data, out[a:b])
        return out

    @property
    def part_digests(self) -> tuple[bytes, ...]:
        return tuple(part_digest(d) for *_, d in self.parts)

    @property
    def digest(self) -> str:
        """:func:`result_digest` of these parts."""
        return result_digest(self.codec, [x for a, b, _ in self.parts for x in (a, b)],
                             [len(d) for *_, d in self.parts], self.part_digests)


@dataclass(frozen=True)
class SplitPlan:
    """How one round of a module splits (:func:`peer.network.records.split_levels`): ``counts[j - 1]``
    groups at level j (1: the buckets), the top group above the last; built by every holder from the
    same holder records, so the delegates of a round agree on every group and every majority."""

    counts: tuple[int, ...]
    buckets: tuple[int, ...]
    """The bucket (:func:`peer.network.records.group_bucket` of ``counts[0]``) of each live holder."""

    @classmethod
    def of(cls, module_id: str, round_no: int, holders: Sequence[str], max_group_size: int) -> "SplitPlan":
        from peer.network.records import group_bucket, split_levels

        counts = split_levels(len(holders), max_group_size)
        return cls(counts, tuple(group_bucket(module_id, round_no, p, counts[0]) for p in holders))

    @property
    def levels(self) -> int:
        """Levels of groups below the top group."""
        return len(self.counts)

    def slot(self, bucket: int, level: int) -> int:
        """The group at ``level`` (1 .. :attr:`levels`) that bucket ``bucket``'s mean goes through."""
        return bucket % self.counts[level - 1]

    def held(self, level: int, within: Optional[int] = None) -> int:
        """How many groups of ``level`` hold a live holder (of those in group ``within`` of the level
        above, if given). The top group needs more than half of ``held(levels)``."""
        slots = {b % self.counts[level - 1] for b in self.buckets
                 if within is None or b % self.counts[level] == within}
        return len(slots)


def delegate(group: Group, contributors: Sequence[str]) -> str:
    """The member of a bucket's ``group`` that takes its mean to the top group: the smallest contributor
    that accepts connections (the smallest contributor if none does). The same on every member, which
    all know the group and its contributors."""
    bandwidth = dict(zip(group.members, group.bandwidths))
    accepting = [p for p in contributors if bandwidth.get(p, 0.0) > 0]
    return min(accepting or contributors)


def tree(group: Group, root: str) -> dict[str, str]:
    """The bucket ``group``'s distribution tree: member -> the member it asks for the round's average.

    A binary heap over ``root``, then the members that accept connections from the fastest upload
    down, then those that cannot be dialled (client mode, behind NAT without a relay): the fastest
    uploads are the inner nodes (each serves at most two children), the slowest half and the
    undiallable ones are leaves. A member whose heap parent cannot be dialled asks the nearest
    ancestor that can. The same on every member (it depends on the group and its delegate only)."""
    bandwidth = dict(zip(group.members, group.bandwidths))
    accepting = sorted((m for m in group.members if m != root and bandwidth.get(m, 0.0) > 0),
                       key=lambda m: (-bandwidth[m], m))
    order = [root] + accepting + sorted(m for m in group.members if m != root and bandwidth.get(m, 0.0) <= 0)
    dialable = len(accepting) + 1
    parents = {}
    for i, member in enumerate(order[1:], start=1):
        p = (i - 1) // 2
        while p >= dialable:
            p = (p - 1) // 2
        parents[member] = order[p]
    return parents


def tree_parent(group: Group, root: str, me: str) -> str:
    """Whom ``me`` asks for the round's average in the bucket ``group``'s :func:`tree` rooted at ``root``."""
    return tree(group, root)[me]


def tree_depth(group: Group, root: Optional[str] = None) -> int:
    """Hops from the delegate (``root``, default :func:`delegate` of every member) to the deepest
    member of ``group``'s :func:`tree`."""
    root = root if root is not None else delegate(group, group.members)
    parents = tree(group, root)
    depth: dict[str, int] = {root: 0}

    def hops(m: str) -> int:
        if m not in depth:
            depth[m] = hops(parents[m]) + 1
        return depth[m]

    return max((hops(m) for m in group.members), default=0)


def bucket_weight(group: Group, contributors: Sequence[str], own: float) -> float:
    """The tokens behind a bucket's mean: the join weights of its contributors (``own`` each when the
    group did not carry weights: a leader of an older version)."""
    weights = dict(zip(group.members, group.weights))
    return float(sum(weights.get(p, 0.0) or own for p in contributors))


def check_head(codec_name: str, bounds: Sequence[int], lengths: Sequence[int], numel: int, codec: Codec) -> str:
    """Why parts of these ``bounds`` (flattened (start, end) pairs) and blob ``lengths`` cannot be a
    module average of ``numel`` values in ``codec`` ('' if they can)."""
    if codec_name != codec.name:
        return f"average is in {codec_name}, ours is {codec.name}"
    if len(bounds) != 2 * len(lengths):
        return f"{len(bounds)} bounds for {len(lengths)} parts"
    at = 0
    for i, length in enumerate(lengths):
        a, b = int(bounds[2 * i]), int(bounds[2 * i + 1])
        if a != at or b <= a or b > numel:
            return f"part ({a}, {b}) does not continue the vector at {at} of {numel}"
        if not codec.average_size_ok(int(length), b - a):
            return f"part ({a}, {b}) is {length} bytes, which cannot encode {b - a} values with {codec.name}"
        at = b
    if at != numel:
        return f"the parts cover {at} of {numel} values"
    return ""
