"""Link rates measured from a peer's own averaging rounds (peer.diloco.LinkRates), and the
coordinator keeping them in place of the join probe's figures."""

from __future__ import annotations

import pytest

from coordinator.core import Coordinator
from coordinator.records import Capabilities
from coordinator.settings import CoordinatorSettings
from coordinator.sqlite_store import SQLiteStore
from models.presets import tiny_cpu
from peer.diloco import LinkRates, ModuleReport
from peer.diloco.link_rates import MIN_MEASURED_BYTES, SMOOTHING

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
