"""A DHT whose reads and writes issued together travel together: one request per node, not per key.

A path peer's round touches the DHT for every module at once: it declares each module's round, reads
each module's declarations and holders while it gathers, checks each module's group key while it
paces, and announces each module's next round after it. hivemind's ``DHT.store`` and ``DHT.get``
serve one key each: a store first asks the nodes near its key where to store (one ``rpc_find`` per
node) and then stores there (one ``rpc_store`` per node), and a latest read asks every node near its
key. A round of a 4-module path thus costs a member a request per module, key and node, each a new
p2p stream with its own framing: most of the bytes a sparse round puts on the wire beyond its payload
(``bench.wire`` counts them).

:class:`CoalescingDHT` is hivemind's ``DHT`` with its two in-process handlers replaced: stores and
latest reads that arrive within :data:`COALESCE_S` of each other are served as one batch.

- **Small swarm** (the routing table holds fewer nodes than a k-bucket, so every node is known, which
  is where any beam search ends up anyway): a batch of stores goes to each key's ``num_replicas``
  nearest known nodes with one ``rpc_store`` per node carrying every key it is a replica of, and no
  ``rpc_find`` first; a batch of latest reads asks each key's ``num_replicas`` nearest known nodes,
  one ``rpc_find`` per node for the keys it is a replica of (a node that does not answer is replaced by
  the next nearest, a nearer node an answer names is asked too), and merges the answers as hivemind's
  own search does (``_SearchState``: a dictionary value's subkeys merged, the latest expiration kept).
  hivemind's latest read asks every node its beam reaches, in a small swarm all of them: with many
  holders of a module gathering, most of a member's control bytes (``bench.wire_split``).
- **Larger swarm**: the batch goes through hivemind's own ``store_many`` and ``get_many_by_id``
  (one traversal for all its keys).

What a caller sees is unchanged: each store's future says whether the record was stored (every
replica that answered accepted it: a replica that refuses holds a newer value), each read's future
holds the same merged value hivemind's read would. A store no replica answered is retried through
hivemind's ``store_many``, which searches further. Calls with extra options (hivemind's keyword
arguments) and reads that are not ``latest`` keep hivemind's own path.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Optional

from hivemind.dht import DHT
from hivemind.dht.node import _SearchState
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils import MPFuture

__all__ = ["CoalescingDHT", "COALESCE_S", "request_counts"]

log = logging.getLogger(__name__)

COALESCE_S = 0.02
"""Seconds a store or latest read waits for others to travel with. A round's operations on its
modules are issued within a few milliseconds of each other; a gathering read polls every 100 ms."""


@dataclass
class _Store:
    key: Any
    value: Any
    expiration_time: float
    subkey: Any
    future: MPFuture


@dataclass
class _Read:
    key: Any
    future: MPFuture


class CoalescingDHT(DHT):
    """hivemind's ``DHT`` with stores and latest reads coalesced (see the module's docstring). Its
    handlers run in the DHT's own process and event loop; state is made there on first use."""

    async def _store(self, key, value, expiration_time, subkey, future: MPFuture, **kwargs):
        if kwargs:
            return await super()._store(key, value, expiration_time, subkey, future, **kwargs)
        self._queue("stores").append(_Store(key, value, expiration_time, subkey, future))

    async def _get(self, key, latest: bool, future: MPFuture, **kwargs):
        if kwargs or not latest:
            return await super()._get(key, latest, future, **kwargs)
        self._queue("reads").append(_Read(key, future))

    async def _request_counts(self) -> dict:
        return dict(self._counts())

    def _counts(self) -> dict:
        counts = self.__dict__.get("_coalescing_counts")
        if counts is None:
            counts = self.__dict__["_coalescing_counts"] = defaultdict(int)
        return counts

    def _queue(self, kind: str) -> list:
        """The pending batch of ``kind``; the first item of a batch schedules its flush."""
        queues = self.__dict__.setdefault("_coalescing_queues", {})
        if kind not in queues:
            queues[kind] = []
            flush = self._flush_stores if kind == "stores" else self._flush_reads
            asyncio.get_running_loop().call_later(COALESCE_S, self._start, flush)
        return queues[kind]

    def _start(self, flush) -> None:
        """Run ``flush`` as a task held here until it ends (the loop keeps only a weak reference to a
        task: one collected mid-flight would leave its callers' futures unanswered)."""
        tasks = self.__dict__.setdefault("_coalescing_tasks", set())
        task = asyncio.ensure_future(flush())
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    def _take(self, kind: str) -> list:
        return self.__dict__.setdefault("_coalescing_queues", {}).pop(kind, [])

    def _small_swarm(self) -> Optional[dict]:
        """Every node we know (DHTID -> PeerID, ourselves left out) when that is fewer than a k-bucket
        holds, that is when every node is known; else None."""
        table = self._node.protocol.routing_table
        known = {uid: pid for uid, pid in table.uid_to_peer_id.items() if uid != self._node.node_id}
        if len(known) >= self._node.protocol.bucket_size:
            return None
        blacklist = self._node.blacklist
        return {uid: pid for uid, pid in known.items() if pid not in blacklist}

    # stores

    async def _flush_stores(self) -> None:
        items = self._take("stores")
        if not items:
            return
        try:
            known = self._small_swarm()
            if known is None:
                ok = await self._store_through_hivemind(items)
            else:
                ok = await self._store_to_replicas(items, known)
                again = [i for i, status in enumerate(ok) if status is None]
                if again:  # no replica answered: hivemind's search may find others
                    for i, status in zip(again, await self._store_through_hivemind([items[i] for i in again])):
                        ok[i] = status
            for item, status in zip(items, ok):
                if not item.future.done():
                    item.future.set_result(bool(status))
        except BaseException as e:
            for item in items:
                if not item.future.done():
                    item.future.set_exception(e)
            if not isinstance(e, Exception):
                raise
            log.debug("a batch of %d DHT stores failed: %r", len(items), e)

    async def _store_through_hivemind(self, items: list[_Store]) -> list[Optional[bool]]:
        self._counts()["hivemind_store_batches"] += 1
        got = await self._node.store_many([i.key for i in items], [i.value for i in items],
                                          [i.expiration_time for i in items], subkeys=[i.subkey for i in items])
        return [got.get((i.key, i.subkey) if i.subkey is not None else i.key, False) for i in items]

    async def _store_to_replicas(self, items: list[_Store], known: dict) -> list[Optional[bool]]:
        """Each item to its key's ``num_replicas`` nearest nodes among ``known`` and ourselves, one
        ``rpc_store`` per node. Per item: True when every replica that answered accepted it, False
        when one refused, None when none answered."""
        node = self._node
        proto = node.protocol
        serializer, validator = proto.serializer, proto.record_validator
        per_node: dict[DHTID, list[tuple[int, DHTID, bytes]]] = defaultdict(list)
        accepted: list[Optional[bool]] = [None] * len(items)
        local: list[tuple[int, DHTID, DHTRecord]] = []
        payloads: list[tuple[DHTID, bytes]] = []
        for index, item in enumerate(items):
            key_id = DHTID.generate(source=item.key)
            value_bytes = serializer.dumps(item.value)
            record = DHTRecord(key_id.to_bytes(), serializer.dumps(item.subkey), value_bytes, item.expiration_time)
            if validator is not None:
                value_bytes = validator.sign_value(record)
                record = dataclasses.replace(record, value=value_bytes)
            payloads.append((key_id, value_bytes))
            for node_id in self._replicas(key_id, [*known, node.node_id]):
                if node_id == node.node_id:
                    local.append((index, key_id, record))
                else:
                    per_node[node_id].append((index, key_id, value_bytes))

        def note(index: int, status: bool) -> None:
            accepted[index] = bool(status) and accepted[index] is not False

        for index, key_id, record in local:
            valid = validator is None or validator.validate(record)
            note(index, valid and proto.storage.store(key_id, record.value, record.expiration_time,
                                                      subkey=items[index].subkey))
        targets = list(per_node)
        self._counts()["store_requests"] += len(targets)
        replies = await asyncio.gather(*(
            proto.call_store(known[node_id], keys=[k for _, k, _ in per_node[node_id]],
                             values=[v for _, _, v in per_node[node_id]],
                             expiration_time=[items[i].expiration_time for i, _, _ in per_node[node_id]],
                             subkeys=[items[i].subkey for i, _, _ in per_node[node_id]])
            for node_id in targets))
        for node_id, reply in zip(targets, replies):
            if reply is None:
                continue
            for (index, _, _), status in zip(per_node[node_id], reply):
                note(index, status)
        if node.cache_on_store:
            for index, (key_id, value_bytes) in enumerate(payloads):
                node._update_cache_on_store(key_id, [items[index].subkey], [value_bytes],
                                            [items[index].expiration_time], store_ok=[bool(accepted[index])])
        return accepted

    def _replicas(self, key_id: DHTID, nodes: list) -> list:
        """The key's ``num_replicas`` nearest of ``nodes``: where a store puts it and a read looks."""
        return sorted(nodes, key=key_id.xor_distance)[:self._node.num_replicas]

    # latest reads

    async def _flush_reads(self) -> None:
        items = self._take("reads")
        if not items:
            return
        try:
            ids = {}
            for item in items:
                ids.setdefault(DHTID.generate(source=item.key), item.key)
            known = self._small_swarm()
            if known is None:
                self._counts()["hivemind_read_batches"] += 1
                found = await self._node.get_many_by_id(list(ids), sufficient_expiration_time=float("inf"))
                by_key = {ids[key_id]: value for key_id, value in found.items()}
            else:
                by_key = await self._read_from_replicas(ids, known)
            for item in items:
                if not item.future.done():
                    item.future.set_result(by_key.get(item.key))
        except BaseException as e:
            for item in items:
                if not item.future.done():
                    item.future.set_exception(e)
            if not isinstance(e, Exception):
                raise
            log.debug("a batch of %d DHT reads failed: %r", len(items), e)

    async def _read_from_replicas(self, ids: dict, known: dict) -> dict:
        """The latest value of each key (``ids``: DHTID -> key) from our storage and the key's
        ``num_replicas`` nearest nodes of a small swarm, the nodes stores put it on
        (:meth:`_store_to_replicas`), one ``rpc_find`` per node for the keys it is a replica of. A node
        that does not answer is replaced by the next nearest, and a node an answer names that we did not
        know is asked too when it is among a key's nearest, as a search would: two peers whose views of
        the swarm differ by a few nodes still share most of each key's replicas."""
        node = self._node
        proto = node.protocol
        states = {key_id: _SearchState(key_id, float("inf"), serializer=proto.serializer,
                                       record_validator=proto.record_validator) for key_id in ids}
        for key_id, state in states.items():
            state.add_candidate(proto.storage.get(key_id), source_node_id=node.node_id)
            state.add_candidate(proto.cache.get(key_id), source_node_id=node.node_id)
        peers = dict(known)
        asked: dict[DHTID, set] = {key_id: {node.node_id} for key_id in states}
        silent: set = set()
        for _ in range(proto.bucket_size):
            per_node: dict[DHTID, list[DHTID]] = defaultdict(list)
            live = [n for n in [*peers, node.node_id] if n not in silent]
            for key_id, done in asked.items():
                for node_id in self._replicas(key_id, live):
                    if node_id not in done:
                        per_node[node_id].append(key_id)
            if not per_node:
                break
            batch = sorted(per_node, key=lambda n: n.to_bytes())
            self._counts()["find_requests"] += len(batch)
            replies = await asyncio.gather(*(node._call_find_with_blacklist(peers[n], per_node[n]) for n in batch))
            for node_id, reply in zip(batch, replies):
                for key_id in per_node[node_id]:
                    asked[key_id].add(node_id)
                if reply is None:
                    silent.add(node_id)
                    continue
                for key_id, (value, nearest) in reply.items():
                    if key_id in states:
                        states[key_id].add_candidate(value, source_node_id=node_id)
                    peers.update({n: p for n, p in nearest.items() if n not in peers and n != node.node_id})
        for state in states.values():
            state.finish_search()
        return {ids[key_id]: state.future.result() for key_id, state in states.items()}


def request_counts(dht: DHT) -> dict:
    """The requests a :class:`CoalescingDHT` made for its batches so far (``store_requests``,
    ``find_requests``, ``hivemind_store_batches``, ``hivemind_read_batches``); {} for another DHT."""
    if not isinstance(dht, CoalescingDHT):
        return {}
    return dht.run_coroutine(_counts_of)


async def _counts_of(dht: CoalescingDHT, node) -> dict:
    return await dht._request_counts()
