"""What a gather reads from the DHT (``Matchmaker._gather_until``), counted on real loopback DHTs.

A path peer's round gathers each of its modules at once, and every DHT read is a libp2p stream to
every node of a small swarm with its own framing: the control bytes of a sparse round were mostly
these reads and their answers (``bench.wire``). The holders key lists every holder of the module, the
largest record a gather reads; its declarations are pushed to it by the holders it knows.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from helpers.averagers import loopback_holders
from peer.averaging import BLOCK
from peer.averaging.matchmaking import HOLDERS_POLL, PUSHED_POLL
from peer.compression import get_codec
from peer.localnet import wait_for
from peer.network import group_key, holders_key

CONFIG = "aaaa0000aaaa0000"


class _CountedReads:
    """A DHT that notes when each key was read (the time each ``get`` was called)."""

    def __init__(self, dht):
        self._dht = dht
        self.reads: list[tuple[str, float]] = []

    def __getattr__(self, name):
        return getattr(self._dht, name)

    def get(self, key, *args, **kwargs):
        self.reads.append((key, time.monotonic()))
        return self._dht.get(key, *args, **kwargs)

    def of(self, key: str) -> list[float]:
        return [t for k, t in list(self.reads) if k == key]


def _deltas(n: int) -> list[torch.Tensor]:
    return [torch.randn(3 * BLOCK, generator=torch.Generator().manual_seed(i)) for i in range(n)]


def _average_together(avgs, rounds) -> None:
    """The three average each of ``rounds`` together, so each has pushed the others its declarations."""
    int8, deltas = get_codec("int8"), _deltas(3)
    for round_no in rounds:
        with ThreadPoolExecutor(3) as pool:
            done = list(pool.map(lambda i: avgs[i].average("L0M0", round_no, [deltas[i]], 1.0, int8, 60.0),
                                 range(3)))
        assert all(r.group_size == 3 for r in done), [r.reason for r in done]


def _first_gathers_alone(avgs, round_no: int, reads: _CountedReads, key: str, polls: int) -> list:
    """``avgs[0]`` begins ``round_no`` alone; once it read ``key`` ``polls`` times the others begin it
    too. Returns the three results, after checking they formed one group with one average."""
    int8, deltas = get_codec("int8"), _deltas(3)
    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(avgs[0].average, "L0M0", round_no, [deltas[0]], 1.0, int8, 60.0)]
        wait_for(lambda: len(reads.of(key)) >= polls, 60,
                 f"the first to poll round {round_no}'s group key {polls} times")
        futures += [pool.submit(avgs[i].average, "L0M0", round_no, [deltas[i]], 1.0, int8, 60.0) for i in (1, 2)]
        results = [f.result(timeout=90) for f in futures]
    assert all(r.group_size == 3 for r in results), [r.reason for r in results]
    assert all(torch.equal(r.averaged[0], results[0].averaged[0]) for r in results)
    return results


def _pushes_settled(avg) -> bool:
    """Whether every declaration ``avg`` pushed has been delivered or given up (its pushes run in the
    background of its gathers, ``PUSH_BATCH_S`` after the declaration, and may outlast the round)."""
    mm = avg._matchmaker
    return not mm._outbox and all(task.done() for task in list(mm._background))


def _once_both_pushed(avgs, run_id: str, round_no: int) -> int:
    """The first round from ``round_no`` at which ``avgs[0]`` knows that the other two push it their
    declarations (each pushed it one it kept). A push can reach it after the round ended, or be refused
    when its last read of the holders missed the sender: once the others' pushes have settled and one
    is still missing, the three average ``round_no`` together and it is asked again (at most 3 rounds)."""
    a, b, c = avgs
    for _ in range(3):
        wait_for(lambda: _pushes_settled(b) and _pushes_settled(c), 60, f"b's and c's pushes before round {round_no}")
        if {b.peer_id, c.peer_id} <= a._matchmaker.pushers(group_key(run_id, "L0M0", round_no)):
            return round_no
        _average_together(avgs, (round_no,))
        round_no += 1
    raise AssertionError(f"b's and c's declarations were never kept by a pushed before round {round_no}")


@pytest.mark.integration
def test_a_long_gather_reads_the_holders_key_once_a_holders_poll():
    """``a`` gathers round 4 alone while ``b`` and ``c`` have not begun it: it polls the round's group
    key many times, and the module's holders key (whose holders its first read already returned) only
    once a ``HOLDERS_POLL``. The three then form one group. Checked by hand: reading both keys every
    poll, the holders key is read 0.1-0.3 s apart."""
    with loopback_holders(3, "holders-poll", "L0M0", 4, CONFIG) as avgs:
        a = avgs[0]
        reads = _CountedReads(a._matchmaker.dht)
        a._matchmaker.dht = reads
        _first_gathers_alone(avgs, 4, reads, group_key("holders-poll", "L0M0", 4), polls=15)
    times = reads.of(holders_key("holders-poll", "L0M0"))
    assert len(times) >= 2, times  # 15 polls at least 0.1 s apart span more than a HOLDERS_POLL
    gaps = [later - earlier for earlier, later in zip(times, times[1:])]
    assert min(gaps) >= HOLDERS_POLL, gaps


@pytest.mark.integration
def test_a_gather_waiting_only_for_holders_that_push_polls_the_group_key_less_and_less_often():
    """Three holders average rounds 4 and 5 together, so each has pushed the others its declaration
    of round 5 (a round more while a push did not arrive, :func:`_once_both_pushed`). At round 6 ``a``
    gathers alone first: everyone it waits for pushes its declarations, so it reads the round's group
    key 0.1, 0.2, 0.4, 0.8 s apart, then once a ``PUSHED_POLL``; ``b``'s and ``c``'s pushed
    declarations still end its gather, and the three form one group. Checked by hand: polled every
    ``_POLL``, the reads are 0.1-0.3 s apart."""
    with loopback_holders(3, "pushed-poll", "L0M0", 4, CONFIG) as avgs:
        a, b, c = avgs
        _average_together(avgs, (4, 5))
        round_no = _once_both_pushed(avgs, "pushed-poll", 6)
        reads = _CountedReads(a._matchmaker.dht)
        a._matchmaker.dht = reads
        group = group_key("pushed-poll", "L0M0", round_no)
        _first_gathers_alone(avgs, round_no, reads, group, polls=7)
    times = reads.of(group)
    gaps = [later - earlier for earlier, later in zip(times, times[1:])]
    assert min(gaps[3:6]) >= 0.75 and gaps[4] >= 0.95 * PUSHED_POLL, gaps


@pytest.mark.integration
def test_the_last_rounds_group_forms_again_from_its_pushed_declarations_with_no_dht_read():
    """Three holders average rounds 4 and 5 together. At round 6 ``b`` and ``c`` declare first; once
    their pushed declarations reached ``a``, ``a`` gathers round 6 without reading the DHT at all (the
    sticky group), and the three form one group. At round 7 ``a``'s last read of the holders is made
    older than ``HOLDERS_REUSE``: its gather reads the holders key again. Checked by hand: every gather
    read both keys at its start."""
    from peer.averaging.matchmaking import HOLDERS_REUSE

    with loopback_holders(3, "sticky", "L0M0", 4, CONFIG) as avgs:
        a, b, c = avgs
        int8, deltas = get_codec("int8"), _deltas(3)
        _average_together(avgs, (4, 5))
        reads = _CountedReads(a._matchmaker.dht)
        a._matchmaker.dht = reads
        results = {}
        for round_no in (6, 7):
            if round_no == 7:
                found, at = a._matchmaker._holders.last_read("L0M0")
                a._matchmaker._holders._last["L0M0"] = (found, at - HOLDERS_REUSE)
            key = group_key("sticky", "L0M0", round_no)
            with ThreadPoolExecutor(3) as pool:
                futures = [pool.submit(avg.average, "L0M0", round_no, [deltas[i]], 1.0, int8, 60.0)
                           for i, avg in ((1, b), (2, c))]
                wait_for(lambda: {b.peer_id, c.peer_id} <= set(a._matchmaker.pushed_to(key)), 60,
                         f"b's and c's pushed declarations of round {round_no}")
                futures.insert(0, pool.submit(a.average, "L0M0", round_no, [deltas[0]], 1.0, int8, 60.0))
                results[round_no] = [f.result(timeout=90) for f in futures]
            if round_no == 6:
                assert reads.reads == [], reads.reads
    for round_no, res in results.items():
        assert all(r.group_size == 3 for r in res), (round_no, [r.reason for r in res])
        assert all(torch.equal(r.averaged[0], res[0].averaged[0]) for r in res)
    assert reads.of(holders_key("sticky", "L0M0")), reads.reads
