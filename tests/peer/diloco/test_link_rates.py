"""Link rates measured from a peer's own averaging rounds (peer.diloco.LinkRates), and the
coordinator keeping them in place of the join probe's figures."""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from coordinator.core import Coordinator
from coordinator.records import Capabilities
from coordinator.settings import CoordinatorSettings
from coordinator.sqlite_store import SQLiteStore
from models.presets import tiny_cpu
from peer.averaging.contract import LinkTimes
from peer.diloco import LinkRates, ModuleReport
from peer.diloco.link_rates import MIN_MEASURED_BYTES, MIN_MEASURED_SECONDS, SMOOTHING, best_rate

MB = 1 << 20


def report(mid: str, sent: int, received: int, seconds: float) -> ModuleReport:
    return ModuleReport(mid, 0, True, bytes_sent=sent, bytes_received=received, transfer_seconds=seconds)


def test_a_round_of_several_modules_is_one_measurement_of_the_shared_link():
    rates = LinkRates()
    # two modules exchanged at once: 3 MiB up and 1 MiB down in the longest all-reduce's 2 s
    assert rates.observe([report("L0M0", 2 * MB, MB // 2, 2.0), report("L1M0", MB, MB // 2, 1.5)])
    assert rates.upload_bps == pytest.approx(3 * MB / 2.0)
    assert rates.download_bps == pytest.approx(MB / 2.0)
    assert (rates.upload_rounds, rates.download_rounds) == (1, 1)


def test_the_estimate_follows_a_changed_link_smoothly():
    rates = LinkRates()
    rates.observe_exchange(4 * MB, 4 * MB, 1.0)
    rates.observe_exchange(4 * MB, 4 * MB, 4.0)  # the link dropped to a quarter
    expected = 4 * MB + SMOOTHING * (MB - 4 * MB)
    assert rates.upload_bps == pytest.approx(expected) and rates.download_bps == pytest.approx(expected)
    for _ in range(30):
        rates.observe_exchange(4 * MB, 4 * MB, 4.0)
    assert rates.upload_bps == pytest.approx(MB, rel=1e-3)


def test_tiny_rounds_and_unmeasured_exchanges_are_left_out():
    rates = LinkRates()
    assert not rates.observe_exchange(MIN_MEASURED_BYTES - 1, MIN_MEASURED_BYTES - 1, 1.0)
    assert not rates.observe_exchange(8 * MB, 8 * MB, 0.0)  # a lone holder's round: nothing crossed a network
    assert not rates.observe([report("L0M0", 8 * MB, 8 * MB, 0.001)])
    assert (rates.upload_bps, rates.download_bps) == (0.0, 0.0)
    assert rates.observe_exchange(8 * MB, 0, 2.0)  # only the upload counted
    assert rates.upload_bps == pytest.approx(4 * MB) and rates.download_bps == 0.0


def shared_link(capacity: float, sizes: list[int], caps: list[float], step: float = 0.001) -> list[tuple[float, int]]:
    """When each transfer of ``sizes`` bytes ends, all starting at 0 over one link of ``capacity``
    bytes/s shared max-min fairly, transfer i going no faster than ``caps[i]`` (its other end's
    link): a fluid model of one member's parts to fast and slow members."""
    left, done, t = list(map(float, sizes)), [], 0.0
    while len(done) < len(sizes):
        active = [i for i in range(len(sizes)) if left[i] > 0]
        rate, share = {}, capacity
        for i in sorted(active, key=lambda i: caps[i]):  # water-filling: slow ends first take their cap
            rate[i] = min(caps[i], share / (len(active) - len(rate)))
            share -= rate[i]
        t += step
        for i in active:
            left[i] -= rate[i] * step
            if left[i] <= 0:
                done.append((t, sizes[i]))
    return done


def test_a_slow_member_does_not_drag_down_a_fast_members_figure():
    mb = 1e6
    capacity = 10 * mb  # our link
    # our parts to four members: three with links as fast as ours, one twenty times slower
    through = shared_link(capacity, [MB] * 4, [capacity, capacity, capacity, capacity / 20])
    end = max(t for t, _ in through)
    totals = 4 * MB / end  # what the totals over the whole exchange say
    assert totals < 0.5 * capacity
    measured = best_rate(0.0, through)
    assert 0.9 * capacity <= measured <= capacity
    # as reports: a figure from the parts, not from the totals
    rates = LinkRates()
    assert rates.observe([ModuleReport("L0M0", 0, True, bytes_sent=4 * MB, transfer_seconds=end,
                                       link_times=LinkTimes(0.0, 0.0, up=through))])
    assert rates.upload_bps == pytest.approx(measured) and rates.download_bps == 0.0


@pytest.mark.parametrize("seed", range(20))
def test_the_figure_is_never_above_the_link_and_never_below_the_totals(seed):
    rng = random.Random(seed)
    capacity = rng.uniform(1e5, 1e8)
    n = rng.randint(1, 8)
    sizes = [rng.randint(MIN_MEASURED_BYTES // 2, 4 * MB) for _ in range(n)]
    caps = [capacity * rng.choice([0.01, 0.1, 0.5, 1.0, 2.0]) for _ in range(n)]
    through = shared_link(capacity, sizes, caps, step=max(sum(sizes) / capacity / 2000, 1e-4))
    end = max(t for t, _ in through)
    measured = best_rate(0.0, through)
    if sum(sizes) < MIN_MEASURED_BYTES or end < MIN_MEASURED_SECONDS:
        return
    assert measured is not None
    assert sum(sizes) / end * 0.999 <= measured <= capacity * 1.01  # the model's time steps: 1 part in 2000


def test_modules_of_a_round_are_one_measurement_from_the_earliest_start():
    early = LinkTimes(10.0, 10.0, up=[(11.0, MB)], down=[(12.0, MB)])
    late = LinkTimes(11.0, 10.5, up=[(12.0, MB)], down=[(12.0, MB)])
    rates = LinkRates()
    assert rates.observe([ModuleReport("L0M0", 0, True, link_times=early),
                          ModuleReport("L1M0", 0, True, link_times=late),
                          ModuleReport("L1M1", 0, True, bytes_sent=50 * MB, transfer_seconds=1.0)])  # totals only
    assert rates.upload_bps == pytest.approx(2 * MB / 2.0)  # both modules' parts, from 10.0
    assert rates.download_bps == pytest.approx(2 * MB / 2.0)
    merged = early.merge(late)
    assert (merged.up_from, merged.down_from, len(merged.up), len(merged.down)) == (10.0, 10.0, 2, 2)


def test_parts_too_small_or_too_soon_are_not_a_measurement():
    assert best_rate(0.0, [(MIN_MEASURED_SECONDS / 2, 4 * MB)]) is None
    assert best_rate(0.0, [(1.0, MIN_MEASURED_BYTES - 1)]) is None
    assert best_rate(0.0, [(0.01, MB), (1.0, MB)]) == pytest.approx(2 * MB)
    rates = LinkRates()
    assert not rates.observe([ModuleReport("L0M0", 0, True, link_times=LinkTimes(0.0, 0.0, up=[(1.0, 1000)]))])
    assert rates.upload_rounds == 0


def test_rounds_after_the_warm_up_give_the_rates_and_the_overhead_beyond_the_bytes():
    from peer.diloco import RoundReport
    from peer.diloco.link_rates import WARMUP_ROUNDS

    rates = LinkRates()

    def round_(blocked: float, applied: bool = True) -> RoundReport:
        m = ModuleReport("L0M0", 0, applied, bytes_sent=2 * MB, bytes_received=MB, transfer_seconds=1.0,
                         wait_seconds=blocked, link_times=LinkTimes(0.0, 0.0, up=[(1.0, 2 * MB)], down=[(1.0, MB)]))
        return RoundReport(0, 10, 1000.0, 5.0, {"L0M0": m})

    for _ in range(WARMUP_ROUNDS):  # start-up: waiting for the others
        assert not rates.observe_round(round_(60.0))
    assert (rates.overhead_s, rates.upload_bps) == (0.0, 0.0)
    assert rates.observe_round(round_(4.0))  # 2 MiB up at 2 MiB/s, 1 MiB down at 1 MiB/s: 2 s of bytes
    assert rates.overhead_s == pytest.approx(2.0)
    rates.observe_round(round_(1.0))  # less than the bytes take: no overhead this round
    assert rates.overhead_s == pytest.approx(2.0 + SMOOTHING * (0.0 - 2.0))
    before = rates.overhead_s
    rates.observe_round(round_(300.0, applied=False))  # a failed round's wait says nothing of the overhead
    assert rates.overhead_s == before


def test_a_round_exchanged_behind_the_next_one_counts_what_its_exchange_would_have_blocked():
    """In overlap mode training waits for (next to) nothing: the overhead is the longest exchange's
    length beyond its bytes, or the planner would read an overlapped plan as free and leave it."""
    from peer.diloco import RoundReport
    from peer.diloco.link_rates import WARMUP_ROUNDS

    def round_(exchange: float, overlap: bool) -> RoundReport:
        mods = {mid: ModuleReport(mid, 0, True, bytes_sent=MB, bytes_received=MB // 2, transfer_seconds=1.0,
                                  wait_seconds=0.01, exchange_seconds=exchange - k,
                                  link_times=LinkTimes(0.0, 0.0, up=[(1.0, MB)], down=[(1.0, MB // 2)]))
                for k, mid in enumerate(("L0M0", "L1M0"))}
        return RoundReport(0, 10, 1000.0, 5.0, mods, overlap=overlap)

    overlapped, waited = LinkRates(), LinkRates()
    for rates, overlap in ((overlapped, True), (waited, False)):
        for _ in range(WARMUP_ROUNDS + 1):
            rates.observe_round(round_(6.0, overlap))
    # 2 MiB up at 2 MiB/s and 1 MiB down at 1 MiB/s: 2 s of bytes; the longer exchange took 6 s
    assert overlapped.overhead_s == pytest.approx(4.0)
    assert waited.overhead_s == 0.0  # what it waited: 0.02 s, less than the bytes take


STALL_S = 8.0
"""The least time one member of the group holds its loop once the other two have passed each other
their parts of this vector (far longer than they took to do so on an idle machine)."""
STALL_FACTOR = 8.0
"""On a slower (loaded) machine the hold is this many times longer than the round had taken until
then: holder 0 sends 4 parts' worth of bytes in all, one of them before the hold, so its whole
exchange's rate is at most half the rate of that one part whenever the hold is at least 8 times what
passing it took."""


def test_a_stalled_member_does_not_set_the_others_figures():
    """Three holders average one round over real DHTs and p2p daemons on loopback; holder 2 stalls its
    loop at the first part it accepts (a busy, slow peer; every member has formed the group by then),
    before acknowledging it. Holders 0 and 1 pass each other their parts (a part acknowledged while
    holder 2 stalls can only be acknowledged by the other of the two) and holder 2 stays stalled for
    :data:`STALL_FACTOR` times as long as that took, so their exchange as a whole waits for holder 2:
    their figures come from those parts, not from the stall."""
    from helpers.averagers import loopback_holders
    from peer.compression import get_codec

    stall_ended: list[float] = []
    acknowledged = [threading.Event(), threading.Event()]

    def on_ack(i: int):
        return lambda point: acknowledged[i].set() if point == "part_acknowledged" else None

    def staller(point: str) -> None:
        if point == "part_accepted" and not stall_ended:
            deadline = time.monotonic() + 120  # past it, the checks below say what did not happen
            for event in acknowledged:
                event.wait(max(0.0, deadline - time.monotonic()))
            took = time.monotonic() - began
            time.sleep(max(STALL_S, STALL_FACTOR * took))
            stall_ended.append(time.monotonic())

    numel = 3 << 20  # int8: about 1 MiB a member's part
    deltas = [torch.randn(numel, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    options = [dict(event_hook=on_ack(0)), dict(event_hook=on_ack(1)), dict(event_hook=staller)]
    with loopback_holders(3, "linkrates", "L0M0", 0, "dddd0000dddd0000", options) as avgs:
        began = time.monotonic()
        with ThreadPoolExecutor(3) as pool:
            results = list(pool.map(lambda i: avgs[i].average("L0M0", 0, [deltas[i]], 1.0, get_codec("int8"), 600.0),
                                    range(3)))
    for res in results:
        assert res.group_size == 3, res.reason
    assert torch.equal(results[0].averaged[0], results[2].averaged[0])
    for res in results[:2]:
        times = res.link_times
        assert res.transfer_seconds >= STALL_S / 2  # the exchange as a whole waited for the stalled member
        before = [e for e in times.up if e[0] < stall_ended[0]]
        assert sum(n for _, n in before) >= MIN_MEASURED_BYTES, "no part went up before the stall ended"
        assert sum(n for _, n in times.up) == res.bytes_sent  # every contribution and average we sent
        assert 0 < sum(n for _, n in times.down) < res.bytes_received  # the averages, not the contributions
        report = ModuleReport("L0M0", 0, True, bytes_sent=res.bytes_sent, bytes_received=res.bytes_received,
                              transfer_seconds=res.transfer_seconds, link_times=times)
        from_parts, from_totals = LinkRates(), LinkRates()
        from_parts.observe([report])
        from_totals.observe_exchange(res.bytes_sent, res.bytes_received, res.transfer_seconds)
        assert from_parts.upload_bps >= 2 * from_totals.upload_bps
        assert from_parts.upload_bps >= best_rate(times.up_from, before)


RUN = tiny_cpu().replace(data={"manifest_hash": "ab" * 8})


def test_heartbeats_replace_the_probe_figures_and_they_survive_a_restart(tmp_path):
    now = [1_000_000.0]
    store = SQLiteStore(tmp_path / "state.db")
    coord = Coordinator(RUN, CoordinatorSettings(), store, clock=lambda: now[0])
    probe = Capabilities("cpu", 8 << 30, 1000.0, 12e6, 12e6, ("/ip4/127.0.0.1/tcp/4000",))
    j = coord.join("12D3KooWpeer00000001", b"k", probe)
    coord.heartbeat(j.lease.lease_id, "12D3KooWpeer00000001")  # an old peer: no rates, the probe's stay
    assert coord.peer("12D3KooWpeer00000001").capabilities.upload_bps == 12e6
    assert coord.peer("12D3KooWpeer00000001").link_measured_at == 0.0
    now[0] += 5
    coord.heartbeat(j.lease.lease_id, "12D3KooWpeer00000001", link_bps=(1.5e6, 0.0))
    peer = coord.peer("12D3KooWpeer00000001")
    assert (peer.capabilities.upload_bps, peer.capabilities.download_bps) == (1.5e6, 12e6)  # down not measured
    assert peer.link_measured_at == now[0]
    coord.store.apply(coord.take_dirty())
    store.close()
    again = Coordinator(RUN, CoordinatorSettings(), SQLiteStore(tmp_path / "state.db"), clock=lambda: now[0])
    assert again.peer("12D3KooWpeer00000001").capabilities.upload_bps == 1.5e6
