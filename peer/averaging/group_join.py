"""The leader/follower protocol that turns the declared members of one (module, round) into one group.

Every member of a formed group gets the same membership from one leader (hivemind-style
leader/follower matchmaking over the DHT, Ryabinin et al. 2021, made consistent). Once
:class:`peer.averaging.matchmaking.Matchmaker` has gathered the declared members and picked the leader
(the smallest peer id among the declared members that accept connections):

- Followers join it over P2P (:class:`protos.hivepath.peer.v1.net_pb2.JoinRequest`); a peer that follows
  someone else answers ``NOT_A_LEADER`` with its leader, and the follower retries there.
- The leader closes the group when every declared member has joined, or at its deadline, and sends
  the same sorted member list to each follower (``BEGIN``). A member that joined nobody, or whose
  leader never began, fails the round and keeps its local progress. A follower the leader accepted
  waits for ``BEGIN`` past its own join deadline, since the leader counts it in.
- A leader refuses a group whose members all fetched this round's state from holders none of which
  is in it (they would average the old state between them, a second lineage at the same round numbers).

Join requests of another config or dataset hash, of another state digest, or (with a ``verifier``)
without a valid credential bound to the libp2p sender are refused; a follower refuses a leader whose
replies do not carry the leader's own valid credential. Every refusal is logged once per (peer, reason).
"""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, NamedTuple, Optional, Union

from peer.averaging.compat import wire_key
from peer.averaging.partition import Group
from peer.network import CredentialProvider, CredentialVerifier
from peer.network.frames import STREAM_CUT, handler_name, log_limited, serve_messages
from protos import versions
from protos.hivepath.peer.v1.net_pb2 import DESCRIPTOR as NET, JoinReply, JoinRequest

JOIN = NET.services_by_name["Averaging"].methods_by_name["Join"]

__all__ = ["GroupJoin", "Looking", "Follower"]

log = logging.getLogger(__name__)

CUT_STREAM = object()
"""What :meth:`GroupJoin._read_replies` returns when the leader's stream ended before BEGIN or a refusal:
a leader never closes it so, so the stream was cut (a relay resets a relayed connection after 128 KiB)."""

MAX_JOIN_CUTS = 5
"""Most times a follower joins a leader again after a cut stream, within one round's join deadline."""

_BEGIN_LINGER = 10.0
"""Seconds a leader keeps a follower's stream open after BEGIN, unless the follower closes it first."""


class Follower(NamedTuple):
    """A follower the leader accepted."""

    bandwidth: float
    future: "asyncio.Future[Optional[Group]]"
    """Resolved with the group the leader begins (None: it gave up)."""
    fetched_from: str
    """Its ``JoinRequest.fetched_from``."""
    relayed: bool = False
    """Its ``JoinRequest.relayed``: it can be dialled only through a relay."""
    weight: float = 0.0
    """Its ``JoinRequest.weight``: the tokens behind its contribution (0: not said)."""


@dataclass
class Looking:
    """One member's matchmaking of one (module, round), from its declaration until the group forms."""

    key: str
    digest: str = ""
    decided: asyncio.Event = field(default_factory=asyncio.Event)
    leader: Optional[str] = None
    """None while gathering or when we lead; else the peer we follow."""
    closed: bool = False
    followers: dict[str, Follower] = field(default_factory=dict)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    fetched_from: str = ""
    """The live holder we fetched this round's state from ('' when the state is our own)."""
    expecting: frozenset[str] = frozenset()
    """The joiners our stored declaration lists."""
    expires: float = 0.0
    """DHT expiration time of our declaration."""
    paced: bool = False
    """We ended this round early because another holder waited (:attr:`GroupDeclaration.paced`)."""
    sparse: bool = False
    """Our steps are far apart, so we answered paced holders too (:attr:`GroupDeclaration.sparse`)."""
    weight: float = 0.0
    """The tokens behind our contribution, said in our join request (0: not said)."""
    storing: Optional["asyncio.Future[None]"] = None
    """The DHT store of our first declaration, while it runs behind the gather (its push came first)."""


class GroupJoin:
    """This peer's side of the leader/follower protocol, for every (module, round) it matchmakes.

    ``credential`` returns this peer's current credential; ``verifier`` checks everyone else's (both
    None: an open run, no admission checks). :meth:`start` registers the ``{prefix}_join`` handler.
    """

    def __init__(self, p2p: Any, peer_id: str, config_hash: str, data_hash: str, bandwidth: float, prefix: str,
                 credential: Optional[CredentialProvider] = None, verifier: Optional[CredentialVerifier] = None,
                 relayed: bool = False):
        self.p2p = p2p
        self.relayed = relayed
        """We can be dialled only through a circuit relay (behind NAT): the groups we are in say so."""
        self.peer_id = peer_id
        self.config_hash = config_hash
        self.data_hash = data_hash
        self.bandwidth = bandwidth
        self.prefix = prefix
        self.handler_name = handler_name(prefix, JOIN)
        self._looking: dict[str, Looking] = {}
        self._begun: dict[str, Group] = {}
        """Group key -> the group we led and began, kept for its all-reduce's time: a follower whose
        stream was cut before it read BEGIN (a relay's reset) joins again and is sent the same group."""
        self.credential = credential
        self.verifier = verifier
        self.wire = wire_key()
        """Our averaging bytes key (:func:`peer.averaging.compat.wire_key`): we group only with equal ones."""

    def _own_credential(self) -> bytes:
        return self.credential() if self.credential is not None else b""

    async def start(self) -> None:
        await serve_messages(self.p2p, self.prefix, JOIN, self._handle_join)

    def _mismatch(self, who: str, config_hash: str, data_hash: str, wire: Optional[str] = None) -> str:
        """Why ``who`` cannot average with us ('' when it can): another config or dataset, or (``wire``:
        its averaging bytes key, None where it states none) bytes that differ from ours."""
        if config_hash != self.config_hash:
            return f"config hash {config_hash} of {who} differs from ours {self.config_hash}"
        if data_hash != self.data_hash:
            return f"dataset hash {data_hash or '(none)'} of {who} differs from ours {self.data_hash or '(none)'}"
        if wire is not None and wire != self.wire:
            return (f"averaging bytes {wire or '1.0'} of {who} differ from ours {self.wire or '1.0'} (releases whose "
                    "exchanges give other bytes average in separate groups)")
        return ""

    def _refuse_log(self, who: str, problem: str) -> None:
        log_limited(log, f"join:{who}", "not grouping with %s: %s", who, problem)

    # -- leader side --------------------------------------------------------------------------

    async def _handle_join(self, request: JoinRequest, context: Any) -> AsyncIterator[JoinReply]:
        sender = context.remote_id.to_base58()
        mine = self._own_credential()
        if self.verifier is not None:
            problem = self.verifier.check(request.credential, sender)
            if problem:
                self.verifier.log_refusal(sender, "a matchmaking join", problem)
                yield JoinReply(code=JoinReply.REFUSED, reason=f"not admitted: {problem}", credential=mine)
                return
        problem = (versions.refusal("averaging", request.protocol, who=f"joining peer {sender[-8:]}", us="this peer")
                   or self._mismatch(sender, request.config_hash, request.data_hash, request.wire))
        if problem:
            self._refuse_log(sender, problem)
            yield JoinReply(code=JoinReply.REFUSED, reason=problem, credential=mine)
            return
        looking = self._looking.get(request.group_key)
        begun = self._begun_with(request.group_key, sender)
        if begun is not None:  # its stream was cut before it read BEGIN
            yield self._begin_reply(begun, mine)
            await asyncio.sleep(_BEGIN_LINGER)
            return
        if looking is None:
            yield JoinReply(code=JoinReply.REFUSED, reason="not looking for this group (formed or not started)",
                            credential=mine)
            return
        if request.state_digest != looking.digest:
            yield JoinReply(code=JoinReply.REFUSED, credential=mine,
                            reason=f"forked: state {request.state_digest or '(none)'} differs from ours {looking.digest}")
            return
        await looking.decided.wait()
        if looking.leader is not None:
            yield JoinReply(code=JoinReply.NOT_A_LEADER, suggested_leader=looking.leader, credential=mine)
            return
        if looking.closed:
            begun = self._begun_with(request.group_key, sender)  # it began while we waited
            if begun is not None:
                yield self._begin_reply(begun, mine)
                await asyncio.sleep(_BEGIN_LINGER)
                return
            yield JoinReply(code=JoinReply.REFUSED, reason="the group already began", credential=mine)
            return
        future: asyncio.Future[Optional[Group]] = asyncio.get_running_loop().create_future()
        earlier = looking.followers.get(sender)
        if earlier is not None and not earlier.future.done():  # its earlier stream was cut: end that handler
            earlier.future.set_result(None)
        weight = request.weight if math.isfinite(request.weight) and request.weight > 0 else 0.0
        looking.followers[sender] = Follower(max(0.0, request.bandwidth), future, request.fetched_from,
                                             bool(request.relayed), weight)
        looking.changed.set()
        yield JoinReply(code=JoinReply.ACCEPTED, credential=mine)
        group = await future
        if group is None:
            yield JoinReply(code=JoinReply.REFUSED, reason="the leader gave up", credential=mine)
            return
        yield self._begin_reply(group, mine)
        # Returning now would close the stream at once, and the daemon can drop a reply still in
        # flight: the follower would miss BEGIN while we count it in. It closes the stream once it
        # has read BEGIN, which cancels this wait.
        await asyncio.sleep(_BEGIN_LINGER)

    def _gone_on(self, key: str, members: set[str]) -> set[str]:
        """Those of ``members`` known to have declared a later round of ``key``'s module (none here;
        :class:`peer.averaging.declaration_push.DeclarationPush` knows the declarations pushed to it)."""
        return set()

    def _begun_with(self, key: str, member: str) -> Optional[Group]:
        """The group we began for ``key`` if ``member`` is in it (it joins again: its stream was cut)."""
        group = self._begun.get(key)
        return group if group is not None and member in group.members else None

    @staticmethod
    def _begin_reply(group: Group, credential: bytes) -> JoinReply:
        return JoinReply(code=JoinReply.BEGIN, group_id=group.group_id, members=list(group.members),
                         bandwidths=list(group.bandwidths), allreduce_timeout=group.allreduce_timeout,
                         credential=credential, relayed=list(group.relayed), weights=list(group.weights))

    async def _lead(self, looking: Looking, others: set[str], close_deadline: float, end: float,
                    min_members: int = 2, check_sources: bool = True,
                    before_begin: Optional[Callable[[set[str]], Awaitable[str]]] = None
                    ) -> tuple[Optional[Group], str]:
        """Wait for the declared ``others`` to join until ``close_deadline``, then begin the group (its
        all-reduce may run until ``end``) if it has ``min_members`` members (us included), else give
        up; with ``check_sources``, also when every member fetched this round's state from holders none
        of which joined (see the module). A declared member known to have gone on to a later round
        (:meth:`_gone_on`) is not waited for. When a declared member did not join, ``before_begin(members)``
        may still give a reason not to begin (the group's members are told we gave up)."""
        declared = sorted(others)
        while True:
            others = others - self._gone_on(looking.key, others)
            if others <= set(looking.followers) or time.monotonic() >= close_deadline:
                break
            looking.changed.clear()
            try:
                await asyncio.wait_for(looking.changed.wait(), max(0.0, close_deadline - time.monotonic()))
            except asyncio.TimeoutError:
                break
        looking.closed = True
        followers = dict(looking.followers)
        if not followers:
            return None, f"no declared member ({', '.join(declared)}) joined us"
        if len(followers) + 1 < min_members:
            for f in followers.values():  # they are told the leader gave up
                if not f.future.done():
                    f.future.set_result(None)
            return None, f"only {len(followers) + 1} members joined, {min_members} needed"
        members = tuple(sorted([self.peer_id, *followers]))
        if before_begin is not None and set(declared) - set(followers):
            refused = await before_begin(set(members))
            if refused:
                for f in followers.values():
                    if not f.future.done():
                        f.future.set_result(None)
                return None, refused
        sources = {looking.fetched_from, *(f.fetched_from for f in followers.values())}
        if check_sources and "" not in sources and not sources & set(members):
            # every member just fetched this round's state from holders that are not here: they may have
            # stepped on already, and this group would be a second lineage at the same round numbers
            return None, (f"every member fetched this round's state from {', '.join(sorted(p[-8:] for p in sources))}, "
                          "none of which joined: re-sync to them instead of averaging their old state")
        bw = {self.peer_id: self.bandwidth, **{p: f.bandwidth for p, f in followers.items()}}
        relayed = {self.peer_id: self.relayed, **{p: f.relayed for p, f in followers.items()}}
        weights = {self.peer_id: looking.weight, **{p: f.weight for p, f in followers.items()}}
        group = Group(f"{looking.key}-{self.peer_id[-8:]}-{secrets.token_hex(4)}", members,
                      tuple(bw[p] for p in members), max(0.1, end - time.monotonic()),
                      tuple(relayed[p] for p in members) if any(relayed.values()) else (),
                      tuple(weights[p] for p in members) if any(weights.values()) else ())
        for f in followers.values():
            if not f.future.done():
                f.future.set_result(group)
        self._begun[looking.key] = group
        asyncio.get_running_loop().call_later(group.allreduce_timeout, self._begun.pop, looking.key, None)
        missing = sorted(others - set(followers))
        return group, (f"dropped {', '.join(missing)} (did not join)" if missing else "")

    async def _follow(self, key: str, leader: str, deadline: float, begin_deadline: float,
                      digest: str, fetched_from: str, weight: float = 0.0) -> tuple[Optional[Group], str]:
        """Join ``leader`` by ``deadline``. Once it accepted us, it counts us in the group it begins,
        so we wait for its BEGIN until ``begin_deadline``: the leader's round may have started seconds
        after ours, and giving up earlier would leave the others waiting for our part until their
        all-reduce deadline."""
        accepted = asyncio.Event()
        task = asyncio.ensure_future(self._follow_unbounded(key, leader, digest, fetched_from, accepted, weight))
        try:
            done, _ = await asyncio.wait({task}, timeout=max(0.01, deadline - time.monotonic()))
            if not done and accepted.is_set():
                done, _ = await asyncio.wait({task}, timeout=max(0.01, begin_deadline - time.monotonic()))
            if not done:
                return None, f"leader {leader} did not begin before the deadline"
            return task.result()
        except Exception as e:
            return None, f"joining leader {leader} failed: {type(e).__name__}: {e}"
        finally:
            if not task.done():
                task.cancel()

    async def _follow_unbounded(self, key: str, leader: str, digest: str, fetched_from: str,
                                accepted: asyncio.Event, weight: float = 0.0) -> tuple[Optional[Group], str]:
        from hivemind.p2p import PeerID

        request = JoinRequest(group_key=key, config_hash=self.config_hash, data_hash=self.data_hash,
                              bandwidth=self.bandwidth, credential=self._own_credential(), state_digest=digest,
                              fetched_from=fetched_from, relayed=self.relayed, weight=weight, wire=self.wire,
                              protocol=versions.stamp("averaging", "JoinRequest.protocol"))
        redirections = cuts = 0
        while True:
            stream = await self.p2p.iterate_protobuf_handler(PeerID.from_base58(leader), self.handler_name,
                                                             request, JoinReply)
            try:
                outcome = await self._read_replies(stream, leader, accepted)
            except STREAM_CUT as e:
                log.debug("join stream to %s cut (%r): joining again", leader[-8:], e)
                outcome = CUT_STREAM
            finally:
                await stream.aclose()  # the leader lingers until we close: tell it we read its reply
            if outcome is CUT_STREAM:
                # a relay's reset cut the stream: ask again (a leader that counted us in takes us again,
                # one that already began sends the same group)
                cuts += 1
                if cuts > MAX_JOIN_CUTS:
                    return None, f"leader {leader} closed the stream without beginning, {cuts} times"
                continue
            if isinstance(outcome, str):
                redirections += 1
                if redirections >= 3:
                    return None, "too many leader redirections"
                leader = outcome
                continue
            return outcome

    async def _read_replies(self, stream: Any, leader: str,
                            accepted: asyncio.Event) -> Union[str, object, tuple[Optional[Group], str]]:
        """The outcome of one join stream: ``(group, reason)``, the peer id to follow instead, or
        :data:`CUT_STREAM`."""
        checked = self.verifier is None
        async for reply in stream:
            if not checked:  # one stream is one authenticated connection: its first reply vouches
                problem = self.verifier.check(reply.credential, leader)
                if problem:
                    self.verifier.log_refusal(leader, "a leader's reply", problem)
                    return None, f"leader {leader} is not admitted: {problem}"
                checked = True
            if reply.code == JoinReply.ACCEPTED:
                accepted.set()
                continue
            if reply.code == JoinReply.BEGIN:
                return self._check_group(reply, leader)
            if reply.code == JoinReply.NOT_A_LEADER and reply.suggested_leader not in ("", leader, self.peer_id):
                return reply.suggested_leader
            return None, f"leader {leader} refused: {reply.reason or JoinReply.Code.Name(reply.code)}"
        return CUT_STREAM

    def _check_group(self, reply: JoinReply, leader: str) -> tuple[Optional[Group], str]:
        members = tuple(reply.members)
        if (self.peer_id not in members or list(members) != sorted(set(members))
                or len(reply.bandwidths) != len(members) or not reply.allreduce_timeout > 0
                or len(reply.relayed) not in (0, len(members)) or len(reply.weights) not in (0, len(members))
                or not all(math.isfinite(w) and w >= 0 for w in reply.weights)):
            return None, f"leader {leader} sent a malformed group"
        return Group(reply.group_id, members, tuple(reply.bandwidths), float(reply.allreduce_timeout),
                     tuple(bool(r) for r in reply.relayed), tuple(float(w) for w in reply.weights)), ""
