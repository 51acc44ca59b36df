"""bench.scale's simulator in its quick mode: fixed seed, seconds, behaviour that could fail."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from bench.scale_sim import SimConfig, simulate
from bench.scale_sim.population import draw_peers
from bench.scale_sim.swarm import PART_CPU, Swarm, _Peer
from coordinator.records import MODE_PATH
from peer.network.records import group_bucket, group_buckets, group_key, split_levels

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


def test_churn_happened_and_uncovered_paths_were_covered_again(result):
    f = result.figures
    assert f["departures"] >= 5 and f["kills"] >= 1
    assert f["joins"] >= 5
    assert f["uncovered_paths_open_at_end"] == 0


def test_a_path_that_loses_its_only_peer_is_reassigned_within_a_lease_and_a_tick():
    """Kill every peer of one path without a word (no replacement volunteers arrive): the path then has
    no peer at all; the coordinator must notice (its lease expires) and move a peer of another path
    to it within one lease timeout plus one tick of the kill."""
    cfg = SimConfig(peers=12, duration=200.0, ramp=20.0, leave_per_hour=0.0, seed=5, replace_departures=False)
    with tempfile.TemporaryDirectory() as d:
        swarm = Swarm(cfg, Path(d))
        lease, tick = swarm.settings.lease_timeout, swarm.settings.tick_interval
        seen: dict[str, float] = {}

        def strike() -> None:
            on = {}
            for p in swarm.peers.values():
                if p.alive and p.assignment is not None and p.assignment.mode == MODE_PATH:
                    on.setdefault(p.assignment.path, []).append(p)
            path, victims = min(on.items(), key=lambda kv: (len(kv[1]), kv[0]))
            assert len(on) == swarm.run.lattice.num_paths  # every path was covered before
            seen["path"], seen["killed_at"], seen["victims"] = path, swarm.loop.now(), {p.spec.peer_id for p in victims}
            for p in victims:
                swarm._kill(p)
            watch()

        def watch() -> None:
            holders = set(swarm.coord.view.path_peers.get(seen["path"], {}))
            if not holders:  # the victims' leases expired: the path has no peer
                seen.setdefault("uncovered_at", swarm.loop.now())
            if holders - seen["victims"]:
                seen["covered_at"] = swarm.loop.now()
                return
            swarm.loop.after(0.1, watch)

        swarm.loop.at(cfg.ramp + 60.0, strike)
        swarm.simulate()
    assert len(seen["victims"]) >= 1
    # either the view showed the path empty, or the tick that expired the leases moved a peer at once
    assert seen.get("uncovered_at", seen.get("covered_at", 0)) >= seen["killed_at"]
    assert "covered_at" in seen, "the path was never reassigned"
    assert seen["covered_at"] - seen["killed_at"] <= lease + tick + 0.5


def test_rounds_complete_and_are_measured(result):
    f = result.figures
    assert f["peer_rounds"] > 50
    assert CFG.round_seconds <= f["round_s_median"] <= CFG.round_seconds + CFG.round_timeout
    # a round's part after its compute: matchmaking and the exchange, within the round and its timeout
    assert 0 < f["exchange_s_median"] <= f["exchange_s_p90"] <= CFG.round_timeout
    assert f["exchange_s_median"] < f["round_s_median"] - 0.5 * CFG.round_seconds
    assert f["heartbeats_per_s"] == pytest.approx(CFG.peers / 5.0, rel=0.25)
    assert f["dht_ops_per_peer_round"] > 0 and f["coordinator_cpu_s"] > 0
    assert 0 < f["churn_compute_loss"] < 1


def test_same_seed_same_figures(result):
    again = simulate(CFG).figures
    timing = {"wall_s", "coordinator_cpu_s", "coordinator_cpu_share", "coordinator_join_cpu_ms_median",
              "coordinator_join_cpu_ms_p99"}
    assert {k: v for k, v in again.items() if k not in timing} == {
        k: v for k, v in result.figures.items() if k not in timing}


def test_an_exchange_costs_processing_per_part_and_slows_with_the_peers_sharing_a_machine():
    """Each member handles every other member's part (``PART_CPU`` a part on a core of its own): the
    exchange of a larger group takes longer by that much, and peers that share ``exchange_cores``
    (a calibration's peers on one machine) take as many times longer as there are live peers a core."""
    import random

    specs = draw_peers(random.Random(0), 12, 0.0, 0.0)
    times = {}
    for cores in (0.0, 1.0, 3.0):
        with tempfile.TemporaryDirectory() as d:
            swarm = Swarm(SimConfig(peers=12, seed=0, exchange_cores=cores), Path(d))
            for spec in specs:
                swarm.peers[spec.peer_id] = _Peer(spec)
            module = "embed"
            members = list(swarm.peers.values())
            times[cores] = [swarm._exchange_seconds(module, members[:n]) for n in (2, 12)]
            times[cores, "bytes"] = [swarm._exchange_seconds(module, members[:n]) - (n - 1) * PART_CPU
                                     * swarm._cpu_slowdown() for n in (2, 12)]
    # the same bytes and latency in every case: only the processing differs
    assert times[0.0, "bytes"] == pytest.approx(times[1.0, "bytes"])
    assert times[0.0, "bytes"] == pytest.approx(times[3.0, "bytes"])
    own, one, three = times[0.0], times[1.0], times[3.0]
    assert own[1] - times[0.0, "bytes"][1] == pytest.approx(11 * PART_CPU)
    assert one[1] - own[1] == pytest.approx(11 * PART_CPU * 11)  # 12 live peers on one core: 12x
    assert three[1] - own[1] == pytest.approx(11 * PART_CPU * 3)  # on three cores: 4x
    assert one[0] - own[0] == pytest.approx(PART_CPU * 11)


def test_split_groups_rule():
    """The bucket rule of ``max_group_size`` (real code in peer.network.records): one group up to the
    bound (today's key), a power of two of groups above it, the same bucket on every peer, new groups
    every round, groups of about the bound."""
    assert group_buckets(8, 0) == 1 and group_buckets(64, 64) == 1
    assert group_buckets(65, 64) == 2 and group_buckets(1000, 64) == 16 and group_buckets(1025, 64) == 32
    ids = [f"12D3KooWtest{i:012d}" for i in range(1000)]
    k = group_buckets(len(ids), 64)
    sizes = [0] * k
    for p in ids:
        sizes[group_bucket("embed", 7, p, k)] += 1
    assert max(sizes) <= 100 and min(sizes) >= 30
    assert [group_bucket("embed", 7, p, k) for p in ids[:50]] == [group_bucket("embed", 7, p, k) for p in ids[:50]]
    assert [group_bucket("embed", 7, p, k) for p in ids[:50]] != [group_bucket("embed", 8, p, k) for p in ids[:50]]
    # a peer that counted half as many groups is in the union of two of the others' groups
    assert all(group_bucket("embed", 7, p, k) % (k // 2) == group_bucket("embed", 7, p, k // 2) for p in ids)
    assert group_key("run", "embed", 7) == "run_embed_r7_group"
    assert group_key("run", "embed", 7, 3) == "run_embed_r7_b3_group"
    with pytest.raises(ValueError):
        group_key("run", "embed", 7, -1)


def test_bounded_groups_at_500_peers():
    """500 peers on 2x2: one group a module holds every holder; ``max_group_size`` bounds it and the
    DHT bytes a peer reads per round. A holder draws its bucket from the holders it counts when it
    declares (``SplitRounds.plan``), not when its round began: the first round after the ramp, begun
    by peers that counted from a few holders to all of them, is split like the rounds after it
    (a draw at each peer's round start gives a largest group of 70 here). What remains above the cap
    is the spread of hashed buckets, whose mean is at most the cap."""
    one = simulate(SimConfig(peers=500, duration=300.0, ramp=60.0, seed=1)).figures
    split = simulate(SimConfig(peers=500, duration=300.0, ramp=60.0, seed=1, max_group_size=32)).figures
    assert one["group_size_max"] > 300
    assert split["group_size_mean"] <= 40 and split["group_size_max"] <= 2 * 32
    assert split["dht_bytes_per_peer_round"] < one["dht_bytes_per_peer_round"] / 4
    assert split["round_s_median"] <= one["round_s_median"] + 5.0


def test_split_rounds_gain_levels_in_the_simulator_and_no_group_of_delegates_exceeds_the_cap():
    """500 peers on 2x2 capped at 8 (the real ``split_levels``: 64 buckets of the shared modules' 500
    holders, 8 groups of 8 delegates, a top group of 8): three levels, every group of delegates and
    every top group within the cap, and rounds go through."""
    assert split_levels(500, 8) == (64, 8)
    split = simulate(SimConfig(peers=500, duration=300.0, ramp=60.0, seed=1, max_group_size=8)).figures
    assert split["split_levels_max"] == 3
    assert 0 < split["upper_group_size_max"] <= 8
    assert split["top_groups"] > 0 and split["top_groups_failed"] < split["top_groups"]
    assert split["peer_rounds"] > 500  # about two rounds a peer in the window, as with two levels



@pytest.mark.slow  # two 1,000-peer runs: make test-all
def test_the_census_design_counts_about_as_many_holders_from_a_bounded_read():
    """``SimConfig.census`` (:mod:`bench.scale_sim.census`): a census level of at most the bound stands
    for about as many holders as there are, every reader settles on the same level from any start, and
    at 1,000 peers capped at 64 a peer reads fewer DHT bytes a round than with the whole holders key."""
    from bench.scale_sim.census import census_depth, census_estimate, census_level

    depths = [census_depth("embed", f"12D3KooWtest{i:012d}") for i in range(4096)]
    count = lambda s: sum(d >= s for d in depths)  # noqa: E731
    level = census_level(count, 128)
    assert count(level) <= 128 < count(level - 1)
    assert census_level(count, 128, start=0) == census_level(count, 128, start=30) == level
    assert 4096 * 0.75 <= census_estimate(count(level), level) <= 4096 * 1.25
    base = dict(peers=1000, duration=300.0, seed=0, max_group_size=64)
    today = simulate(SimConfig(**base)).figures
    census = simulate(SimConfig(**base, census=True)).figures
    assert census["dht_bytes_per_peer_round"] < today["dht_bytes_per_peer_round"]
    assert census["peer_rounds"] > today["peer_rounds"] / 2 and census["top_groups"] > 0
