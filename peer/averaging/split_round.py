"""A split round from one holder's side: its bucket's group, the climb of the bucket's mean up the
levels of delegates to the top group, and the round's average back down the tree (or from the top group
when ours came late).

:mod:`peer.averaging.hierarchy` holds the pieces of a split round (the plan of levels, the trees, the
relay that serves the average, the digests that keep it honest); this module drives them through one
round, against the deadlines below. It is separate from :mod:`peer.averaging.net_averager`, which runs a
whole module's group itself and hands a round here only when the module's live holders outnumber
``outer.max_group_size`` (:meth:`SplitRounds.plan` counts them).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import Counter
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
from torch import Tensor

from peer.averaging.allreduce import ReductionServer
from peer.averaging.compat import wire_key
from peer.averaging.contract import AverageResult
from peer.averaging.hierarchy import LyingPeer, RoundResult, SplitPlan, bucket_weight, delegate, tree_parent
from peer.averaging.matchmaking import LONE, Matchmaker
from peer.averaging.partition import Group
from peer.averaging.result_relay import ResultRelay, round_key
from peer.averaging.vectors import unflatten
from peer.compression import Codec
from peer.network import (GroupDeclaration, HolderRecord, group_bucket, holders_key, level_group_key,
                          records_from_value, top_group_key)

__all__ = ["SplitRounds", "level_shares", "SPLIT_BUCKET", "SPLIT_TOP_GATHER", "SPLIT_TOP", "SPLIT_END"]

log = logging.getLogger(__name__)

SPLIT_BUCKET = 0.6
"""Share of a round's timeout by which a split round's bucket group has matchmade (as a whole module's
group does, within the same shares of the timeout) and all-reduced (:mod:`peer.averaging.hierarchy`) ..."""
SPLIT_TOP_GATHER = 0.7
"""... by when (a share of the timeout from the round's start) the buckets' delegates have declared the top group ..."""
SPLIT_TOP = 0.88
"""... by when the top group's all-reduce ends ..."""
SPLIT_END = 0.95
"""... and by when every holder has the average from its tree."""
LATE_POLL = 1.0
"""Seconds between a late member's reads of the top group's declarations (whom to ask for the average)."""
AGREED_POLL = 0.25
"""Seconds between a bucket member's reads of the top group's declarations while it waits for the
digest of the round's average most delegates state (:class:`_Agreement`)."""


class _Agreement:
    """The digest of a split round's average that the top group agreed on, read from its declarations
    (:attr:`peer.network.records.GroupDeclaration.result`) once, the first time it is asked for: a digest
    stated by ``need`` delegates (more than half of the round's buckets). Raises when none is by
    ``deadline``; :meth:`close` stops the reads."""

    def __init__(self, read: Callable[[], Any], need: int, deadline: float):
        self.read, self.need, self.deadline = read, need, deadline
        self._task: Optional["asyncio.Future[str]"] = None

    async def __call__(self) -> str:
        if self._task is None:
            self._task = asyncio.ensure_future(self._wait())
        return await asyncio.shield(self._task)

    async def _wait(self) -> str:
        while True:
            stated = Counter(await self.read())
            best = stated.most_common(1)
            if best and best[0][1] >= self.need:
                return best[0][0]
            if time.monotonic() >= self.deadline:
                raise RuntimeError(f"no digest of the round's average stated by {self.need} delegates in time "
                                   f"({dict(stated) or 'none stated'})")
            await asyncio.sleep(min(AGREED_POLL, max(0.0, self.deadline - time.monotonic())))

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task.add_done_callback(lambda t: t.cancelled() or t.exception())


def level_shares(levels: int, level: int) -> tuple[float, float]:
    """The shares of a round's timeout (from its start) by which the delegates meeting at ``level``
    above the buckets (1 .. ``levels``; ``levels``: the top group) of a split round of ``levels``
    levels of groups below the top have declared, and by which that level's all-reduce ends: the span
    from ``SPLIT_BUCKET`` to ``SPLIT_TOP`` in equal slices, each gathering for the same share of its
    slice as a two-level round's top group (``SPLIT_TOP_GATHER``)."""
    step = (SPLIT_TOP - SPLIT_BUCKET) / levels
    start = SPLIT_BUCKET + (level - 1) * step
    return start + step * (SPLIT_TOP_GATHER - SPLIT_BUCKET) / (SPLIT_TOP - SPLIT_BUCKET), start + step


class SplitRounds:
    """Plans (:meth:`plan`) and runs (:meth:`average`) this peer's split rounds
    (:mod:`peer.averaging.hierarchy`) with the averager's matchmaker, reduction server and result relay;
    one per :class:`peer.averaging.net_averager.NetAverager`.

    ``hold(module_id, round_no, wait=False)`` announces the round we average next once our bucket's
    group formed (:meth:`peer.averaging.net_averager.NetAverager.hold`); ``report(module_id, round_no,
    suspects)`` reports the peers that sent a late member other bytes than the round's.
    """

    def __init__(self, dht: Any, run_id: str, peer_id: str, config_hash: str, data_hash: str,
                 matchmaker: Matchmaker, server: ReductionServer, relay: ResultRelay, verifier: Optional[Any],
                 hold: Callable[..., None], report: Callable[[str, int, Mapping[str, str]], None]):
        self.dht, self.run_id, self.peer_id = dht, run_id, peer_id
        self.config_hash, self.data_hash = config_hash, data_hash
        self._matchmaker, self._server, self._relay, self._verifier = matchmaker, server, relay, verifier
        self._hold, self._report = hold, report

    async def _live_holders(self, module_id: str) -> dict[str, HolderRecord]:
        """The module's other live holders of our config and dataset that train it now (one DHT read;
        an idle holder declares no round: :attr:`peer.network.records.HolderRecord.idle`)."""
        found = await self.dht.get(holders_key(self.run_id, module_id), latest=True, return_future=True)
        return {p: h for p, h in records_from_value(found, HolderRecord, self._verifier).items()
                if p != self.peer_id and h.config_hash == self.config_hash and h.data_hash == self.data_hash
                and not h.idle and h.wire == wire_key()}

    async def plan(self, module_id: str, round_no: int, max_group_size: int) -> SplitPlan:
        """How this round of ``module_id`` splits in groups of at most ``max_group_size``
        (:class:`peer.averaging.hierarchy.SplitPlan` of its live holders, us included): the groups of each
        level, and which hold a live holder (the top group needs more than half of those of the last
        level). Every holder counts them from the same holder records, whatever round each announces, so
        all delegates of a round agree on the majority (counting only the holders at this round would let
        an early set of buckets and a late one each see a majority of its own)."""
        live = [*await self._live_holders(module_id), self.peer_id]
        return SplitPlan.of(module_id, round_no, live, max_group_size)

    async def average(self, module_id: str, round_no: int, flat: Tensor, like: Sequence[Tensor], weight: float,
                      codec: Codec, timeout: float, digest: str, paced: bool, plan: SplitPlan, wait_for_behind: bool,
                      sparse: bool = False) -> AverageResult:
        """A round averaged in levels (:mod:`peer.averaging.hierarchy`): our bucket's group, then its
        delegate up the groups of delegates to the top group, then the top group's average down each
        group's tree."""
        t0 = time.monotonic()
        buckets, held = plan.counts[0], plan.held(plan.levels)
        bucket = group_bucket(module_id, round_no, self.peer_id, buckets)
        if not paced:  # every holder's others_waiting reads the module's key, whatever its bucket
            self._matchmaker.announce_full_round(module_id, round_no, digest, timeout)
        match = await self._matchmaker.form_group(
            module_id, round_no, timeout, digest, wait_for_behind=wait_for_behind, paced=paced, sparse=sparse,
            bucket=(bucket, buckets), weight=weight, end_share=SPLIT_BUCKET)
        group, reason, adopt = match.group, match.reason, match.adopt
        self._hold(module_id, round_no if match.ahead > round_no else round_no + 1, wait=False)
        if group is None and not adopt and match.ahead < 0:
            # our bucket formed without us (or not at all): the round's average, if its top group gets
            # through, applied with nothing of ours in it (our delta carries into the next round)
            agreed = self._agreement(module_id, round_no, digest, held, t0 + SPLIT_END * timeout)
            late_suspects: dict[str, str] = {}
            try:
                late = await self._late_result(module_id, round_no, flat.numel(), codec, t0 + SPLIT_END * timeout,
                                               digest, agreed, late_suspects)
            finally:
                agreed.close()
            self._report(module_id, round_no, late_suspects)
            if late is not None:
                log.info("module %s round %d: missed group %d of %d (%s); applying the round's average",
                         module_id, round_no, bucket, buckets, reason)
                return AverageResult(unflatten(late.decode(codec, torch.empty_like(flat)), like),
                                     unflatten(torch.zeros_like(flat), like), len(late.contributors),
                                     list(late.contributors), 0, sum(len(d) for *_, d in late.parts),
                                     reason=f"late: missed group {bucket} of {buckets} ({reason}), our delta carries over")
        if group is None:
            log.info("module %s round %d: no group %d of %d (%s)", module_id, round_no, bucket, buckets, reason)
            return AverageResult(None, None, 0, [], 0, 0, reason=reason, adopt=adopt, ahead=match.ahead,
                                 ahead_left=match.ahead_left)
        # our place in the bucket's tree, before the all-reduce: children may ask as soon as theirs ends
        served = self._relay.expect(group, t0 + SPLIT_END * timeout) if group.group_id != LONE else None
        try:
            formed = time.monotonic()
            result = await self._split_levels(module_id, round_no, flat, like, weight, codec, timeout, digest, t0,
                                              bucket, plan, group, reason, served)
            return dataclasses.replace(result, transfer_seconds=time.monotonic() - formed)
        finally:
            if served is not None and not served.complete:
                self._relay.fail(group.group_id, "the round failed here")

    async def _split_levels(self, module_id: str, round_no: int, flat: Tensor, like: Sequence[Tensor], weight: float,
                            codec: Codec, timeout: float, digest: str, t0: float, bucket: int, plan: SplitPlan,
                            group: Group, reason: str, served: Optional[Any]) -> AverageResult:
        buckets, held = plan.counts[0], plan.held(plan.levels)
        sent = received = 0
        link = None  # our bucket's all-reduce, part by part (the levels above give totals only)
        suspects: dict[str, str] = {}
        deadline = t0 + SPLIT_END * timeout
        if group.group_id == LONE:  # alone in our bucket: our own delta goes to the top group
            own = codec.roundtrip(flat)  # (n,)
            if own.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr():
                own = own.clone()  # ``flat`` is reused next round
            mean, contributors, mean_weight, bucket_parts = own, [self.peer_id], float(weight), None
        else:
            self._server.event("group_formed")
            out = await self._server.run(group, flat, weight, codec)
            sent, received, suspects, link = out.bytes_sent, out.bytes_received, out.suspects, out.link
            own = out.own_decoded
            if out.averaged is None:
                log.warning("module %s round %d failed in group %d of %d: %s", module_id, round_no, bucket, buckets,
                            out.reason)
                return AverageResult(None, unflatten(own, like), 0, [], sent, received, reason=out.reason,
                                     suspects=out.suspects, link_times=link)
            mean, contributors, bucket_parts = out.averaged, out.contributors, out.parts
            mean_weight = bucket_weight(group, contributors, float(weight))
        root = delegate(group, contributors) if group.group_id != LONE else self.peer_id
        self._server.event("bucket_done")
        suspects = dict(suspects)
        if plan.levels == 1 and held <= 1 and bucket_parts is not None:
            # no top group: the round's average is our bucket's mean
            mine = RoundResult(codec.name, tuple(bucket_parts), ()).digest

            async def own_mean() -> str:
                return mine
            agreed: Any = own_mean
        else:
            agreed = self._agreement(module_id, round_no, digest, held, deadline)
        try:
            if root == self.peer_id:
                result, top_sent, top_received = await self._climb(
                    module_id, round_no, plan, 2, bucket, mean, mean_weight, bucket_parts, contributors, codec,
                    digest, t0, timeout, agreed, suspects)
                sent, received = sent + top_sent, received + top_received
            else:
                result = await self._fetch_result(group, root, flat.numel(), codec, deadline, served, agreed,
                                                  suspects)
                received += sum(len(d) for *_, d in result.parts)
        except Exception as e:
            if isinstance(e, LyingPeer):
                suspects[e.peer] = f"split round's tree: {e.why}"
            why = f"split round (group {bucket} of {buckets}): {type(e).__name__}: {e}"
            log.warning("module %s round %d failed: %s", module_id, round_no, why)
            if served is not None:  # our children fail at once (or ask the delegate)
                self._relay.fail(group.group_id, why)
            return AverageResult(None, unflatten(own, like), 0, [], sent, received, reason=why, suspects=suspects,
                                 link_times=link)
        finally:
            if isinstance(agreed, _Agreement):
                agreed.close()
        if served is not None and root == self.peer_id:  # our children in the bucket's tree ask us
            self._relay.publish(group.group_id, result)
        averaged = result.decode(codec, torch.empty_like(flat))
        if result.late:  # nothing of ours is in it: error feedback carries our whole delta into the next round
            own = torch.zeros_like(flat)
            reason = "; ".join(r for r in (reason, "late: our group missed the top group, our delta carries over") if r)
        notes = "; ".join(r for r in (reason, f"group {bucket} of {buckets}, {plan.levels + 1} levels") if r)
        # suspects: of the parts we reduced in our bucket (a top group's member is a bucket's mean, not a peer)
        return AverageResult(unflatten(averaged, like), unflatten(own, like), len(result.contributors),
                             list(result.contributors), sent, received, reason=notes, suspects=suspects,
                             link_times=link)

    def _agreement(self, module_id: str, round_no: int, digest: str, held: int, deadline: float) -> _Agreement:
        """The digest of ``module_id``'s round ``round_no`` average that more than half of the ``held``
        buckets' delegates (a top group's least size) state, for the state of ``digest``."""
        key = top_group_key(self.run_id, module_id, round_no)

        async def read() -> list[str]:
            found = await self.dht.get(key, latest=True, return_future=True)
            return [d.result for d in records_from_value(found, GroupDeclaration, self._verifier).values()
                    if d.result and d.digest == digest and d.config_hash == self.config_hash
                    and d.data_hash == self.data_hash]
        return _Agreement(read, held // 2 + 1, deadline)

    async def _climb(self, module_id: str, round_no: int, plan: SplitPlan, level: int, slot: int, mean: Tensor,
                     weight: float, parts: Optional[list[tuple[int, int, bytes]]], contributors: Sequence[str],
                     codec: Codec, digest: str, t0: float, timeout: float, agreed: Any,
                     suspects: dict[str, str]) -> tuple[RoundResult, int, int]:
        """As the delegate of our group of level ``level`` - 1 (group ``slot`` there), carrying its
        ``mean`` (the ``parts`` its members decoded; None: our own delta, alone in our bucket) with the
        tokens behind it (``weight``): the round's average, from the group of level ``level`` we meet
        the other delegates in (:func:`peer.network.records.level_group_key`), or from the top group
        above the last level. Returns it with the bytes sent and received here and above."""
        if level > plan.levels:
            return await self._top_round(module_id, round_no, mean, weight, codec, digest, t0, timeout, parts,
                                         plan.held(plan.levels), contributors, agreed, suspects, plan.levels)
        index = plan.slot(slot, level)
        gather_share, end_share = level_shares(plan.levels, level - 1)
        self._server.event("top_gather")
        key = level_group_key(self.run_id, module_id, round_no, level, index)
        group, reason, *_ = await self._matchmaker.form_top_group(
            module_id, round_no, digest, plan.held(level - 1, index), weight, t0 + gather_share * timeout,
            t0 + end_share * timeout, key=key, need=1)
        if group is None:  # it formed without us: the round's average from the top group, nothing of ours in it
            late = await self._late_result(module_id, round_no, mean.numel(), codec, t0 + SPLIT_END * timeout, digest,
                                           agreed, suspects)
            if late is None:
                raise RuntimeError(f"level {level}: {reason}")
            log.info("module %s round %d: our group missed level %d (%s); applying the round's average", module_id,
                     round_no, level, reason)
            return late, 0, sum(len(d) for *_, d in late.parts)
        if group.group_id == LONE:
            return await self._climb(module_id, round_no, plan, level + 1, index, mean, weight, parts, contributors,
                                     codec, digest, t0, timeout, agreed, suspects)
        served = self._relay.expect(group, t0 + SPLIT_END * timeout)
        try:
            out = await self._server.run(group, mean, weight, codec)
            if out.averaged is None:
                raise RuntimeError(f"level {level}'s all-reduce failed: {out.reason}")
            suspects.update(out.suspects)
            sent, received = out.bytes_sent, out.bytes_received
            root = delegate(group, out.contributors)
            if root == self.peer_id:
                result, up_sent, up_received = await self._climb(
                    module_id, round_no, plan, level + 1, index, out.averaged,
                    bucket_weight(group, out.contributors, weight), out.parts,
                    sorted(set(contributors) | set(out.contributors)), codec, digest, t0, timeout, agreed, suspects)
                self._relay.publish(group.group_id, result)
                return result, sent + up_sent, received + up_received
            result = await self._fetch_result(group, root, mean.numel(), codec, t0 + SPLIT_END * timeout, served,
                                              agreed, suspects)
            return result, sent, received + sum(len(d) for *_, d in result.parts)
        finally:
            if not served.complete:
                self._relay.fail(group.group_id, f"the round failed at level {level}")

    async def _top_round(self, module_id: str, round_no: int, mean: Tensor, weight: float, codec: Codec, digest: str,
                         t0: float, timeout: float, bucket_parts: Optional[list[tuple[int, int, bytes]]],
                         held: int, contributors: Sequence[str], agreed: Any,
                         suspects: dict[str, str], levels: int = 1) -> tuple[RoundResult, int, int]:
        """As our bucket's delegate: the top group's all-reduce of the bucket means (``held``: how many
        buckets hold a live holder; the top group needs more than half of them). Returns the round's
        average as the parts every holder decodes, and the bytes sent and received.

        When ours is the only bucket with live holders, its mean is the round's (``bucket_parts``, the
        bytes every member of the bucket decoded; a member alone in it fails the round instead of
        stepping alone while other holders live). When the top group formed without us (our bucket
        was late), the round's average from one of its members, marked ``late``, checked against the
        digest most delegates state (``agreed``; a member that sent another is added to ``suspects``).
        A member of the top group states the digest of its average (:meth:`Matchmaker.announce_result`)."""
        if held <= 1:
            if bucket_parts is None:
                raise RuntimeError("no other holder at this round (not stepping alone while others live)")
            result = RoundResult(codec.name, tuple(bucket_parts), tuple(contributors))
            # the members of groups below ours that did not compute these parts check them against this
            self._matchmaker.announce_result(module_id, round_no, digest, result.digest, (SPLIT_END + 0.1) * timeout)
            return result, 0, 0
        gather_share, end_share = level_shares(levels, levels)
        end = t0 + end_share * timeout
        self._server.event("top_gather")
        top, reason, *_ = await self._matchmaker.form_top_group(module_id, round_no, digest, held, weight,
                                                               t0 + gather_share * timeout, end)
        if top is None:
            late = await self._late_result(module_id, round_no, mean.numel(), codec, t0 + SPLIT_END * timeout, digest,
                                           agreed, suspects)
            if late is None:
                raise RuntimeError(reason)
            log.info("module %s round %d: our group missed the top group (%s); applying its average", module_id,
                     round_no, reason)
            return late, 0, sum(len(d) for *_, d in late.parts)
        self._relay.expect_round(module_id, round_no, t0 + SPLIT_END * timeout)  # for groups that come late
        out = await self._server.run(top, mean, weight, codec)
        if out.averaged is None:
            self._relay.fail(round_key(module_id, round_no), "the top group failed")
            raise RuntimeError(f"the top group's all-reduce failed: {out.reason}")
        result = RoundResult(codec.name, tuple(out.parts), tuple(sorted(set(contributors) | set(top.members))))
        self._matchmaker.announce_result(module_id, round_no, digest, result.digest, (SPLIT_END + 0.1) * timeout)
        self._relay.publish(round_key(module_id, round_no), result)
        return result, out.bytes_sent, out.bytes_received

    async def _late_result(self, module_id: str, round_no: int, numel: int, codec: Codec, deadline: float,
                           digest: str, agreed: Any, suspects: dict[str, str]) -> Optional[RoundResult]:
        """The round's average from a member of the top group that formed without us (None if none
        serves one by ``deadline``): only a top group of most buckets applies one, so it is the round's.
        Asked only of delegates that declared the state we hold (``digest``): the average is applied to it,
        once checked against the digest most of them state (``agreed``; one that sends another is added
        to ``suspects``)."""
        tried: set[str] = set()
        while time.monotonic() < deadline:
            found = await self.dht.get(top_group_key(self.run_id, module_id, round_no), latest=True, return_future=True)
            members = sorted(p for p, d in records_from_value(found, GroupDeclaration, self._verifier).items()
                             if p != self.peer_id and p not in tried and d.digest == digest
                             and d.config_hash == self.config_hash and d.data_hash == self.data_hash)
            tried.update(members)
            # all at once (one that never joined the top group answers only after UNKNOWN_WAIT); the
            # parts are the same bytes at every member of the top group, so the first answer is the one
            tasks = [asyncio.ensure_future(self._relay.fetch(peer, round_key(module_id, round_no), numel, codec,
                                                             deadline, late=True, agreed=agreed)) for peer in members]
            try:
                for next_done in asyncio.as_completed(tasks):
                    try:
                        return await next_done
                    except LyingPeer as e:
                        suspects[e.peer] = f"split round's average: {e.why}"
                    except Exception as e:
                        log.debug("the average of %s round %d: %r", module_id, round_no, e)
            finally:
                for task in tasks:
                    task.cancel()
            await asyncio.sleep(min(LATE_POLL, max(0.0, deadline - time.monotonic())))
        return None

    async def _fetch_result(self, group: Group, root: str, numel: int, codec: Codec, deadline: float,
                            place: Any, agreed: Any, suspects: dict[str, str]) -> RoundResult:
        """The round's average from our parent in the bucket's tree, or from the delegate itself if the
        parent has none (gone, or failed, or sent other bytes than the top group's: then it is added to
        ``suspects``); checked against ``agreed`` and passed on to our children as it arrives (``place``)."""
        parent = tree_parent(group, root, self.peer_id)
        try:
            return await self._relay.fetch(parent, group.group_id, numel, codec, deadline, place, agreed=agreed)
        except Exception as e:
            if isinstance(e, LyingPeer):
                suspects[e.peer] = f"split round's tree: {e.why}"
            if parent == root:
                raise
            log.log(logging.WARNING if isinstance(e, LyingPeer) else logging.INFO,
                    "the average of group %s from %s failed (%r); asking its delegate %s", group.group_id,
                    parent[-8:], e, root[-8:])
            return await self._relay.fetch(root, group.group_id, numel, codec, deadline, place, agreed=agreed)
