"""Who forms a module's averaging group at a round, decided from what its holders declared.

Pure functions of plain data: the declarations read (:class:`~peer.network.records.GroupDeclaration`,
by peer), the rounds the live holders' records announce, state digests, the time now (passed in, never
read) and how long to wait. No DHT, no P2P, no asyncio, no logging: as torchft's ``quorum_compute``
decides a quorum from the members' requests, :class:`peer.averaging.matchmaking.Matchmaker` reads the
records, calls these, logs what they report and acts (leads, follows, re-syncs).

- :func:`survey` and :func:`gathered`: whom a gather waits for, and when it stops reading;
  :func:`sticky` and :func:`complete`: when a gather may go on from the last one's read of the holders
  and end on the declarations pushed to it, with no DHT read at all (the sticky group).
- :func:`decide`: after the gather, fail the round (a :class:`Match` saying why), step alone, lead or
  follow; a fork is kept by :func:`resolve_fork` (the state most holders declared).
- :func:`still_waiting`, :func:`vanished`, :func:`missed`: the holders behind us worth waiting for, those
  whose record vanished, and those a partial DHT read missed; each takes what the matchmaker kept of
  earlier reads and returns what to keep now.
- :func:`decide_top`: the top group of a split round (:mod:`peer.averaging.hierarchy`).
"""

from __future__ import annotations

import math
from collections import Counter
from typing import AbstractSet, Mapping, NamedTuple, Optional

from peer.averaging.partition import Group
from peer.network import GroupDeclaration, group_bucket

__all__ = ["LONE", "Match", "Fork", "Waiting", "Survey", "Gathered", "Decision", "in_bucket", "behind_a_formed_group",
           "resolve_fork", "still_waiting", "vanished", "missed", "fresh_source", "survey", "gathered", "sticky",
           "complete", "decide", "past_the_archive", "leader_of", "decide_top"]

LONE = "lone"
"""Marker group id of a member that is the only holder of its module this round."""


class Match(NamedTuple):
    """The outcome of one member's matchmaking for one (module, round)."""

    group: Optional[Group]
    """The formed group (``group_id == LONE`` when we are the only holder), or None."""
    reason: str
    """Why there is no group, or who was dropped ('' when all went well)."""
    adopt: str = ""
    """Set when other holders at this round hold another state and theirs is kept: its digest."""
    ahead: int = -1
    """Set when there is no group because other holders applied rounds we missed: the round they are
    at (a live holder, one that left, or the archive); -1 otherwise."""
    ahead_left: bool = False
    """With ``ahead``: the holders that were there left (withdrawn): no live holder has that state."""


def in_bucket(module_id: str, round_no: int, peer_id: str, bucket: Optional[tuple[int, int]]) -> bool:
    """Whether ``peer_id`` averages ``module_id``'s round ``round_no`` in ``bucket`` = (b, k) (always,
    without a bucket: one group a module)."""
    return bucket is None or group_bucket(module_id, round_no, peer_id, bucket[1]) == bucket[0]


def behind_a_formed_group(leaders: list[str], round_no: int) -> Match:
    """The failed :class:`Match` of a member that finds round ``round_no``'s group begun without it (led
    by ``leaders``): behind it, it re-syncs to the round that group applies."""
    return Match(None, f"behind: {', '.join(p[-8:] for p in leaders)} began this round's group without us; "
                       "re-sync to the round it applies", ahead=round_no + 1)


class Fork(NamedTuple):
    """Holders at our round that declared another state than ours, and the state kept."""

    kept: str
    """The digest declared by the most holders, us included (ties: the larger digest)."""
    holding: int
    """How many holders, us included, hold ``kept``."""
    total: int
    """How many holders declared, us included."""
    others: tuple[str, ...]
    """The peers whose declared digest differs from ours, sorted."""

    def match(self, digest: str) -> Optional[Match]:
        """None when ours (``digest``) is kept; else the failed :class:`Match` that re-syncs us to ``kept``."""
        if self.kept == digest:
            return None
        return Match(None, f"forked: {self.holding} of {self.total} holders at this round hold state "
                           f"{self.kept}, ours is {digest or '(none)'}; re-syncing to theirs", adopt=self.kept)


def resolve_fork(digest: str, everyone: Mapping[str, GroupDeclaration]) -> Optional[Fork]:
    """None when every declared holder (``everyone``, us not among them) has our state ``digest``; else
    the :class:`Fork`: the state declared by the most holders (us included) is kept, ties going to the
    larger digest, the same choice on every peer whatever order the declarations were read in."""
    counts = Counter(d.digest for d in everyone.values())
    if set(counts) <= {digest}:
        return None
    counts[digest] += 1  # ourselves
    kept = max(counts, key=lambda k: (counts[k], k))
    return Fork(kept, counts[kept], sum(counts.values()), tuple(sorted(p for p, d in everyone.items()
                                                                       if d.digest != digest)))


class Waiting(NamedTuple):
    """:func:`still_waiting`'s answer."""

    waiting: dict[str, int]
    """The holders behind us still worth waiting for -> the round their record announces."""
    since: dict[str, tuple[int, float, bool]]
    """What to keep for the next call: holder behind us -> (the round its record announces, when we began
    waiting for it, whether we gave up on it)."""
    given_up: list[str]
    """The holders given up on now, sorted (each is reported once, until its record moves)."""


def still_waiting(behind: Mapping[str, int], since: Mapping[str, tuple[int, float, bool]], now: float,
                  patience: float) -> Waiting:
    """The holders ``behind`` us (peer -> the round its record announces) worth waiting for: those whose
    record announced a new round less than ``patience`` seconds before ``now``. One that does not end
    its round in that time (idle, stuck, or gone with its record not yet expired) stops holding us back
    until its record moves again. ``since``: what the last call returned to keep."""
    kept = {p: s for p, s in since.items() if p in behind}
    waiting, given_up = {}, []
    for peer, round_no in behind.items():
        seen = kept.get(peer)
        if seen is None or seen[0] != round_no:
            seen = kept[peer] = (round_no, now, False)
        if now - seen[1] < patience:
            waiting[peer] = round_no
        elif not seen[2]:
            kept[peer] = (round_no, seen[1], True)
            given_up.append(peer)
    return Waiting(waiting, kept, sorted(given_up))


def vanished(seen: Mapping[str, float], live: set[str], gone: Mapping[str, int], now: float,
             patience: float) -> tuple[dict[str, float], dict[str, float]]:
    """Holders whose record we read less than ``patience`` seconds before ``now`` and no longer read
    (not in ``live``), with no withdrawal in its place (not in ``gone``): cut off from us by a partition,
    or dead; each with when we last read its record. ``seen``: holder -> when we last read its record,
    as the last call returned it; returned again with ``live`` read now and those that left or stayed
    silent for ``patience`` forgotten. Why it matters: :meth:`peer.averaging.holder_memory.HolderMemory.vanished`."""
    kept = {**seen, **{p: now for p in live}}
    out = {}
    for peer, last in list(kept.items()):
        if peer in live:
            continue
        if peer in gone or now - last >= patience:
            del kept[peer]  # it left, or stayed silent long enough
        else:
            out[peer] = last
    return out, kept


def missed(vanished: Mapping[str, float], gone: Mapping[str, int], read: frozenset[str],
           valid_until: Mapping[str, float], now: float) -> tuple[dict[str, float], dict[str, float]]:
    """Of the ``vanished`` holders, those our last read of the holders key (``read``: every subkey it
    returned) did not return while their record, as we last read it, is valid after ``now``
    (``valid_until``: holder -> its DHT expiration) and was not withdrawn (``gone``): our read missed it.
    Peer -> seconds its record stays valid; and ``valid_until`` without the expired and withdrawn."""
    kept = {p: until for p, until in valid_until.items() if until > now and p not in gone}
    return {p: kept[p] - now for p in vanished if p not in read and p in kept}, kept


def fresh_source(source: Optional[tuple[str, int, float]], round_no: int, live: set[str], now: float,
                 patience: float) -> str:
    """The live holder we fetched round ``round_no``'s state from less than ``patience`` seconds before
    ``now``, or ''. ``source``: (the peer we last fetched from, the round of that state, when), or None."""
    if source is None or source[1] != round_no or source[0] not in live:
        return ""
    return source[0] if now - source[2] < patience else ""


class Survey(NamedTuple):
    """One evaluation of a gather: whom it waits for and where the others are."""

    expected: set[str]
    """The holders at our round (or joiners of it) of our bucket: the gather waits for each to declare."""
    ahead: int
    """The highest round another live holder is at (-1: none), declared holders excepted (see :func:`survey`)."""
    next_round: set[str]
    """Holders of our bucket one round on that did not declare: overlap members about to declare ours."""
    behind: dict[str, int]
    """Holders behind our round that did not declare and are not expected -> their round."""


def survey(module_id: str, round_no: int, digest: str, me: str, declared: Mapping[str, GroupDeclaration],
           rounds: Mapping[str, int], joiners: frozenset[str] = frozenset(), last_group: frozenset[str] = frozenset(),
           bucket: Optional[tuple[int, int]] = None, idle: frozenset[str] = frozenset()) -> Survey:
    """What one read of the declarations (``declared``, ours not among them) and of the live holders'
    records (``rounds``: peer -> the round its record announces, ours not among them) says about round
    ``round_no``. ``joiners``: the peers that fetched this round's state from us to average it;
    ``last_group``: the other members of the group we formed at the round before this one (empty when
    we formed none). With a ``bucket`` only the holders of our group this round are waited for.
    ``idle``: holders whose record announces the module idle (a stage server nobody drives): never
    expected, even as a joiner ours or another's declaration names (it declares no round while idle).

    Expected: the holders at our round, the members of our last group (their records may still say
    that round) and the joiners, ours and those the declarations at our ``digest`` list, unless their
    record already shows them past our round. A holder that declared this round is at this round,
    whatever its record says (an overlap member announces its next round while this one's exchange
    runs), unless its record is two or more rounds on: that declaration is an old one, not yet
    expired (a holder that waited for us at this round while we were cut off, then went on). One a
    single round ahead that has not declared may be such a member about to declare: it is waited for
    (``next_round``). In a split round the holders of other buckets announce the next round once their own
    group formed: one round ahead of us in another bucket is not ahead of the round."""
    mine = (lambda p: in_bucket(module_id, round_no, p, bucket))
    expected = {p for p, r in rounds.items() if mine(p) and (r == round_no or (r == round_no - 1 and p in last_group))}
    told = {p for d in declared.values() if d.digest == digest for p in d.expecting}
    expected |= {p for p in joiners | told if p != me and p not in idle and not (p in rounds and rounds[p] > round_no)
                 and mine(p)}
    ahead = max((r for p, r in rounds.items() if (p not in declared or r > round_no + 1)
                 and (mine(p) or r != round_no + 1)), default=-1)
    next_round = {p for p, r in rounds.items() if r == round_no + 1 and p not in declared and mine(p)}
    behind = {p: r for p, r in rounds.items() if r < round_no and p not in declared and p not in expected}
    return Survey(expected, ahead, next_round, behind)


def gathered(module_id: str, round_no: int, seen: Survey, declared: Mapping[str, GroupDeclaration],
             waiting: Optional[Mapping[str, int]], now: float, deadline: float,
             bucket: Optional[tuple[int, int]] = None) -> bool:
    """Whether a gather stops reading: every expected holder declared and none of our bucket is one
    round on undeclared nor (``waiting``: :func:`still_waiting`'s holders, in overlap mode; None
    otherwise) one round behind and still waited for; or ``deadline`` passed; or a holder is two or
    more rounds on (we are behind the group)."""
    last_round = {p for p, r in (waiting or {}).items()
                  if r == round_no - 1 and in_bucket(module_id, round_no, p, bucket)}
    return ((seen.expected <= set(declared) and not seen.next_round and not last_round) or now >= deadline
            or seen.ahead > round_no + 1)


def sticky(round_no: int, last_group: tuple[int, frozenset[str]], live: AbstractSet[str], pushers: AbstractSet[str],
           read_age: float, max_age: float, bucket: Optional[tuple[int, int]] = None) -> bool:
    """Whether a gather of round ``round_no`` may go on from the last gather's read of the module's
    holders, ``read_age`` seconds old, instead of reading the DHT first: we formed the group of the
    round before (``last_group``: its round and its other members), every other live holder that read
    returned (``live``) was in that group, every member of it pushes us its declarations (``pushers``),
    and the read is younger than ``max_age`` (how stale our view of who else holds the module may grow:
    the other side of a healed partition shows only in a read). Never in a split round."""
    last_round, members = last_group
    return (bucket is None and last_round == round_no - 1 and bool(members) and live <= members
            and members <= pushers and read_age < max_age)


def complete(module_id: str, round_no: int, seen: Survey, declared: Mapping[str, GroupDeclaration],
             waiting: Optional[Mapping[str, int]], digest: str, bucket: Optional[tuple[int, int]] = None) -> bool:
    """Whether a :func:`sticky` gather, which read no DHT record, may stop on what was pushed to it: every
    holder it waits for declared (:func:`gathered` but for its deadline), none is two rounds on, and
    every declaration states our ``digest`` (another state is a fork, decided on every declaration
    the DHT holds). Otherwise it reads the DHT as any gather."""
    return (gathered(module_id, round_no, seen, declared, waiting, -math.inf, math.inf, bucket)
            and seen.ahead <= round_no + 1 and all(d.digest == digest for d in declared.values()))


class Gathered(NamedTuple):
    """What a gather read (:meth:`peer.averaging.matchmaking.Matchmaker._gather`)."""

    everyone: dict[str, GroupDeclaration]
    """Other members' valid declarations, whatever their digest."""
    ahead: int
    """The highest round any other live holder announces (:attr:`Survey.ahead`)."""
    same_round: set[str]
    """The other holders at our round (:attr:`Survey.expected`)."""
    behind: dict[str, int]
    """Holders behind our round -> their round (:attr:`Survey.behind`)."""
    live: set[str]
    """Every other live holder."""
    gone: dict[str, int]
    """Holders that withdrew -> the round they announced when they left."""


class Decision(NamedTuple):
    """:func:`decide`'s answer: a :class:`Match` now, or whom to lead or follow."""

    match: Optional[Match] = None
    """The outcome when we neither lead nor follow: a failed round, or a ``LONE`` group."""
    leader: str = ""
    """Who leads the group (us: we lead) when ``match`` is None."""
    members: frozenset[str] = frozenset()
    """The other declared members at our state: whom the leader waits for."""
    check_archive: bool = False
    """``match`` is a step alone, unless the archive keeps a later round (:func:`past_the_archive`)."""
    fork: Optional[Fork] = None
    """A fork whose kept state is ours (the others re-sync to it): reported, not a failure."""
    waited: Optional[Waiting] = None
    """:func:`still_waiting`'s answer when it was asked (its ``since`` to keep, its ``given_up`` to report)."""


def leader_of(me: str, bandwidth: float, declared: Mapping[str, GroupDeclaration]) -> str:
    """The smallest peer id among ``declared`` and us that accepts connections (bandwidth > 0), or ''."""
    candidates = {p for p, d in declared.items() if d.bandwidth > 0} | ({me} if bandwidth > 0 else set())
    return min(candidates) if candidates else ""


def decide(me: str, bandwidth: float, round_no: int, digest: str, read: Gathered, *,
           vanished: Mapping[str, float], missed: Mapping[str, float], now: float, patience: float,
           wait_for_behind: bool = True, waited: Optional[Mapping[str, tuple[int, float, bool]]] = None,
           in_touch_since: Optional[float] = None, bucket: Optional[tuple[int, int]] = None) -> Decision:
    """Decide our side of round ``round_no`` from what the gather ``read``, in this order:

    1. A live holder (or one that left, ``read.gone``) at a later round: we are behind; re-sync first.
    2. Another state at our round (:func:`resolve_fork`): unless ours is kept, re-sync to the kept one.
    3. A holder ``missed`` by our read (valid record, not withdrawn): no group without it.
    4. A group of this round that began without us (:attr:`GroupDeclaration.formed`): we are behind it.
    5. Nobody else declared at our state: a holder at our round that did not declare fails the round;
       in a ``bucket`` we are ``LONE`` there; else we wait for holders behind us (:func:`still_waiting`,
       with ``waited`` as kept), and for holders that ``vanished`` while we were out of touch with the
       coordinator (``in_touch_since``: since when it has answered us, None when it does not); else we
       step alone, unless the archive keeps a later round (``check_archive``).
    6. Otherwise the smallest declared peer id that accepts connections leads (:func:`leader_of`)."""
    left = max(read.gone.values(), default=-1)
    if read.ahead > round_no:
        # the group applied rounds we missed: averaging now would fork the replicas
        return Decision(Match(None, f"behind: other holders are at round {read.ahead}; re-sync from them first",
                              ahead=read.ahead))
    if left > round_no:
        # holders that left (a drain, a restart, a reassignment) had applied rounds we missed:
        # stepping now, alone or with others as far behind, would make a second state at those
        # round numbers. Their withdrawals expire within the holder records' lifetime.
        return Decision(Match(None, f"behind: holders that left were at round {left}; re-sync to it first", ahead=left,
                              ahead_left=True))
    declared = {p: d for p, d in read.everyone.items() if d.digest == digest}
    fork = resolve_fork(digest, read.everyone)
    if fork is not None and fork.kept != digest:
        return Decision(fork.match(digest))
    if missed:  # its record is still on the DHT: our read missed it, the holder did not leave
        names = ", ".join(p[-8:] for p in sorted(missed))
        return Decision(Match(None, f"holders {names} are missing from our read of the DHT while their records are "
                                    f"valid for up to {max(missed.values()):.0f}s more: not averaging without them "
                                    "(they may be at this round)"), fork=fork)
    formed = sorted(p for p, d in declared.items() if d.formed) if bucket is None else []
    if formed:
        # a group of this round began without us: a group of the rest would apply a second average
        # under this round's number; behind it, we re-sync to the round it applies
        return Decision(behind_a_formed_group(formed, round_no), fork=fork)
    if not declared:
        silent = read.same_round - set(read.everyone)
        if silent:  # applying our delta alone would fork us from them
            return Decision(Match(None, f"holders {', '.join(sorted(silent))} at this round did not declare in time"),
                            fork=fork)
        if bucket is not None:  # the top group decides whether the round goes ahead
            return Decision(Match(Group(LONE, (me,), (bandwidth,), 0.0), f"alone in group {bucket[0]}"), fork=fork)
        asked = still_waiting(read.behind, waited or {}, now, patience) if wait_for_behind else None
        if asked is not None and asked.waiting:
            # they re-sync to us at their next round; stepping alone would keep us out of reach
            rounds = ", ".join(f"{p[-8:]} at round {r}" for p, r in sorted(asked.waiting.items()))
            return Decision(Match(None, f"waiting for holders behind us to catch up ({rounds})"), fork=fork,
                            waited=asked)
        if vanished and (in_touch_since is None or in_touch_since > min(vanished.values())):  # we may be cut off
            names = ", ".join(p[-8:] for p in sorted(vanished))
            return Decision(Match(None, f"holders {names} vanished without leaving while we were out of touch with "
                                        f"the coordinator (cut off?): not stepping alone for {patience:.0f}s after "
                                        "they were last seen"), fork=fork, waited=asked)
        gave_up = sorted(p for p in read.behind if p != me)
        reason = f"holders behind us did not catch up ({', '.join(p[-8:] for p in gave_up)})" if gave_up else ""
        return Decision(Match(Group(LONE, (me,), (bandwidth,), 0.0), reason), check_archive=True, fork=fork,
                        waited=asked)
    leader = leader_of(me, bandwidth, declared)
    if not leader:
        return Decision(Match(None, "no member of the group accepts connections (all in client mode)"), fork=fork)
    return Decision(leader=leader, members=frozenset(declared), fork=fork)


def past_the_archive(archived: int, round_no: int) -> Optional[Match]:
    """The failed :class:`Match` of a member about to step round ``round_no`` alone while the archive keeps
    round ``archived`` (-1: none), a later one (its holders left since); None when it does not."""
    if archived > round_no:
        return Match(None, f"behind: the archive keeps round {archived}; re-sync from it first", ahead=archived)
    return None


def decide_top(me: str, bandwidth: float, declared: Mapping[str, GroupDeclaration], buckets: int,
               need: int) -> Decision:
    """Our side of a split round's top group (or of a level between the buckets and the top) from the
    delegates that ``declared`` at our state, ours not among them: a group of fewer than ``need``
    delegates, us included, is no group (two top groups of one round, each applying another mean,
    would fork the replicas; only one can hold a majority of the ``buckets``); alone where one is
    enough (``LONE``: we carry our mean up alone); else the smallest peer id that accepts connections leads."""
    if len(declared) + 1 < need:
        return Decision(Match(None, f"top group: {len(declared) + 1} of {buckets} groups' delegates declared "
                                    f"(a mean of fewer than {need} could fork the replicas)"))
    if not declared and need <= 1:
        return Decision(Match(Group(LONE, (me,), (bandwidth,), 0.0), "alone at this level"))
    leader = leader_of(me, bandwidth, declared)
    if not leader:
        return Decision(Match(None, "top group: no delegate accepts connections (all in client mode)"))
    return Decision(leader=leader, members=frozenset(declared))
