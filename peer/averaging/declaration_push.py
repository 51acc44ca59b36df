"""``DeclarationPush``: the ``Declare`` rpc, by which a member pushes its group declaration of a round to
the module's other live holders, and the declarations pushed to us.

A pushed declaration reaches the holders before its DHT record does: a slower holder ends its round at
its next step (pacing, :mod:`peer.averaging.pacing`), and a gather counts it without waiting for the
store, slow on a busy host. A declaration pushed to us also says that its sender went on to a later
round (:meth:`DeclarationPush._gone_on`): a group we lead stops waiting for it. This is the protocol layer
between the join protocol (:class:`peer.averaging.group_join.GroupJoin`) and
:class:`peer.averaging.matchmaking.Matchmaker`, whose gathers say whom to push to (``_live``) and read what
was pushed (:meth:`DeclarationPush.pushed_to`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator, Optional

from peer.averaging.group_join import GroupJoin, Looking
from peer.network import MAX_EXPECTING, CredentialProvider, CredentialVerifier, GroupDeclaration
from peer.network.frames import handler_name, log_limited, serve_messages
from protos.hivepath.peer.v1.net_pb2 import DESCRIPTOR as NET, DeclareAck, DeclareNotice
from protos.versions import writes

__all__ = ["DeclarationPush", "PUSH_MAX", "PUSH_TIMEOUT", "PUSHED_KEYS", "PUSH_BATCH_S", "BATCH_MAX"]

log = logging.getLogger(__name__)

PUSH_MAX = 16
"""Most holders a member pushes its declaration to (``Declare`` rpc, :meth:`DeclarationPush._push`): the
other holders of a widely held module read it from the DHT alone (a push to every holder would cost
each declaration a message per holder)."""
PUSH_TIMEOUT = 5.0
"""Seconds a pushed declaration may take to deliver (the DHT record is the one that must arrive)."""
PUSHED_KEYS = 256
"""Most group keys whose pushed declarations are kept (the oldest key is forgotten first)."""
PUSH_BATCH_S = 0.05
"""Seconds a declaration waits before it is pushed, for the others we push meanwhile: a path peer
declares a round of every module of its path within a few milliseconds, and one stream a peer carries
them all (``DeclareNotice.also``), each stream costing its framing on the wire (``bench.wire``)."""
BATCH_MAX = 64
"""Most declarations one pushed notice carries (itself and its ``also``); more are pushed on another stream."""
DECLARE = NET.services_by_name["Averaging"].methods_by_name["Declare"]


def _round_in(key: str, prefix: str) -> int:
    """The round of ``key`` when it is ``{prefix}{round}_group`` or ``{prefix}{round}_b{bucket}_group``
    (a module's group key of a round, :func:`peer.network.group_key`); else -1."""
    if not (key.startswith(prefix) and key.endswith("_group")):
        return -1
    round_no, split, bucket = key[len(prefix):-len("_group")].partition("_b")
    return int(round_no) if round_no.isdigit() and (not split or bucket.isdigit()) else -1


class DeclarationPush(GroupJoin):
    """This peer's side of the ``Declare`` rpc, for every module it matchmakes (one asyncio loop):
    :meth:`start` registers the ``{prefix}_declare`` handler besides the join protocol's."""

    def __init__(self, p2p: Any, peer_id: str, run_id: str, config_hash: str, data_hash: str, bandwidth: float,
                 prefix: str, credential: Optional[CredentialProvider] = None,
                 verifier: Optional[CredentialVerifier] = None, relayed: bool = False):
        super().__init__(p2p, peer_id, config_hash, data_hash, bandwidth, prefix, credential, verifier, relayed)
        self.run_id = run_id
        self._background: set["asyncio.Future[Any]"] = set()
        """Pushes, our declarations' DHT stores and other background stores (kept so that they are not
        collected)."""
        self._live: dict[str, frozenset[str]] = {}
        """module -> the other live holders our last gather of it read (whom :meth:`_push` tells)."""
        self.pushed: dict[str, dict[str, tuple[GroupDeclaration, float]]] = {}
        """Group key -> sender -> (its declaration, DHT expiration), as live holders pushed them to us
        (:meth:`_handle_declare`), in arrival order of the keys, at most :data:`PUSHED_KEYS` keys."""
        self._pushed_version = 0
        """Counts the changes to :attr:`pushed`: :meth:`pushers` answers from :attr:`_pushers_seen` while
        it has not moved."""
        self._pushers_seen: dict[str, tuple[int, frozenset[str]]] = {}
        """A module's group-key prefix -> (:attr:`_pushed_version` when read, :meth:`pushers` of it then):
        the training thread asks between every two inner steps (``WaitingCheck.others_waiting``), and a
        scan of every kept key each time cost a path peer a few per cent of its training thread."""
        self._push_waiters: set[asyncio.Event] = set()
        """One event per gather in progress, set when a declaration is pushed to us."""
        self._strangers: dict[str, frozenset[str]] = {}
        """Group key -> the senders of declarations under it we refused as no live holder of its module as
        far as we read (newcomers, maybe: a gather reads the holders again), the last :data:`PUSHED_KEYS` keys."""
        self._outbox: dict[str, dict[str, DeclareNotice]] = {}
        """Peer -> group key -> our declaration to push it at the end of the :data:`PUSH_BATCH_S` window
        (the last one of each key)."""
        self._flushing: Optional["asyncio.Future[Any]"] = None
        """The push of the outbox due at the end of the window, until it took the outbox."""
        self.declare_handler = handler_name(prefix, DECLARE)

    async def start(self) -> None:
        await super().start()
        await serve_messages(self.p2p, self.prefix, DECLARE, self._handle_declare)

    async def _handle_declare(self, request: DeclareNotice, context: Any) -> AsyncIterator[DeclareAck]:
        """Declarations pushed by another holder (:meth:`_push`): the notice's own and those in its
        ``also`` (at most :data:`BATCH_MAX` in all; a reader that states averaging 1.3 takes the first
        only, as one of that minor does), each taken as :meth:`_take_declaration` says. The ack answers
        for the first."""
        sender = context.remote_id.to_base58()
        batch = writes("averaging", "DeclareAck.also_read")
        notices = [request, *request.also[:BATCH_MAX - 1]] if batch else [request]
        problems = [self._take_declaration(sender, notice) for notice in notices]
        if not all(problems):
            for waiter in self._push_waiters:
                waiter.set()
            for looking in self._looking.values():  # a group we lead re-checks whom it waits for (_gone_on)
                looking.changed.set()
        yield DeclareAck(ok=not problems[0], error=problems[0], also_read=batch)

    def _take_declaration(self, sender: str, request: DeclareNotice) -> str:
        """Keep one declaration ``sender`` pushed us until it expires when the sender is a live holder of
        the key's module in our last gather of it, of our config and dataset, and its credential admits
        it: the same checks as a DHT record's, whose subkey is the sender. '' when kept, else why not."""
        problem = self._mismatch(sender, request.config_hash, request.data_hash, request.wire)
        if not problem and not any(sender in live and _round_in(request.group_key, f"{self.run_id}_{module_id}_r") >= 0
                                   for module_id, live in self._live.items()):
            problem = "not a live holder of that module, as far as we read"
            self._strangers[request.group_key] = self._strangers.pop(request.group_key, frozenset()) | {sender}
            while len(self._strangers) > PUSHED_KEYS:
                del self._strangers[next(iter(self._strangers))]
        decl = GroupDeclaration(request.config_hash, request.data_hash, float(request.bandwidth),
                                bytes(request.credential), request.digest, tuple(request.expecting)[:MAX_EXPECTING],
                                bool(request.paced), request.wire, sparse=bool(request.sparse))
        if not problem and self.verifier is not None and not self.verifier.admits(decl.credential, sender,
                                                                                  "pushed declaration"):
            problem = "its credential does not admit it"
        if problem:
            log_limited(log, f"declare:{sender}", "ignoring a declaration %s pushed: %s", sender[-8:], problem)
            return problem
        # a new dict, never one changed in place: NetAverager.others_waiting reads these from the training thread
        senders = {**self.pushed.pop(request.group_key, {}), sender: (decl, float(request.expiration))}
        self.pushed[request.group_key] = senders
        while len(self.pushed) > PUSHED_KEYS:
            del self.pushed[next(iter(self.pushed))]
        self._pushed_version += 1
        return ""

    def _gone_on(self, key: str, members: set[str]) -> set[str]:
        """Those of ``members`` that pushed us an unexpired declaration of a later round of ``key``'s
        module: each is done with ``key``'s round (a member declares a round only once its last one's
        matchmaking ended; a failed round is declared again, not skipped). A member that declared
        our round during a partition, while it waited for us, then went on without us, is not waited
        for until the close deadline (``bench.chaos`` measures the first round after a heal). So are
        those whose last declaration pushed under ``key`` has expired: a member that gave the round up
        pushes one expired on arrival (:meth:`peer.averaging.matchmaking.Matchmaker._give_up`)."""
        head, sep, _ = key.rpartition("_r")
        prefix = head + sep
        round_no = _round_in(key, prefix)
        if round_no < 0 or not members:
            return set()
        from hivemind.utils import get_dht_time

        now = get_dht_time()
        gone = {p for p, (_, expires) in self.pushed.get(key, {}).items() if p in members and expires <= now}
        for other, senders in self.pushed.items():
            if _round_in(other, prefix) > round_no:
                gone |= {p for p, (_, expires) in senders.items() if p in members and expires > now}
        return gone

    def strangers(self, key: str) -> frozenset[str]:
        """The peers that pushed us a declaration under ``key`` that we refused as no live holder of its
        module, as far as our reads of its holders went."""
        return self._strangers.get(key, frozenset())

    def pushers(self, key: str) -> frozenset[str]:
        """The peers that pushed us a declaration of ``key``'s module, at any round we still keep (expired
        ones too): each holds a connection to us and reads us as a live holder of the module, so it pushes
        us its declaration of ``key``'s round too once it declares it (a push can still fail: the DHT
        record is the one that must arrive)."""
        head, sep, _ = key.rpartition("_r")
        prefix = head + sep
        version = self._pushed_version
        seen = self._pushers_seen.get(prefix)
        if seen is not None and seen[0] == version:
            return seen[1]
        found = frozenset(p for other, senders in list(self.pushed.items()) if _round_in(other, prefix) >= 0
                          for p in senders)
        self._pushers_seen[prefix] = (version, found)
        return found

    def all_push(self, module_id: str, key: str) -> bool:
        """Whether every other live holder of ``module_id`` that our last gather of it read pushes us its
        declarations (:meth:`pushers` of ``key``, one of the module's group keys); False when that gather
        read none."""
        live = self._live.get(module_id, frozenset())
        return bool(live) and live <= self.pushers(key)

    def pushed_to(self, key: str) -> dict[str, GroupDeclaration]:
        """The unexpired declarations other holders pushed us under ``key``, by sender."""
        return {p: d for p, (d, _) in self.pushed_until(key).items()}

    def pushed_until(self, key: str) -> dict[str, tuple[GroupDeclaration, float]]:
        """:meth:`pushed_to` with each declaration's DHT expiration."""
        from hivemind.utils import get_dht_time

        now = get_dht_time()
        return {p: (d, expires) for p, (d, expires) in self.pushed.get(key, {}).items() if expires > now}

    def _push(self, module_id: str, looking: Looking, decl: GroupDeclaration,
              expiration: Optional[float] = None) -> None:
        """Send our declaration under ``looking.key`` to the module's other live holders (at most
        :data:`PUSH_MAX`, from our last gather), in the background, expiring at ``expiration`` (None:
        ``looking.expires``; one in the past withdraws what we pushed before under that key: the
        receivers keep a sender's last declaration of a key and read it only until it expires). It reaches them before the DHT
        record: a slower holder ends its round at its next step (pacing), instead of after its next
        DHT check; a gather counts it without waiting for the store, slow on a busy host with far-apart
        peers (``bench.utilization``). The declarations pushed within :data:`PUSH_BATCH_S` of each
        other travel on one stream a peer (:meth:`_flush_pushes`).

        Only holders we hold a connection to are told: a push never dials. A cut-off peer's holder
        records outlive the cut, and its pushes to them failed every round; each failed dial backs
        libp2p's later dials of that peer off (5 s, then 5 s + n² s), which kept a healed peer apart
        for 5-20 s (``bench.chaos`` partitions). Holders not connected yet read our DHT record."""
        notice = DeclareNotice(group_key=looking.key, config_hash=decl.config_hash, data_hash=decl.data_hash,
                               bandwidth=decl.bandwidth, credential=decl.credential, digest=decl.digest,
                               expecting=list(decl.expecting), paced=decl.paced,
                               expiration=looking.expires if expiration is None else expiration,
                               wire=decl.wire, sparse=decl.sparse and writes("averaging", "DeclareNotice.sparse"))
        holders = sorted(self._live.get(module_id, ()))[:PUSH_MAX]
        for peer in holders:
            self._outbox.setdefault(peer, {})[looking.key] = notice
        if holders and (self._flushing is None or self._flushing.done()):
            self._flushing = self._in_background(self._flush_pushes(), "pushing our declarations")

    async def _flush_pushes(self) -> None:
        """After :data:`PUSH_BATCH_S`, push every declaration waiting in the outbox: one stream a connected
        peer for all of those it is told, their first the notice and the rest its ``also`` (a peer that
        did not read ``also``, of averaging 1.3, is then told each on its own stream)."""
        await asyncio.sleep(PUSH_BATCH_S)  # a protocol delay: the round's other declarations travel along
        outbox, self._outbox, self._flushing = self._outbox, {}, None
        connected = {info.peer_id.to_base58() for info in await self.p2p.list_peers()}
        for peer, notices in outbox.items():
            if peer in connected:
                batches = list(notices.values())
                for start in range(0, len(batches), BATCH_MAX):
                    self._in_background(self._tell(peer, batches[start:start + BATCH_MAX]),
                                        "pushing our declarations")

    async def _tell(self, peer: str, notices: list[DeclareNotice]) -> None:
        """Push ``notices`` to ``peer``: on one stream where it reads a notice's ``also``, else one a notice."""
        first, rest = notices[0], notices[1:]
        if not rest or not writes("averaging", "DeclareNotice.also"):
            await asyncio.gather(*(self._tell_one(peer, notice) for notice in notices))
            return
        batch = DeclareNotice()
        batch.CopyFrom(first)
        batch.also.extend(rest)
        ack = await self._tell_one(peer, batch)
        if ack is not None and not ack.also_read:
            await asyncio.gather(*(self._tell_one(peer, notice) for notice in rest))

    async def _tell_one(self, peer: str, notice: DeclareNotice) -> Optional[DeclareAck]:
        """Push ``notice`` to ``peer`` on a stream of its own; its ack, None when none came."""
        from hivemind.p2p import PeerID

        async def call() -> Optional[DeclareAck]:
            stream = await self.p2p.iterate_protobuf_handler(PeerID.from_base58(peer), self.declare_handler,
                                                             notice, DeclareAck)
            try:
                async for ack in stream:
                    if not ack.ok:
                        log.debug("%s refused our pushed declaration: %s", peer[-8:], ack.error)
                    return ack
                return None
            finally:
                await stream.aclose()
        try:
            return await asyncio.wait_for(call(), PUSH_TIMEOUT)
        except Exception as e:  # the DHT record still reaches them
            log.debug("pushing our declaration to %s failed: %r", peer[-8:], e)
            return None

    def _in_background(self, work: Any, what: str, level: int = logging.DEBUG) -> "asyncio.Future[Any]":
        """Run ``work`` (a coroutine or future) without waiting for it (its task is returned); a failure
        is logged at ``level``."""
        task = asyncio.ensure_future(work)
        self._background.add(task)

        def done(task: "asyncio.Future[Any]") -> None:
            self._background.discard(task)
            if not task.cancelled() and task.exception() is not None:
                log.log(level, "%s failed: %r", what, task.exception())
        task.add_done_callback(done)
        return task
