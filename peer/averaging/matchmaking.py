"""Form one averaging group per (run, module, round) among the live holders, bounded by a deadline.

Every member of a formed group gets the same membership from one leader (hivemind-style
leader/follower matchmaking over the DHT, Ryabinin et al. 2021, made consistent):

1. A member declares itself under :func:`peer.network.records.group_key` and, until a gather deadline,
   reads the declarations and the module's :class:`~peer.network.records.HolderRecord` s; it stops early
   once every live holder at this round has declared. Declarations the other holders push count at
   once, so the holders are read once a :data:`HOLDERS_POLL` and the declarations less and less often
   while every holder awaited pushes; when the other members of the group we formed last round are
   every live holder we know and all push us this round's declarations at our state, no DHT record is
   read at all (the sticky group, going on from a read less than :data:`HOLDERS_REUSE` old).
2. The leader is the smallest peer id among the declared members that accept connections; the
   followers join it and it begins the group (:mod:`peer.averaging.group_join`, the protocol).
3. One group per round: the leader states that its group began (:attr:`GroupDeclaration.formed`). A
   holder that declares the round after that, or a leader whose declared members did not all join and
   that reads the statement before it begins, forms no second group of the round: it fails the round
   as behind the group and re-syncs to the round the group applies.

A member applies its delta alone only when it is the module's only live holder, and never while a
holder whose record it read before, still valid and not withdrawn, is missing from its last read (a
DHT get that reached only some nodes returns part of the holders; that holder may be at our round):
nor does a group form then. A holder at its
round that did not declare makes it fail the round; holders behind it make it wait (fail the round)
until they re-sync to it, for at most two round budgets per round they announce (an idle or stuck
holder does not hold it back for good; overlap members, whose round number moves on whatever the
last round did, do not wait); holders ahead make it re-sync to them. A peer that just fetched this round's state from us to average
it counts as a holder at this round before its record is visible, and so does every other member of
the group we formed last round (its record of this round lands after that group formed, late on a busy
host: ``bench.utilization``). A holder serves a round's state
even while that round's exchange runs, so newcomers can hold a round its holders have left: a leader
refuses a group whose members all fetched this round's state from holders none of which is in it
(they would average the old state between them, a second lineage at the same round numbers).

The decision itself (whom a gather waits for, who leads, which fork is kept, when to wait, step
alone or re-sync) is :mod:`peer.averaging.group_decision`'s, pure functions of what the members
declared; this module reads and writes the records, pushes declarations
(:mod:`peer.averaging.declaration_push`), waits, logs, and leads or follows as decided. What its earlier
reads said of each module's holders is kept by :mod:`peer.averaging.holder_memory`.

Peers whose config hash or dataset hash differ from ours are never grouped: their declarations
are ignored and their join requests refused, with a log line naming both hashes.

Equal round numbers do not prove equal states: a peer that averaged alone while cut off, or one
restored from an old copy, can carry the same round number as the group with other weights. Every
declaration and join request carries the :func:`peer.outer.state_digest` of the state the member
will apply the mean to, and only equal digests are grouped. When holders at one round disagree (a
fork), the state declared by the most holders is kept (ties: the larger digest, the same choice on
every peer); the others fail the round with :attr:`Match.adopt` set and re-sync to it, keeping their
local progress, so replicas are identical again after one round.

Split rounds (``outer.max_group_size``, :mod:`peer.averaging.hierarchy`): a module with more live holders
than the cap averages each round in buckets, each matchmade as above on its own key among the
holders :func:`peer.network.records.group_bucket` puts in it (a member alone in its bucket gets a
``LONE`` group and carries its own delta up); the buckets' delegates then matchmake the top group
(:meth:`Matchmaker.form_top_group`), which needs more than half of the buckets that hold members.

Admission: with a ``verifier`` (:class:`peer.network.credentials.CredentialVerifier`) only
admitted peers are grouped. Declarations and holder records without a valid credential for their
writer are ignored, and so are join requests and leader replies without one
(:mod:`peer.averaging.group_join`). Every refusal is logged once per (peer, reason).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any, Callable, Mapping, Optional

from peer.averaging import group_decision
from peer.averaging.declaration_push import DeclarationPush
from peer.averaging.group_decision import LONE, Gathered, Match, behind_a_formed_group, in_bucket
from peer.averaging.group_join import Looking
from peer.averaging.holder_memory import HolderMemory
from peer.network import (MAX_EXPECTING, ArchiveRecord, CredentialProvider, CredentialVerifier, GroupDeclaration,
                          HolderRecord, OwnExpirations, archive_key, group_key, holders_key, is_withdrawal,
                          records_from_value, to_value, top_group_key, withdrawal, withdrawn_rounds)

__all__ = ["Matchmaker", "Match", "LONE", "BEHIND_PATIENCE_ROUNDS"]

log = logging.getLogger(__name__)

BEHIND_PATIENCE_ROUNDS = 2.0
"""How long (in round budgets) a member otherwise alone waits for a holder behind it to catch up."""

_POLL = 0.1  # seconds between DHT reads while gathering (a protocol poll, not a test wait)
PUSHED_POLL = 1.0
"""The most seconds between reads of a round's group key while every holder a gather waits for is one
that pushes us its declarations (:meth:`~peer.averaging.declaration_push.DeclarationPush.pushers`): the
poll interval doubles from ``_POLL`` up to it, since their pushes end the gather at once; the DHT read
is for a push that failed."""
HOLDERS_REUSE = 10.0
"""Seconds a gather may go on from the last gather's read of the module's holders key, with no DHT read
at all when the members of the last round's group push it their declarations (the sticky group,
:func:`peer.averaging.group_decision.sticky`): how stale our view of who else holds the module may grow,
the other side of a healed partition included (it shows only in a read)."""
HOLDERS_POLL = 1.0
"""Seconds between reads of a module's holders key while gathering. The key lists every holder of the
module, the largest record a gather reads: read every poll, it was most of a peer's DHT bytes. A gather
reads it at its start, then once a ``HOLDERS_POLL``; sooner when a declaration names a peer that read did
not return or a holder pushes us a later round of the module (what it said is out of date); and again
for the decision at the gather's deadline while an expected holder has not declared (it may have left)."""


class Matchmaker(DeclarationPush):
    """Runs this peer's side of matchmaking for every module it averages (one asyncio loop): gathers
    the declared members of a round, decides (alone, lead, follow, fail), and joins or leads the
    group (:class:`~peer.averaging.group_join.GroupJoin`), pushing its declarations to the holders it
    read (:class:`~peer.averaging.declaration_push.DeclarationPush`)."""

    def __init__(self, dht: Any, p2p: Any, peer_id: str, run_id: str, config_hash: str, data_hash: str,
                 bandwidth: float, prefix: str, credential: Optional[CredentialProvider] = None,
                 verifier: Optional[CredentialVerifier] = None,
                 joiners: Optional[Callable[[str, float], Mapping[str, int]]] = None, relayed: bool = False,
                 in_touch_since: Optional[Callable[[], Optional[float]]] = None):
        """``credential`` returns this peer's current credential; ``verifier`` checks everyone
        else's (both None: an open run, no admission checks). ``joiners(module_id, within)``: the peers
        that fetched the module's state from us in the last ``within`` seconds to average it, and the
        round we sent (:meth:`peer.averaging.state_transfer.StateServer.joiners`). ``in_touch_since()``:
        since when (monotonic) the run's coordinator has answered us without a break, None while it
        does not (the default: never known); see :meth:`peer.averaging.holder_memory.HolderMemory.vanished`."""
        super().__init__(p2p, peer_id, run_id, config_hash, data_hash, bandwidth, prefix, credential, verifier,
                         relayed)
        self.dht = dht
        self.joiners = joiners or (lambda module_id, within: {})
        self.in_touch_since = in_touch_since or (lambda: None)
        self._sources: dict[str, tuple[str, int, float]] = {}
        """module -> (the peer we last fetched its state from, the round of that state, when)."""
        self._holders = HolderMemory()
        """What our earlier reads of each module's holders said (whom they missed, who vanished, whom we wait for)."""
        self._declared: dict[str, str] = {}
        """module -> the group key of our last declaration (:meth:`withdraw`)."""
        self._stored = OwnExpirations()
        """The expiration of our last value under each group key: the next one there must outlive it."""
        self._grouped: dict[str, tuple[int, frozenset[str]]] = {}
        """module -> (the last round whose group we formed, its other members): at the next round each
        of them is at that round too, whatever its holder record still says (see :meth:`_gather`)."""
        self.sparse_seen: dict[str, int] = {}
        """module -> the last round whose gather read a declaration of a peer whose steps are far apart
        (:attr:`peer.network.records.GroupDeclaration.sparse`: a pipeline trainer or stage server)."""

    def fetched(self, module_id: str, source: str, round_no: int) -> None:
        """We took ``module_id``'s state at ``round_no`` from ``source`` to average it: at that round our
        join requests say so, and a leader refuses a group of such members none of whose sources
        joined (see :meth:`_lead`)."""
        self._sources[module_id] = (source, int(round_no), time.monotonic())

    async def form_group(self, module_id: str, round_no: int, timeout: float, digest: str = "",
                         wait_for_behind: bool = True, paced: bool = False, sparse: bool = False,
                         bucket: Optional[tuple[int, int]] = None, weight: float = 0.0, end_share: float = 0.95) -> Match:
        """Matchmake round ``round_no`` of ``module_id`` within ``timeout`` seconds (the whole round's
        budget: the leader hands the rest to the all-reduce) among the holders whose state has
        ``digest`` (:func:`peer.outer.state_digest`). Returns a :class:`Match`. Without
        ``wait_for_behind`` (overlap mode) a member with only holders behind it averages alone.
        ``paced``: we ended this round early for a waiting holder (said in our declaration); ``sparse``:
        our steps are far apart and we answered a paced holder too (said too: such a declaration paces
        no peer whose steps are far apart, :attr:`GroupDeclaration.sparse`).
        ``weight``: the tokens behind our contribution, said to the leader (:attr:`Group.weights`).
        ``end_share``: the share of ``timeout`` by which the group's all-reduce ends (a split round's
        bucket leaves the rest to the top group and the tree).

        ``bucket`` = (b, k): the module's holders average in k groups this round
        (:mod:`peer.averaging.hierarchy`) and ours is group b; only holders whose
        :func:`peer.network.records.group_bucket` is b are waited for, under the bucket's own key, and a
        member alone in its bucket gets a ``LONE`` group (it carries its own delta to the top group)."""
        t0 = time.monotonic()
        gather_deadline, close_deadline, join_deadline = t0 + 0.2 * timeout, t0 + 0.35 * timeout, t0 + 0.45 * timeout
        end = t0 + min(0.95, end_share) * timeout
        key = group_key(self.run_id, module_id, round_no, None if bucket is None else bucket[0])
        looking = self._looking[key] = Looking(key, digest, paced=paced, sparse=sparse, weight=weight)
        match: Optional[Match] = None
        try:
            patience = BEHIND_PATIENCE_ROUNDS * timeout
            looking.expires = self._declaration_expiry(key, timeout)
            self._declared[module_id] = key
            # pushed to the live holders at once; the DHT store, slow on a busy host, runs behind our gather
            # a failed store is a warning: the holders it was pushed to have it; the others do not see us
            # this round, as when a store comes too late
            looking.storing = self._in_background(
                self._declare(looking, self._own_joiners(module_id, round_no, patience, bucket), module_id),
                "storing our declaration on the DHT", logging.WARNING)
            read = await self._gather(module_id, round_no, looking, gather_deadline, patience, wait_for_behind, bucket)
            vanished = self._holders.vanished(module_id, read.live, read.gone, patience)
            missed = self._holders.missed(module_id, vanished, read.gone) if bucket is None else {}
            now = time.monotonic()
            looking.fetched_from = group_decision.fresh_source(self._sources.get(module_id), round_no, read.live, now,
                                                               patience)
            decision = group_decision.decide(
                self.peer_id, self.bandwidth, round_no, digest, read, vanished=vanished, missed=missed, now=now,
                patience=patience, wait_for_behind=wait_for_behind, waited=self._holders.waited(module_id),
                in_touch_since=self.in_touch_since() if vanished else None, bucket=bucket)
            if decision.fork is not None:
                log.warning("%s: holders %s hold another state at this round (a fork); ours (%s, %d of %d) is kept "
                            "and they re-sync to it", key, ", ".join(sorted(p[-8:] for p in decision.fork.others)),
                            digest, decision.fork.holding, decision.fork.total)
            if decision.waited is not None:
                self._holders.keep_waiting(module_id, decision.waited, patience)
            if decision.match is not None:
                looking.decided.set()
                match = decision.match
                if decision.check_archive:  # the archive may keep a round we missed (its holders left since)
                    match = group_decision.past_the_archive(await self._archived_round(module_id), round_no) or match
                return match
            declared, leader = decision.members, decision.leader
            if leader == self.peer_id:
                looking.decided.set()
                # a split round's bucket is often all newcomers whose sources are in other buckets; the
                # top group, which needs most buckets at this state, keeps them from a second lineage
                leaders: list[str] = []  # of a group of this round that began without us, read before we begin

                async def formed_elsewhere(members: set[str]) -> str:
                    leaders.extend(await self._formed_without_us(key, digest, members))
                    return behind_a_formed_group(leaders, round_no).reason if leaders else ""
                match = Match(*await self._lead(looking, set(declared), close_deadline, end,
                                                check_sources=bucket is None,
                                                before_begin=formed_elsewhere if bucket is None else None))
                if leaders:
                    match = behind_a_formed_group(leaders, round_no)
                elif match.group is not None and bucket is None:
                    self._state_formed(module_id, looking)
            else:
                looking.leader = leader
                looking.decided.set()
                match = Match(*await self._follow(key, leader, join_deadline,
                                                  close_deadline + (end - close_deadline) / 2, digest,
                                                  looking.fetched_from, weight))
            if match.group is not None:
                self._grouped[module_id] = (round_no, frozenset(match.group.members) - {self.peer_id})
            return match
        finally:
            self._stop_looking(looking)
            if match is None or match.group is None:
                self._give_up(module_id, looking)

    def _declaration_expiry(self, key: str, seconds: float) -> float:
        """The DHT expiration of a new declaration under ``key`` valid ``seconds`` from now, or later (a
        declaration of a round we gave up before must outlive that try's withdrawal, :meth:`_give_up`),
        taken as our last value there at once: a withdrawal decided before the store runs outlives it."""
        from hivemind.utils import get_dht_time

        return self._stored.take(key, get_dht_time() + seconds)

    def _give_up(self, module_id: str, looking: Looking, pushed: bool = True) -> None:
        """Our matchmaking of ``looking``'s round (a module's group, a bucket's, a top or level group) ended
        without a group: replace our declaration of it by a withdrawal, on the DHT and at the holders we
        pushed it to (``pushed``: a top or level group's declaration is not pushed), in the background.

        A member that fails a round tries it again under the same key after its next round of compute,
        and its declaration of this try would be read until it expires, a round budget after it was
        made: a holder that reads it meanwhile counts us as waiting. It paces itself to join us, then
        leads a group we never join ("no declared member joined us") or follows us while we train
        ("leader refused: not looking for this group"); two holders a round out of phase did that to each
        other every round, each reading the other's last try."""
        from hivemind.utils import get_dht_time

        if looking.expires <= get_dht_time():
            return  # nothing of ours under the key is still read
        expires = self._stored.take(looking.key, looking.expires)
        if pushed:
            decl = GroupDeclaration(self.config_hash, self.data_hash, self.bandwidth, self._own_credential(),
                                    looking.digest, wire=self.wire)
            self._push(module_id, looking, decl, expiration=0.0)  # expired on arrival: the receivers drop ours
        self._in_background(self.dht.store(looking.key, withdrawal(self._own_credential()), expires,
                                           subkey=self.peer_id, return_future=True),
                            "withdrawing our declaration of a round we gave up")

    def _stop_looking(self, looking: Looking) -> None:
        """Our matchmaking of ``looking``'s round is over: followers still waiting are told we gave up."""
        looking.decided.set()
        for f in looking.followers.values():
            if not f.future.done():
                f.future.set_result(None)
        self._looking.pop(looking.key, None)

    def announce_full_round(self, module_id: str, round_no: int, digest: str, timeout: float) -> None:
        """In a split round, a member that computed its whole round also declares under the module's
        own group key (in the background: the exchange does not wait on it). Every holder's
        ``NetAverager.others_waiting`` reads that key, so the first one to finish paces the module's
        holders in every bucket, not only its own: buckets that began late would miss the top group."""
        from hivemind.utils import get_dht_time

        decl = GroupDeclaration(self.config_hash, self.data_hash, self.bandwidth, self._own_credential(), digest,
                                wire=self.wire)
        key = group_key(self.run_id, module_id, round_no)
        self._in_background(self.dht.store(key, to_value(decl), self._stored.take(key, get_dht_time() + timeout),
                                           subkey=self.peer_id, return_future=True),
                            "announcing a full round")

    async def form_top_group(self, module_id: str, round_no: int, digest: str, buckets: int, weight: float,
                             gather_deadline: float, end: float, key: Optional[str] = None,
                             need: Optional[int] = None) -> Match:
        """As the delegate of our bucket's group (:mod:`peer.averaging.hierarchy`), matchmake the top group
        of ``module_id``'s round ``round_no``: one delegate for each of the ``buckets`` groups that hold
        members this round, whose state has ``digest``, each contributing its group's mean with
        ``weight`` (the tokens behind it). Declarations are read until every bucket's delegate declared or
        ``gather_deadline`` (``time.monotonic()``); the group is led by the smallest declared peer id that
        accepts connections and must hold more than half the ``buckets``: two top groups of one round,
        each applying another mean, would fork the replicas, and only one can hold a majority.

        A group of a level between the buckets and the top (:func:`peer.network.records.split_levels`)
        forms the same way under its own ``key`` (:func:`peer.network.records.level_group_key`) with
        ``need`` = 1: whoever of its ``buckets`` delegates came; a delegate alone there gets a ``LONE``
        group (it carries its mean up alone)."""
        key = key or top_group_key(self.run_id, module_id, round_no)
        looking = self._looking[key] = Looking(key, digest, weight=weight)
        need = buckets // 2 + 1 if need is None else need
        match: Optional[Match] = None
        try:
            looking.expires = self._declaration_expiry(key, max(1.0, end - time.monotonic()))
            await self._declare(looking, frozenset())
            while True:
                found = await self.dht.get(key, latest=True, return_future=True)
                declared = {p: d for p, d in records_from_value(found, GroupDeclaration, self.verifier).items()
                            if p != self.peer_id and d.digest == digest
                            and not self._mismatch(p, d.config_hash, d.data_hash, d.wire)}
                if len(declared) + 1 >= buckets or time.monotonic() >= gather_deadline:
                    break
                await asyncio.sleep(_POLL)
            decision = group_decision.decide_top(self.peer_id, self.bandwidth, declared, buckets, need)
            if decision.match is not None:
                match = decision.match
                return match
            leader = decision.leader
            close_deadline = gather_deadline + (end - gather_deadline) * 0.25
            if leader == self.peer_id:
                looking.decided.set()
                match = Match(*await self._lead(looking, set(declared), close_deadline, end, min_members=need))
                return match
            looking.leader = leader
            looking.decided.set()
            match = Match(*await self._follow(key, leader, close_deadline, close_deadline + (end - close_deadline) / 2,
                                              digest, "", weight))
            return match
        finally:
            self._stop_looking(looking)
            if match is None or match.group is None:
                self._give_up(module_id, looking, pushed=False)

    def announce_result(self, module_id: str, round_no: int, digest: str, result: str, keep: float) -> None:
        """As a member of ``module_id``'s round ``round_no`` top group, once its all-reduce ended: state the
        :func:`peer.averaging.hierarchy.result_digest` of the round's average (``result``) in our
        declaration under the round's :func:`top_group_key`, kept ``keep`` seconds, which every bucket
        member checks the average it is sent against (:attr:`GroupDeclaration.result`). In the
        background: the delegate passes the average down its tree meanwhile."""
        from hivemind.utils import get_dht_time

        key = top_group_key(self.run_id, module_id, round_no)
        expires = self._stored.take(key, get_dht_time() + keep)  # past our declaration there
        decl = GroupDeclaration(self.config_hash, self.data_hash, self.bandwidth, self._own_credential(), digest,
                                wire=self.wire, result=result)
        self._in_background(self.dht.store(key, to_value(decl), expires, subkey=self.peer_id, return_future=True),
                            "stating the round's average digest", logging.WARNING)

    async def _archived_round(self, module_id: str) -> int:
        """The most advanced round an archive of our config keeps of ``module_id`` (-1: none)."""
        found = await self.dht.get(archive_key(self.run_id, module_id), latest=True, return_future=True)
        return max((a.round_no for p, a in records_from_value(found, ArchiveRecord, self.verifier).items()
                    if p != self.peer_id and not self._mismatch(p, a.config_hash, a.data_hash)), default=-1)

    def _own_joiners(self, module_id: str, round_no: int, patience: float,
                     bucket: Optional[tuple[int, int]] = None) -> frozenset[str]:
        """Peers that fetched ``round_no`` of ``module_id`` from us in the last ``patience`` seconds to
        average it (those of our ``bucket`` only, when the holders are split)."""
        return frozenset(p for p, r in self.joiners(module_id, patience).items()
                         if r == round_no and p != self.peer_id and in_bucket(module_id, round_no, p, bucket))

    async def _declare(self, looking: Looking, expecting: frozenset[str], module_id: str = "",
                       formed: bool = False) -> None:
        """Store (or re-store, when more peers fetched our state meanwhile) our declaration of this round;
        with ``module_id``, also push it to the module's live holders (:meth:`_push`). ``formed``: the
        group we lead began (:attr:`GroupDeclaration.formed`). Stored to expire at ``looking.expires``:
        the caller takes it (:class:`~peer.network.OwnExpirations`) before, where it decided to store,
        so that stores decided in turn expire in turn whichever runs first."""
        looking.expecting = expecting
        decl = GroupDeclaration(self.config_hash, self.data_hash, self.bandwidth, self._own_credential(),
                                looking.digest, tuple(sorted(expecting))[:MAX_EXPECTING], looking.paced, self.wire,
                                formed=formed, sparse=looking.sparse)
        if module_id:
            self._push(module_id, looking, decl)
        await self.dht.store(looking.key, to_value(decl), looking.expires, subkey=self.peer_id, return_future=True)

    def _state_formed(self, module_id: str, looking: Looking) -> None:
        """The group we lead for ``looking``'s round began: say so under the round's key (in the
        background), so that holders that declare the round late do not form a second group of it."""
        looking.expires = self._stored.take(looking.key, looking.expires)  # past the declaration it replaces
        self._in_background(self._declare(looking, looking.expecting, formed=True),
                            "stating that our group formed", logging.WARNING)

    async def _declared_at(self, key: str, digest: str, pushed: bool = False) -> dict[str, GroupDeclaration]:
        """The other holders of our config that declared state ``digest`` under ``key``, by peer id: from
        one DHT read, and with ``pushed`` from the declarations pushed to us too (the DHT's record wins)."""
        found = await self.dht.get(key, latest=True, return_future=True)
        declared = {**(self.pushed_to(key) if pushed else {}), **records_from_value(found, GroupDeclaration,
                                                                                    self.verifier)}
        return {p: d for p, d in declared.items() if p != self.peer_id and d.digest == digest
                and not self._mismatch(p, d.config_hash, d.data_hash, d.wire)}

    async def _formed_without_us(self, key: str, digest: str, members: set[str]) -> list[str]:
        """The holders at our state, not among ``members``, that state under ``key`` that a group they
        lead began (:attr:`GroupDeclaration.formed`): we, about to begin a group of ``members``, must not."""
        return sorted(p for p, d in (await self._declared_at(key, digest)).items() if d.formed and p not in members)

    async def gathering(self, module_id: str, round_no: int, digest: str) -> bool:
        """Whether other holders at state ``digest`` declared ``module_id``'s round ``round_no`` and none
        of them states that a group of it began (:attr:`GroupDeclaration.formed`): they still gather it,
        so a declaration of ours now joins their group. From the declarations pushed to us and one DHT
        read of the round's key."""
        declared = await self._declared_at(group_key(self.run_id, module_id, round_no), digest, pushed=True)
        return bool(declared) and not any(d.formed for d in declared.values())

    async def withdraw(self, module_id: str) -> None:
        """Replace our last declaration for ``module_id`` with a withdrawal (a drain or a release):
        members still gathering that round stop counting on us now."""
        from hivemind.utils import get_dht_time

        key = self._declared.pop(module_id, "")
        self._grouped.pop(module_id, None)
        last = self._stored.last(key) if key else None
        if last is not None and last > get_dht_time():
            await self.dht.store(key, withdrawal(self._own_credential()), self._stored.take(key, last),
                                 subkey=self.peer_id, return_future=True)

    async def _gather(self, module_id: str, round_no: int, looking: Looking, deadline: float, patience: float,
                      wait_for_behind: bool, bucket: Optional[tuple[int, int]] = None
                      ) -> Gathered:
        """What the gather read (:class:`~peer.averaging.group_decision.Gathered`): other members' valid
        declarations, read until every live holder at this round declared or ``deadline``
        (:func:`~peer.averaging.group_decision.gathered`); also the highest round any other live holder announces, the other holders at our
        round, those behind it (peer -> round), every other live holder, and the holders that withdrew
        (peer -> the round they announced when they left). Holders that declared are not counted as ahead,
        unless their record is two or more rounds on (the declaration is an old one).

        A peer that fetched this round's state from us in the last ``patience`` seconds to average it
        (a newcomer, a re-syncing member) counts as a holder at this round even before its holder
        record is visible: a lone holder that stepped alone meanwhile would leave two newcomers to
        average the old state among themselves, a fork. Our declaration lists them, and we wait for
        the peers the other members' declarations list too: a newcomer that leads knows only its own
        source, and would close the group before the other newcomers of that source declared.

        The other members of the group we formed last round are at this round too: each moved on when
        that group formed, and announces so in the background. Their records may still say the last
        round (a store is slow on a busy host, and a pushed declaration ends a gather sooner
        than that): they are waited for as holders at this round, not left behind as holders a round
        behind (which, once the others declared, would split the group and fork the replicas).

        Without ``wait_for_behind`` (overlap mode, where a member with only holders behind it steps
        alone) holders one round behind are also waited for until ``deadline``: their record may lag
        behind their declaration.

        A lone member may apply its own delta only when it is the module's only live holder. With
        holders behind it, it waits for them instead: they re-sync to its state at their next round.
        A member that stepped alone whenever nobody was at its exact round would race ahead by one
        round per inner loop (a cut-off peer does so between a heal and its DHT re-merge) and fork
        every time a lagging record made it think so.

        With a ``bucket`` only the holders of our group this round are waited for (the other returns
        are still about every holder of the module)."""
        waiter = asyncio.Event()  # set when another holder pushes us a declaration (_handle_declare)
        self._push_waiters.add(waiter)
        try:
            return await self._gather_until(module_id, round_no, looking, deadline, patience, wait_for_behind,
                                            bucket, waiter)
        finally:
            self._push_waiters.discard(waiter)

    async def _gather_until(self, module_id: str, round_no: int, looking: Looking, deadline: float,
                            patience: float, wait_for_behind: bool, bucket: Optional[tuple[int, int]],
                            waiter: asyncio.Event
                            ) -> Gathered:
        """:meth:`_gather`'s loop; ``waiter`` is set when a declaration is pushed to us.

        The sticky group: when the other members of the group we formed last round are every live
        holder our last gather read (less than :data:`HOLDERS_REUSE` ago) and each pushes us its
        declarations (:func:`~peer.averaging.group_decision.sticky`), the gather goes on from that read
        and reads nothing for a :data:`PUSHED_POLL`: their pushed declarations of this round, at our
        state and naming no one else, end it with no DHT read at all
        (:func:`~peer.averaging.group_decision.complete`). Anything else (a missing push, another state,
        a peer that read did not return, a holder two rounds on, the deadline) and it reads the DHT as
        any gather does."""
        key = looking.key
        holders, holders_read = None, -math.inf
        news: set[str] = set()  # peers our last read of the holders key does not account for
        explained: set[str] = set()  # those of them seen before that read
        missing = False  # an expected holder had not declared at the last evaluation
        poll, pushed_only = _POLL, False  # pushed_only: every holder we wait for pushes us its declaration
        last = self._holders.last_read(module_id)
        if last is not None and group_decision.sticky(
                round_no, self._grouped.get(module_id, (-1, frozenset())), self._live.get(module_id, frozenset()),
                self.pushers(key), time.monotonic() - last[1], HOLDERS_REUSE, bucket):
            holders, holders_read = last
        unread = holders_read > -math.inf  # no DHT read yet: going on from the last gather's read
        found, reread, read_at = None, False, time.monotonic()
        while True:
            if not unread:
                now = time.monotonic()
                reread = (now - holders_read >= HOLDERS_POLL or bool(news - explained)
                          or (missing and now >= deadline))
                if reread:
                    explained |= news
                found, fresh = await asyncio.gather(
                    self.dht.get(key, latest=True, return_future=True),
                    self.dht.get(holders_key(self.run_id, module_id), latest=True, return_future=True) if reread
                    else asyncio.sleep(0, holders),
                )
                read_at = time.monotonic()
                if reread:
                    holders, holders_read = fresh, read_at
            while True:  # re-evaluated without a DHT read when a declaration is pushed to us
                declared = {}
                for peer, d in records_from_value(found, GroupDeclaration, self.verifier).items():
                    problem = self._mismatch(peer, d.config_hash, d.data_hash, d.wire)
                    if problem:
                        self._refuse_log(peer, problem)
                    elif peer != self.peer_id:
                        declared[peer] = d
                # pushed to us and not yet on the DHT, where a record of the sender's wins: a withdrawal
                # too, unless the push expires after it (the sender declares a round it gave up before)
                on_dht = found.value if found is not None and isinstance(found.value, dict) else {}
                for peer, (d, expires) in self.pushed_until(key).items():  # of our config only (_handle_declare)
                    item = on_dht.get(peer)
                    if peer != self.peer_id and (item is None or (
                            is_withdrawal(getattr(item, "value", None))
                            and expires > getattr(item, "expiration_time", math.inf))):
                        declared[peer] = d
                # an idle holder (a stage server nobody drives) declares no round: nobody waits for it
                records = {p: h for p, h in records_from_value(holders, HolderRecord, self.verifier).items()
                           if p != self.peer_id and not self._mismatch(p, h.config_hash, h.data_hash, h.wire)}
                live = {p: h for p, h in records.items() if not h.idle}
                self._live[module_id] = frozenset(live)
                if reread:
                    self._holders.note_read(module_id, holders, records)
                last_round_no, last_group = self._grouped.get(module_id, (-1, frozenset()))
                # a peer that fetched a state but announces the module idle since (a stage server or
                # trainer nobody drives yet) will not declare: it is no joiner to wait for
                idle = frozenset(p for p, h in records.items() if h.idle)
                joiners = self._own_joiners(module_id, round_no, patience, bucket) - idle
                if not joiners <= looking.expecting:  # tell the others whom to wait for
                    if looking.storing is not None:  # after the first store
                        await asyncio.wait([looking.storing])
                    looking.expires = self._stored.take(key, looking.expires)  # past the first: it replaces it
                    await self._declare(looking, looking.expecting | joiners, module_id)
                rounds = {p: h.round_no for p, h in live.items()}
                if unread:  # the read may be rounds old: the last round's members went on with us since
                    rounds.update({p: round_no for p in last_group if p in rounds})
                seen = group_decision.survey(module_id, round_no, looking.digest, self.peer_id, declared, rounds, joiners,
                                             last_group if last_round_no == round_no - 1 else frozenset(), bucket,
                                             idle)
                expected, ahead, behind = seen.expected, seen.ahead, seen.behind
                # a declaration of a peer the read did not return (a newcomer), or a holder that pushed us a
                # later round (it went on): the holders key is read again at the next poll
                news = (set(declared) - set(records)) | self._gone_on(key, set(records)) | self.strangers(key)
                missing = not expected <= set(declared)
                waiting = None if wait_for_behind else self._holders.still_waiting(module_id, behind, patience)
                done = group_decision.gathered(module_id, round_no, seen, declared, waiting, time.monotonic(),
                                               deadline, bucket)
                if unread:  # the members' pushed declarations end it, or the DHT is read (news, the deadline)
                    if not news and group_decision.complete(module_id, round_no, seen, declared, waiting,
                                                            looking.digest, bucket):
                        done = True
                    elif news or done:
                        unread = False
                        break
                if done and missing and holders_read < deadline <= time.monotonic():
                    break  # the decision without a silent holder is taken on a read of the holders after the deadline
                if done:
                    silent = sorted(expected - set(declared))
                    if silent:
                        log.info("%s: holders %s did not declare by the gather deadline", key, ", ".join(silent))
                    gone = withdrawn_rounds(holders, self.config_hash, self.data_hash, self.verifier)
                    gone.pop(self.peer_id, None)
                    if any(d.sparse for d in declared.values()):
                        self.sparse_seen[module_id] = max(round_no, self.sparse_seen.get(module_id, -1))
                    return Gathered(declared, ahead, expected, behind, set(live), gone)
                # a declaration pushed to us meanwhile is counted at once; else the DHT is read again, less
                # and less often while the holders we wait for push us theirs
                waited_for = (expected | seen.next_round | set(waiting or ())) - set(declared)
                pushed_only = waited_for <= self.pushers(key)
                interval = PUSHED_POLL if unread else poll if pushed_only else _POLL
                waiter.clear()
                try:
                    await asyncio.wait_for(waiter.wait(), min(read_at + interval, deadline) - time.monotonic())
                except asyncio.TimeoutError:
                    unread = False
                    break
            poll = min(2 * poll, PUSHED_POLL) if pushed_only else _POLL
