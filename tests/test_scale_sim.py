"""bench.scale's simulator (issue 25) in its quick mode: fixed seed, seconds, behaviour that could fail."""

from __future__ import annotations

import pytest

from bench.scale_sim import SimConfig, simulate

CFG = SimConfig(peers=10, duration=1800.0, ramp=60.0, leave_per_hour=4.0, seed=3)
"""Heavy churn (four departures per peer-hour) on few peers per path, so paths lose their last peer."""


@pytest.fixture(scope="module")
def result():
    return simulate(CFG)


def test_every_peer_gets_work_or_a_clear_refusal(result):
    f = result.figures
    assert result.unserved == []
    assert f["peers_served"] + f["refused"] == f["peers_ever"]
    assert f["refused"] >= 1  # the population has peers too small for any module
    assert all("no work fits" in r and "join with more memory" in r for r in result.refusals)




def test_churn_happened_and_work_was_reassigned_within_a_lease(result):
    f = result.figures
    assert f["departures"] >= 5 and f["kills"] >= 1
    assert f["joins"] >= 5
    # peers outnumber paths: every path left without a peer got one back within a lease (+ a tick)
    assert max(result.uncovered_spans, default=0.0) <= 30.0 + 1.0
    assert f["uncovered_paths_open_at_end"] == 0


def test_rounds_complete_and_are_measured(result):
    f = result.figures
    assert f["peer_rounds"] > 50
    assert CFG.round_seconds <= f["round_s_median"] <= CFG.round_seconds + CFG.round_timeout
    assert f["heartbeats_per_s"] == pytest.approx(CFG.peers / 5.0, rel=0.25)
    assert f["dht_ops_per_peer_round"] > 0 and f["coordinator_cpu_s"] > 0
    assert 0 < f["churn_compute_loss"] < 1


def test_same_seed_same_figures(result):
    again = simulate(CFG).figures
    timing = {"wall_s", "coordinator_cpu_s", "coordinator_cpu_share", "coordinator_join_cpu_ms_median",
              "coordinator_join_cpu_ms_p99"}
    assert {k: v for k, v in again.items() if k not in timing} == {
        k: v for k, v in result.figures.items() if k not in timing}
