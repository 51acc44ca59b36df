"""Declarations pushed to a module's live holders (``Declare`` rpc, ``Matchmaker._push``).

A member pushes its declaration of a round to the holders its last gather read as it stores it on the
DHT: pacing (``NetAverager.others_waiting``) and the other members' gathers see it before the DHT
record, which on a busy host lands a good part of a second later (``bench.utilization``). The DHT's copy stays the
authority: a push is only ever the same statement, earlier, from the authenticated sender.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch

from peer.localnet import wait_for
from helpers.averagers import loopback_holders
from peer.averaging import BLOCK
from peer.compression import get_codec
from peer.averaging.declaration_push import PUSHED_KEYS
from peer.averaging.matchmaking import Matchmaker
from peer.network import HolderRecord, group_key, holders_key, read_records
from protos.hivepath.peer.v1.net_pb2 import DeclareNotice

CONFIG = "aaaa0000aaaa0000"


def _handle(mm: Matchmaker, sender: str, notice: DeclareNotice):
    """Run the handler as the p2p layer does for a stream from ``sender``; its one reply."""
    context = SimpleNamespace(remote_id=SimpleNamespace(to_base58=lambda: sender))

    async def one():
        return [ack async for ack in mm._handle_declare(notice, context)]

    (ack,) = asyncio.run(one())
    return ack


def _notice(key: str, expiration: float, config: str = CONFIG, paced: bool = False) -> DeclareNotice:
    return DeclareNotice(group_key=key, config_hash=config, data_hash="", bandwidth=1e6, digest="d" * 64,
                         expecting=["x"], paced=paced, expiration=expiration)


def test_a_pushed_declaration_is_kept_only_from_a_live_holder_of_its_module_with_our_config():
    from hivemind.utils import get_dht_time

    mm = Matchmaker(None, None, "me", "run", CONFIG, "", 1e6, "hivepath_run")
    mm._live["L0M0"] = frozenset({"holder"})
    key, later = group_key("run", "L0M0", 5), get_dht_time() + 60
    stranger = _handle(mm, "stranger", _notice(key, later))
    assert not stranger.ok and "not a live holder" in stranger.error
    other_config = _handle(mm, "holder", _notice(key, later, config="bbbb1111bbbb1111"))
    assert not other_config.ok and "config hash" in other_config.error
    wrong_module = _handle(mm, "holder", _notice(group_key("run", "L1M0", 5), later))
    assert not wrong_module.ok
    not_a_round_key = _handle(mm, "holder", _notice("run_L0M0_holders", later))
    assert not not_a_round_key.ok
    assert mm.pushed_to(key) == {}
    assert _handle(mm, "holder", _notice(key, later)).ok
    (decl,) = mm.pushed_to(key).values()
    assert (decl.config_hash, decl.digest, decl.expecting, decl.paced) == (CONFIG, "d" * 64, ("x",), False)
    bucket_key = group_key("run", "L0M0", 5, bucket=1)  # a split round's bucket
    assert _handle(mm, "holder", _notice(bucket_key, later)).ok and "holder" in mm.pushed_to(bucket_key)
    # an expired declaration is not returned; the kept keys are bounded, the oldest forgotten first
    expired = group_key("run", "L0M0", 6)
    assert _handle(mm, "holder", _notice(expired, get_dht_time() - 1)).ok
    assert mm.pushed_to(expired) == {}
    for r in range(7, 7 + PUSHED_KEYS):
        assert _handle(mm, "holder", _notice(group_key("run", "L0M0", r), later)).ok
    assert len(mm.pushed) == PUSHED_KEYS and mm.pushed_to(key) == {}
    assert "holder" in mm.pushed_to(group_key("run", "L0M0", 6 + PUSHED_KEYS))


def test_whether_every_live_holder_pushes_follows_each_new_push_after_a_kept_answer():
    """``all_push`` is asked between every two inner steps, and answers from a kept set of pushers until
    a push changes them: a holder's first push, even of an older round, counts at once."""
    from hivemind.utils import get_dht_time

    mm = Matchmaker(None, None, "me", "run", CONFIG, "", 1e6, "hivepath_run")
    mm._live["L0M0"] = frozenset({"a", "b"})
    mm._live["L1M0"] = frozenset({"a"})
    key, later = group_key("run", "L0M0", 5), get_dht_time() + 60
    assert _handle(mm, "a", _notice(key, later)).ok
    assert mm.pushers(key) == {"a"} and not mm.all_push("L0M0", key)
    assert not mm.all_push("L0M0", key)  # the same answer, kept
    assert not mm.all_push("L1M0", group_key("run", "L1M0", 5))  # another module's pushers are its own
    assert _handle(mm, "b", _notice(group_key("run", "L0M0", 4), later)).ok
    assert mm.pushers(key) == {"a", "b"} and mm.all_push("L0M0", key)
    assert _handle(mm, "a", _notice(group_key("run", "L1M0", 5), later)).ok
    assert mm.all_push("L1M0", group_key("run", "L1M0", 6))


class _SlowDeclarations:
    """A DHT whose stores of group declarations land ``delay`` seconds late (a busy DHT process)."""

    def __init__(self, dht, delay: float):
        self._dht, self._delay = dht, delay

    def __getattr__(self, name):
        return getattr(self._dht, name)

    def store(self, key, *args, **kwargs):
        if not key.endswith("_group"):
            return self._dht.store(key, *args, **kwargs)

        async def later():
            await asyncio.sleep(self._delay)
            return await self._dht.store(key, *args, **kwargs)

        return asyncio.ensure_future(later())


@pytest.mark.integration
def test_pushed_declarations_pace_and_group_holders_before_their_dht_records_land():
    """Three holders average round 4 (their gathers learn who the live holders are). Then ``a``'s
    group declarations reach the DHT only 12 s late, past every gather deadline of the round: ``b``
    still notices ``a`` waiting for round 5 with its own DHT check switched off, and the three
    still form one group and apply the same bytes, from ``a``'s pushed declaration alone."""
    with loopback_holders(3, "pushed", "L0M0", 4, CONFIG) as avgs:
        a, b, c = avgs
        int8 = get_codec("int8")
        deltas = [torch.randn(3 * BLOCK, generator=torch.Generator().manual_seed(i)) for i in range(3)]
        with ThreadPoolExecutor(3) as pool:
            first = list(pool.map(lambda i: avgs[i].average("L0M0", 4, [deltas[i]], 1.0, int8, 20.0), range(3)))
        assert all(r.group_size == 3 for r in first), [r.reason for r in first]

        a._matchmaker.dht = _SlowDeclarations(a._matchmaker.dht, 12.0)
        b._pacing._waiting_checked = math.inf  # b's own DHT check of who waits never runs again
        assert not b.others_waiting({"L0M0": 5})
        with ThreadPoolExecutor(3) as pool:
            futures = [pool.submit(a.average, "L0M0", 5, [deltas[0]], 1.0, int8, 20.0)]
            wait_for(lambda: b.others_waiting({"L0M0": 5}), 60, "b to notice a's pushed declaration")
            assert b.last_waiting == ("L0M0", 5, a.peer_id)
            assert not b.others_waiting({"L0M0": 6})
            futures += [pool.submit(avg.average, "L0M0", 5, [deltas[i]], 1.0, int8, 20.0)
                        for i, avg in ((1, b), (2, c))]
            second = [f.result(timeout=60) for f in futures]
    # b and c stop gathering 4 s in (0.2 of the round's 20 s): a group of three formed from a's push
    assert all(r.group_size == 3 for r in second), [r.reason for r in second]
    assert all(torch.equal(r.averaged[0], second[0].averaged[0]) for r in second)


class _LateHolderRecords:
    """A DHT whose stores of holder records land ``delay`` seconds late (a busy DHT process): the
    returned future is done when the store is."""

    def __init__(self, dht, delay: float):
        self._dht, self._delay = dht, delay

    def __getattr__(self, name):
        return getattr(self._dht, name)

    def store(self, key, *args, **kwargs):
        if not key.endswith("_holders"):
            return self._dht.store(key, *args, **kwargs)
        done: Future = Future()

        def later():
            try:
                done.set_result(self._dht.store(key, *args, **{**kwargs, "return_future": False}))
            except Exception as e:
                done.set_exception(e)

        threading.Timer(self._delay, later).start()
        return done


@pytest.mark.integration
def test_a_member_whose_holder_record_lags_is_still_waited_for_at_the_next_round():
    """Three holders average round 4 in sync mode. Then ``a``'s holder records land 12 s late, so
    for the whole of round 5 the DHT says ``a`` is at round 4, one round behind, and ``a`` declares
    round 5 a second after ``b`` and ``c``: they were in one group with ``a`` at round 4, so they wait
    for it rather than averaging round 5 without it (a group of two, and a third replica left at
    another state). Checked by hand: without that rule ``b`` and ``c`` form round 5 as a pair."""
    with loopback_holders(3, "lagging", "L0M0", 4, CONFIG) as avgs:
        a, b, c = avgs
        int8 = get_codec("int8")
        deltas = [torch.randn(3 * BLOCK, generator=torch.Generator().manual_seed(i)) for i in range(3)]
        a._records.dht = _LateHolderRecords(a._records.dht, 12.0)  # from round 4's announcement of round 5 on
        try:
            with ThreadPoolExecutor(3) as pool:
                first = list(pool.map(lambda i: avgs[i].average("L0M0", 4, [deltas[i]], 1.0, int8, 20.0), range(3)))
            assert all(r.group_size == 3 for r in first), [r.reason for r in first]
            records = read_records(b.dht, holders_key("lagging", "L0M0"), HolderRecord)
            assert records[a.peer_id].round_no == 4 and records[b.peer_id].round_no == 5, records
            with ThreadPoolExecutor(3) as pool:
                futures = [pool.submit(avg.average, "L0M0", 5, [deltas[i]], 1.0, int8, 20.0)
                           for i, avg in ((1, b), (2, c))]
                time.sleep(1.0)  # scenario timing, not synchronisation: a declares after b and c gathered
                futures.insert(0, pool.submit(a.average, "L0M0", 5, [deltas[0]], 1.0, int8, 20.0))
                second = [f.result(timeout=60) for f in futures]
            assert read_records(b.dht, holders_key("lagging", "L0M0"), HolderRecord)[a.peer_id].round_no == 4
        finally:
            a._records.dht = a._records.dht._dht  # a leaves through the real DHT
    assert all(r.group_size == 3 for r in second), [r.reason for r in second]
    assert all(torch.equal(r.averaged[0], second[0].averaged[0]) for r in second)


@pytest.mark.integration
def test_an_old_declaration_of_a_holder_two_rounds_on_counts_it_as_ahead():
    """``b`` declared round 5 (while waiting for ``a``, say, during a partition) and went on to round 7;
    its declaration has not expired. ``a``, still at round 5, must re-sync to round 7, not lead or join
    a group with ``b`` that ``b`` left long ago (that cost a cut-off peer a whole close deadline after
    the heal in ``bench.chaos``)."""
    from hivemind.utils import get_dht_time

    from peer.network import GroupDeclaration, to_value

    with loopback_holders(2, "stale", "L0M0", 5, CONFIG) as (a, b):
        old = GroupDeclaration(CONFIG, b.data_hash, 1.0, b"", "")
        assert b.dht.store(group_key("stale", "L0M0", 5), to_value(old), get_dht_time() + 60, subkey=b.peer_id)
        b.hold("L0M0", 7)
        wait_for(lambda: read_records(a.dht, holders_key("stale", "L0M0"), HolderRecord)[b.peer_id].round_no == 7, 30,
                 "b's record of round 7")
        res = a.average("L0M0", 5, [torch.zeros(BLOCK)], 1.0, get_codec("int8"), 20.0)
    assert not res.ok and res.reason.startswith("behind: other holders are at round 7"), res.reason


def test_a_declaration_is_pushed_only_over_an_open_connection():
    """A push never dials: a cut-off peer's pushes to holders whose records outlived the cut failed
    every round, and each failed dial backed libp2p's later dials of that holder off (5 s, then
    5 s + n² s), keeping the healed peer apart for 5-20 s. Of two live holders, only the one the p2p
    daemon holds a connection to is told; once both are connected, both are. (hivemind's P2P stands
    in here: which peers it is connected to, and the streams opened; a test on real daemons failed
    under load, the DHTs re-connecting the two on their own.)"""
    from hivemind.utils import get_dht_time

    from peer.averaging.group_join import Looking
    from peer.network import GroupDeclaration
    from protos.hivepath.peer.v1.net_pb2 import DeclareAck

    near, far = ("12D3KooWPbySgUijvGYy1St7ys38Ccfc1ce5RqA2rc5aoSFH4tkJ",
                 "12D3KooWPev3zeMMc3HCpKzabCxjKbV1XtB5igLV1Astn8q2idC1")

    class Daemon:
        def __init__(self):
            self.connected: set[str] = set()
            self.told: list[str] = []

        async def list_peers(self):
            return [SimpleNamespace(peer_id=SimpleNamespace(to_base58=lambda p=p: p)) for p in self.connected]

        async def iterate_protobuf_handler(self, peer, name, notice, reply_type):
            self.told.append(peer.to_base58())

            async def acks():
                yield DeclareAck(ok=True)
            return acks()

    daemon = Daemon()
    mm = Matchmaker(None, daemon, "me", "run", CONFIG, "", 1e6, "hivepath_run")
    mm._live["L0M0"] = frozenset({near, far})
    decl = GroupDeclaration(CONFIG, "", 1e6, b"", "d" * 64, ("x",), False)

    async def push(round_no: int) -> list[str]:
        daemon.told.clear()
        mm._push("L0M0", Looking(group_key("run", "L0M0", round_no), digest="d" * 64, expires=get_dht_time() + 60),
                 decl)
        while mm._background:  # the pushes run in the background: until the last one is done
            await asyncio.wait(set(mm._background))
        return sorted(daemon.told)

    daemon.connected = {near}
    assert asyncio.run(push(5)) == [near]
    daemon.connected = {near, far}
    assert asyncio.run(push(6)) == sorted([near, far])


async def _push(mm: Matchmaker, sender: str, notice: DeclareNotice) -> None:
    """``notice`` pushed to ``mm`` by ``sender`` and kept."""
    context = SimpleNamespace(remote_id=SimpleNamespace(to_base58=lambda: sender))
    assert all(ack.ok for ack in [a async for a in mm._handle_declare(notice, context)])


async def _settle() -> None:
    for _ in range(5):  # a leader's wait wakes on a push and re-checks (event-loop turns, not time)
        await asyncio.sleep(0)


def test_a_leader_stops_waiting_for_a_declared_member_that_pushed_a_later_round():
    """A member that declared our round while it waited for us during a partition, then went on without
    us, still has that declaration on the DHT after the heal: the peer back from the cut, leading that
    round, waited for it until the close deadline (``bench.chaos`` measures the recovery). Its declaration of a later
    round, pushed to us, tells us it is done with ours."""
    from hivemind.utils import get_dht_time

    from peer.averaging.group_join import Looking

    mm = Matchmaker(None, None, "me", "run", CONFIG, "", 1e6, "hivepath_run")
    mm._live.update({"L0M0": frozenset({"gone", "late"}), "L1M0": frozenset({"gone"})})
    key, later = group_key("run", "L0M0", 5), get_dht_time() + 60

    async def scenario():
        looking = Looking(key, digest="d" * 64, expires=later)
        mm._looking[key] = looking
        lead = asyncio.ensure_future(mm._lead(looking, {"gone", "late"}, time.monotonic() + 60,
                                              time.monotonic() + 120))
        await _settle()
        # our round again, another module's later round, an earlier round, an expired later round: no news
        await _push(mm, "gone", _notice(key, later))
        await _push(mm, "gone", _notice(group_key("run", "L1M0", 6), later))
        await _push(mm, "gone", _notice(group_key("run", "L0M0", 4), later))
        await _push(mm, "gone", _notice(group_key("run", "L0M0", 7), get_dht_time() - 1))
        await _settle()
        assert not lead.done() and mm._gone_on(key, {"gone", "late"}) == set()
        await _push(mm, "gone", _notice(group_key("run", "L0M0", 6, bucket=1), later))  # a later round (a bucket)
        await _settle()
        assert not lead.done(), "it stopped waiting for the member that did not go on"
        assert mm._gone_on(key, {"gone", "late"}) == {"gone"}
        await _push(mm, "late", _notice(group_key("run", "L0M0", 6), later))
        return await asyncio.wait_for(lead, 60)

    group, why = asyncio.run(scenario())
    assert group is None and "no declared member (gone, late) joined us" in why, why


class _HolderStoresNeverAnswer:
    """A DHT whose stores of holder records never complete (a DHT process that stopped answering)."""

    def __init__(self, dht):
        self._dht = dht

    def __getattr__(self, name):
        return getattr(self._dht, name)

    def store(self, key, *args, **kwargs):
        if not key.endswith("_holders"):
            return self._dht.store(key, *args, **kwargs)
        return Future()


@pytest.mark.integration
def test_an_announcement_the_dht_never_stores_does_not_hang_the_training_thread(monkeypatch, caplog):
    """The announcement at a round's end waits for the DHT's store, but only ``STORE_TIMEOUT``: a test
    saw a DHT process stop answering under load and a round's end wait on it for good."""
    import logging

    import peer.averaging.holder_records as holder_records

    monkeypatch.setattr(holder_records, "STORE_TIMEOUT", 0.5)
    with loopback_holders(1, "stuck", "L0M0", 4, CONFIG) as (a,):
        a._records.dht = _HolderStoresNeverAnswer(a._records.dht)
        with caplog.at_level(logging.WARNING, logger=holder_records.__name__):
            a.hold("L0M0", 5)
        assert a._records._held["L0M0"][0] == 5
        assert any("did not store it within" in r.getMessage() for r in caplog.records), caplog.text


class _CountedGroupReads:
    """A DHT that counts the reads of group keys."""

    def __init__(self, dht):
        self._dht, self.reads = dht, 0

    def __getattr__(self, name):
        return getattr(self._dht, name)

    def get(self, key, *args, **kwargs):
        self.reads += key.endswith("_group")
        return self._dht.get(key, *args, **kwargs)


@pytest.mark.integration
def test_pacing_checks_the_dht_seldom_for_modules_whose_live_holders_all_push():
    """Three holders average round 4 together and then push each other their declarations of round 5.
    Asked at round 6 whether anyone waits, with its last DHT check two ``WAITING_POLL`` s old, ``b``
    starts no DHT check: every live holder of the module pushes its declarations, which answer first
    (one check every ``PUSHED_WAITING_POLL`` stays for a push that failed). For a module nobody pushes
    about, it checks as before."""
    from peer.averaging.pacing import PUSHED_WAITING_POLL, WAITING_POLL

    with loopback_holders(3, "pushing", "L0M0", 4, CONFIG) as avgs:
        a, b, c = avgs
        int8 = get_codec("int8")
        deltas = [torch.randn(3 * BLOCK, generator=torch.Generator().manual_seed(i)) for i in range(3)]
        for round_no in (4, 5):
            with ThreadPoolExecutor(3) as pool:
                done = list(pool.map(lambda i: avgs[i].average("L0M0", round_no, [deltas[i]], 1.0, int8, 20.0),
                                     range(3)))
            assert all(r.group_size == 3 for r in done), [r.reason for r in done]
        reads = b._pacing.dht = _CountedGroupReads(b._pacing.dht)
        wait_for(lambda: b._pacing._waiting_check is None or b._pacing._waiting_check.done(), 30,
                 "b's last check to end")
        last = b._pacing._waiting_check
        b._pacing._waiting_checked = time.monotonic() - 2 * WAITING_POLL
        assert not b.others_waiting({"L0M0": 6})
        assert b._pacing._waiting_check is last and 2 * WAITING_POLL < PUSHED_WAITING_POLL
        assert not b.others_waiting({"L0M1": 6})  # nobody pushed us anything of L0M1
        assert b._pacing._waiting_check is not last
        wait_for(lambda: b._pacing._waiting_check.done(), 30, "b's DHT check of L0M1's round 6")
    assert reads.reads == 1


def test_a_notice_carries_the_senders_other_declarations_and_a_reader_of_averaging_1_3_takes_the_first_only():
    """``DeclareNotice.also``: the declarations of one round of every module a path peer holds travel on
    one stream, each checked as the notice's own (one of a module the sender is no live holder of is
    refused alone). A reader stating averaging 1.3, as a peer of that minor, takes the first only and
    says so (``also_read`` unset): the sender then pushes the others on streams of their own."""
    from hivemind.utils import get_dht_time

    from protos import versions

    later = get_dht_time() + 60
    keys = [group_key("run", m, 5) for m in ("L0M0", "L0M1", "L1M0")]
    notice = _notice(keys[0], later)
    notice.also.extend([_notice(keys[1], later), _notice(keys[2], later)])
    mm = Matchmaker(None, None, "me", "run", CONFIG, "", 1e6, "hivepath_run")
    mm._live.update({"L0M0": frozenset({"holder"}), "L0M1": frozenset({"holder"})})
    ack = _handle(mm, "holder", notice)
    assert ack.ok and ack.also_read
    assert [("holder" in mm.pushed_to(k)) for k in keys] == [True, True, False]
    versions.set_override("averaging=1.3")
    try:
        old = Matchmaker(None, None, "me", "run", CONFIG, "", 1e6, "hivepath_run")
        old._live.update(mm._live)
        ack = _handle(old, "holder", notice)
    finally:
        versions.set_override(None)
    assert ack.ok and not ack.also_read
    assert [("holder" in old.pushed_to(k)) for k in keys] == [True, False, False]


class _CountedPushes:
    """A P2P handle that notes every ``Declare`` stream opened through it: (peer, the group keys it carries)."""

    def __init__(self, p2p, handler: str):
        self._p2p, self._handler = p2p, handler
        self.streams: list[tuple[str, list[str]]] = []

    def __getattr__(self, name):
        return getattr(self._p2p, name)

    async def iterate_protobuf_handler(self, peer, name, request, reply_type):
        if name == self._handler:
            self.streams.append((peer.to_base58(), [request.group_key, *(n.group_key for n in request.also)]))
        return await self._p2p.iterate_protobuf_handler(peer, name, request, reply_type)


@pytest.mark.integration
def test_a_round_of_two_modules_is_pushed_on_one_stream_a_peer():
    """Three holders of two modules average round 4 of both (each gather learns the live holders). Then
    ``a`` declares round 5 of both modules at once, as a path peer does: one ``Declare`` stream to each
    of ``b`` and ``c`` carries both declarations, and each of them keeps both. Checked by hand: one
    stream a declaration, four in all."""
    from hivemind.utils import get_dht_time

    from peer.averaging.group_join import Looking
    from peer.network import GroupDeclaration

    modules = ("L0M0", "L0M1")
    with loopback_holders(3, "batched", "L0M0", 4, CONFIG) as avgs:
        a, b, c = avgs
        for avg in avgs:
            avg.hold("L0M1", 4)
        wait_for(lambda: len(read_records(a.dht, holders_key("batched", "L0M1"), HolderRecord)) == 3, 30,
                 "3 holder records of L0M1")
        int8 = get_codec("int8")
        deltas = [torch.randn(3 * BLOCK, generator=torch.Generator().manual_seed(i)) for i in range(3)]
        with ThreadPoolExecutor(6) as pool:
            first = list(pool.map(lambda job: avgs[job[0]].average(job[1], 4, [deltas[job[0]]], 1.0, int8, 20.0),
                                  [(i, m) for i in range(3) for m in modules]))
        assert all(r.group_size == 3 for r in first), [r.reason for r in first]
        mm = a._matchmaker
        pushes = mm.p2p = _CountedPushes(mm.p2p, mm.declare_handler)
        keys = [group_key("batched", m, 5) for m in modules]

        async def declare_both() -> None:
            for module_id, key in zip(modules, keys):
                decl = GroupDeclaration(CONFIG, a.data_hash, a.bandwidth, b"", "d" * 64, wire=mm.wire)
                mm._push(module_id, Looking(key, digest="d" * 64, expires=get_dht_time() + 60), decl)

        try:
            asyncio.run_coroutine_threadsafe(declare_both(), a._loop).result(10)
            wait_for(lambda: all(a.peer_id in avg._matchmaker.pushed_to(k) for avg in (b, c) for k in keys), 30,
                     "b and c to keep a's pushed declarations of both modules")
        finally:
            mm.p2p = pushes._p2p
    assert sorted(pushes.streams) == sorted((p, keys) for p in (b.peer_id, c.peer_id)), pushes.streams


def test_declarations_a_reader_did_not_take_from_a_notice_are_pushed_again_each_on_its_own_stream():
    """A reader of averaging 1.3 ignores ``DeclareNotice.also`` and leaves ``also_read`` unset in its ack:
    the declarations it did not take are pushed again, each on a stream of its own. (hivemind's P2P
    stands in here: the streams opened and the ack the reader sends.)"""
    from hivemind.utils import get_dht_time

    from peer.averaging.group_join import Looking
    from peer.network import GroupDeclaration
    from protos.hivepath.peer.v1.net_pb2 import DeclareAck

    holder = "12D3KooWPbySgUijvGYy1St7ys38Ccfc1ce5RqA2rc5aoSFH4tkJ"

    class Daemon:
        def __init__(self, also_read: bool):
            self.also_read, self.streams = also_read, []

        async def list_peers(self):
            return [SimpleNamespace(peer_id=SimpleNamespace(to_base58=lambda: holder))]

        async def iterate_protobuf_handler(self, peer, name, notice, reply_type):
            self.streams.append([notice.group_key, *(n.group_key for n in notice.also)])

            async def acks():
                yield DeclareAck(ok=True, also_read=self.also_read)
            return acks()

    keys = [group_key("run", m, 5) for m in ("L0M0", "L0M1")]

    def streams(also_read: bool) -> list[list[str]]:
        daemon = Daemon(also_read)
        mm = Matchmaker(None, daemon, "me", "run", CONFIG, "", 1e6, "hivepath_run")
        mm._live.update({"L0M0": frozenset({holder}), "L0M1": frozenset({holder})})
        decl = GroupDeclaration(CONFIG, "", 1e6, b"", "d" * 64)

        async def push() -> None:
            for module_id, key in zip(("L0M0", "L0M1"), keys):
                mm._push(module_id, Looking(key, digest="d" * 64, expires=get_dht_time() + 60), decl)
            while mm._background:  # the pushes run in the background: until the last one is done
                await asyncio.wait(set(mm._background))

        asyncio.run(push())
        return daemon.streams

    assert streams(also_read=True) == [keys]
    assert streams(also_read=False) == [keys, keys[1:]]


def test_a_leader_stops_waiting_for_a_declared_member_that_withdrew_its_declaration():
    """A member that gives a round up pushes a declaration of it that expired on arrival
    (``Matchmaker._give_up``): a leader waiting for it to join stops waiting; its declaration of the
    same round again, expiring later, counts it in again."""
    from hivemind.utils import get_dht_time

    from peer.averaging.group_join import Looking

    mm = Matchmaker(None, None, "me", "run", CONFIG, "", 1e6, "hivepath_run")
    mm._live.update({"L0M0": frozenset({"quit", "late"})})
    key, later = group_key("run", "L0M0", 5), get_dht_time() + 60

    async def scenario():
        looking = Looking(key, digest="d" * 64, expires=later)
        mm._looking[key] = looking
        await _push(mm, "quit", _notice(key, later))
        lead = asyncio.ensure_future(mm._lead(looking, {"quit", "late"}, time.monotonic() + 60,
                                              time.monotonic() + 120))
        await _settle()
        assert not lead.done() and mm._gone_on(key, {"quit", "late"}) == set()
        await _push(mm, "quit", _notice(key, 0.0))  # withdrawn
        await _settle()
        assert mm._gone_on(key, {"quit", "late"}) == {"quit"} and "quit" not in mm.pushed_to(key)
        assert not lead.done(), "it stopped waiting for the member that did not withdraw"
        await _push(mm, "quit", _notice(key, later))  # declared again
        assert mm._gone_on(key, {"quit", "late"}) == set() and "quit" in mm.pushed_to(key)
        await _push(mm, "late", _notice(group_key("run", "L0M0", 6), later))
        return await asyncio.wait_for(lead, 60)

    group, why = asyncio.run(scenario())
    assert group is None and "no declared member (late, quit) joined us" in why, why
