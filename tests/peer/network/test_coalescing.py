"""Stores and latest reads issued together travel together (``peer.network.coalescing``), on real DHTs.

The counting tests issue their batch inside the DHT process, in one coroutine that does not yield
between the calls, so the batch is the same however loaded the machine is."""

from __future__ import annotations

import contextlib

import pytest
from hivemind.dht.routing import DHTID
from hivemind.utils import MPFuture, get_dht_time

from peer.network import DHTOptions, start_dht
from peer.network.coalescing import CoalescingDHT, request_counts

KEYS = [f"coalesce-{i}" for i in range(4)]


@contextlib.contextmanager
def swarm(n: int, **extra):
    """``n`` peers' DHTs on loopback, the first the others' initial peer."""
    opts = DHTOptions(host_maddrs=["/ip4/127.0.0.1/tcp/0"], extra=extra)
    with contextlib.ExitStack() as stack:
        first = stack.enter_context(start_dht(opts))
        rest = [stack.enter_context(start_dht(DHTOptions(host_maddrs=opts.host_maddrs, initial_peers=first.maddrs(),
                                                         extra=extra)))
                for _ in range(n - 1)]
        yield [first, *rest]


async def _store_together(items, dht, _node):
    """Enqueue every (key, value, subkey, expires) without yielding, then await them all."""
    futures = [MPFuture() for _ in items]
    for (key, value, subkey, expires), future in zip(items, futures):
        await dht._store(key, value, expires, subkey, future)
    return [await f for f in futures]


async def _read_together(keys, dht, _node):
    futures = [MPFuture() for _ in keys]
    for key, future in zip(keys, futures):
        await dht._get(key, True, future)
    found = [await f for f in futures]
    return [None if f is None else (f.value if not isinstance(f.value, dict)
                                    else {s: v.value for s, v in f.value.items()}) for f in found]


def _run(node, fn, *args):
    import functools

    return node.dht.run_coroutine(functools.partial(fn, *args))


def test_a_peer_runs_hivemind_s_dht_with_coalescing_unless_told_not_to():
    with swarm(1) as (a,):
        assert isinstance(a.dht, CoalescingDHT)
    with start_dht(DHTOptions(host_maddrs=["/ip4/127.0.0.1/tcp/0"], coalesce=False)) as plain:
        assert not isinstance(plain.dht, CoalescingDHT) and request_counts(plain.dht) == {}


def test_stores_issued_together_take_one_request_per_node_and_every_node_reads_them():
    with swarm(4) as peers:
        a, b = peers[0], peers[1]
        expires = get_dht_time() + 60
        items = [(key, f"value of {key}", a.peer_id, expires) for key in KEYS]
        assert _run(a, _store_together, items) == [True] * 4
        # hivemind stores key by key: a search (an rpc_find to each node) and an rpc_store to each, 24 here
        assert request_counts(a.dht)["store_requests"] == 3
        assert _run(b, _read_together, KEYS) == [{a.peer_id: f"value of {key}"} for key in KEYS]
        assert request_counts(b.dht)["find_requests"] == 3  # hivemind: a search per key, 12 requests here
        for p in peers[2:]:  # every replica holds them: a latest read through the pipe finds them anywhere
            found = p.dht.get(KEYS[2], latest=True)
            assert {s: v.value for s, v in found.value.items()} == {a.peer_id: "value of coalesce-2"}


def test_subkeys_from_several_peers_merge_and_an_older_value_is_refused():
    with swarm(3) as peers:
        expires = get_dht_time() + 60
        futures = [p.dht.store("merged", i, expires, subkey=p.peer_id, return_future=True) for i, p in enumerate(peers)]
        assert [f.result() for f in futures] == [True, True, True]
        found = peers[1].dht.get("merged", latest=True)
        assert {s: v.value for s, v in found.value.items()} == {p.peer_id: i for i, p in enumerate(peers)}
        a = peers[0].dht
        assert a.store("plain", "newer", expires + 5)
        assert a.store("plain", "older", expires) is False  # every replica holds a later one
        assert peers[2].dht.get("plain", latest=True).value == "newer"
        assert peers[2].dht.get("never stored", latest=True) is None
        assert peers[2].dht.get("plain", latest=False).value == "newer"  # hivemind's own path


async def _view(dht, node):
    """This node's id and every node of the swarm it knows (``_small_swarm``), ourselves included."""
    return node.node_id, [node.node_id, *dht._small_swarm()]


def _replicas(key, view, count):
    return sorted(view, key=DHTID.generate(source=key).xor_distance)[:count]


async def _silence(peer_id, dht, node):
    """From here on this node's finds to ``peer_id`` get no answer, as from a node that died before we
    noticed (a real shutdown races with our DHT dropping the node on its own, which changes whom a read
    asks)."""
    call = node._call_find_with_blacklist

    async def unanswered(to, keys):
        return None if to.to_base58() == peer_id else await call(to, keys)

    node._call_find_with_blacklist = unanswered
    return True


def test_a_read_asks_only_each_key_s_replicas_and_one_that_is_gone_is_replaced():
    """A latest read asks a key's ``num_replicas`` nearest nodes, not every node of the swarm; when one
    of them does not answer the read still finds the value and asks the next nearest in its place."""
    with swarm(6, num_replicas=2) as peers:
        a, b = peers[0], peers[1]
        ids = {p.peer_id: _run(p, _view)[0] for p in peers}
        b_id, b_view = _run(b, _view)
        assert len(b_view) == 6, "the reader knows the whole swarm"
        expires = get_dht_time() + 60
        # a key whose three nearest nodes (as b sees the swarm) do not include the reader: its two
        # replicas and the one that stands in for a replica that does not answer are all asked (the
        # reader's own storage is read, not asked); about half of all names qualify
        key = next(k for k in (f"narrow-{i}" for i in range(200)) if b_id not in _replicas(k, b_view, 3))
        assert _run(a, _store_together, [(key, "stored", a.peer_id, expires)]) == [True]
        assert _run(b, _read_together, [key]) == [{a.peer_id: "stored"}]
        assert request_counts(b.dht)["find_requests"] == 2  # hivemind's latest read asks all 5 others
        gone = next(p for p in peers if ids[p.peer_id] == _replicas(key, b_view, 1)[0])
        assert _run(b, _silence, gone.peer_id)
        assert _run(b, _read_together, [key]) == [{a.peer_id: "stored"}]
        # the two replicas again, and the third nearest in place of the one that did not answer
        assert request_counts(b.dht)["find_requests"] == 2 + 3


def test_a_swarm_larger_than_a_bucket_goes_through_hivemind_s_search():
    with swarm(4, bucket_size=2, num_replicas=2) as peers:
        a, b = peers[0], peers[1]
        expires = get_dht_time() + 60
        items = [(key, f"value of {key}", a.peer_id, expires) for key in KEYS]
        assert _run(a, _store_together, items) == [True] * 4
        assert request_counts(a.dht).get("hivemind_store_batches") == 1
        assert _run(b, _read_together, KEYS) == [{a.peer_id: f"value of {key}"} for key in KEYS]
        assert request_counts(b.dht).get("hivemind_read_batches") == 1


@pytest.mark.parametrize("kind", ["stores", "reads"])
def test_a_batch_that_fails_fails_each_of_its_callers(kind):
    """An error in a batch reaches every caller's future, and the DHT goes on serving."""
    with swarm(2) as (a, b):
        broken = _run(a, _break, kind)
        assert broken
        with pytest.raises(Exception, match="broken on purpose"):
            if kind == "stores":
                _run(a, _store_together, [("k", 1, None, get_dht_time() + 60)])
            else:
                _run(a, _read_together, ["k"])
        _run(a, _mend, kind)
        assert a.dht.store("k", 2, get_dht_time() + 60) and b.dht.get("k", latest=True).value == 2


async def _break(kind, dht, _node):
    name = "_store_to_replicas" if kind == "stores" else "_read_from_replicas"

    async def broken(*args, **kwargs):
        raise RuntimeError("broken on purpose")

    setattr(dht, name, broken)
    return True


async def _mend(kind, dht, _node):
    delattr(dht, "_store_to_replicas" if kind == "stores" else "_read_from_replicas")
