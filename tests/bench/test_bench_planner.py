"""``bench.planner``'s keys from synthetic progress lines and status pages: utilization, rounds set
by a slow member, plans seen, the keys over seeds, and a run config reseeded."""

from __future__ import annotations

import random

import pytest

from bench.planner import (group_rounds, mbit, peer_rounds, plans_seen, reseed, sampled_rate, shaped_rate,
                           slowed_by_slowest, summarize, unrelayed, utilization)


def _round(t: float, module: str, rnd: int, seconds: float, peers=(), status: str = "done") -> dict:
    return {"time": t, "event": "round", "module": module, "round": rnd, "status": status, "peers": list(peers),
            "seconds": seconds}


def test_mbit_reads_tc_rates():
    assert mbit("10mbit") == 10.0 and mbit("1gbit") == 1000.0 and mbit("500kbit") == 0.5
    with pytest.raises(ValueError):
        mbit("10mbps")


def test_utilization_counts_the_waits_written_in_the_window():
    rng = random.Random(0)
    waits = [round(rng.uniform(0.1, 2.0), 3) for _ in range(20)]
    lines = [_round(100.0 + 5 * i, m, i, w / 2) for i, w in enumerate(waits) for m in ("L0M0", "L1M0")]
    lines.append({"time": 101.0, "event": "progress", "seconds": 50.0})  # not a round: never counted
    lines.append(_round(10.0, "L0M0", 0, 30.0))  # before the window
    assert utilization(lines, 100.0, 200.0) == pytest.approx(1 - sum(waits) / 100.0)
    assert utilization([_round(150.0, "L0M0", 1, 500.0)], 100.0, 200.0) == 0.0
    assert peer_rounds(lines, 100.0, 200.0) == 20 and peer_rounds(lines) == 21
    with pytest.raises(ValueError):
        utilization(lines, 5.0, 5.0)


def test_slowed_rounds_compare_the_slowest_member_with_the_median():
    ids = {"id-a": "a", "id-b": "b", "id-c": "c", "id-d": "d"}
    lines = {
        # round 1: a (10) with b (25) and c (100): median 25, 10 < 12.5 -> slowed
        "a": [_round(10.0, "L0M0", 1, 0.5, ["id-a", "id-b", "id-c"]), _round(20.0, "L0M0", 2, 0.5, ["id-a", "id-d"])],
        "b": [_round(10.2, "L0M0", 1, 0.5, ["id-a", "id-b", "id-c"])],
        # round 2 of L0M0 is a and d (10 and 10): not slowed; a failed round and a lone one never count
        "d": [_round(20.1, "L0M0", 2, 0.5, ["id-a", "id-d"]), _round(30.0, "L0M1", 3, 0.5, ["id-d"]),
              _round(31.0, "L0M1", 4, 0.5, ["id-d", "id-c"], status="failed")],
        # c's link drops from 100 to 10 at t=40: with b (25) median 17.5, 10 < 8.75 is false
        "c": [_round(50.0, "L1M1", 7, 0.5, ["id-c", "id-b"]), _round(60.0, "L1M1", 8, 0.5, ["id-c", "id-b", "id-x"])],
    }
    groups = group_rounds(lines, ids, 0.0, 100.0)
    assert groups == [(10.0, ["a", "b", "c"]), (20.0, ["a", "d"]), (50.0, ["b", "c"]), (60.0, ["b", "c"])]
    rate = shaped_rate({"a": 10.0, "b": 25.0, "c": 100.0, "d": 10.0}, "c", 10.0, 40.0)
    assert rate("c", 39.0) == 100.0 and rate("c", 40.0) == 10.0
    assert slowed_by_slowest(groups, rate) == {"count": 1, "rounds": 4, "share": 0.25}
    # measured rates: unknown before the first sample, so round 1 is left out
    measured = sampled_rate([(15.0, {"a": 1.0, "b": 9.0, "c": 9.0, "d": 9.0}), (45.0, {"c": 1.0})])
    assert measured("a", 10.0) is None and measured("c", 50.0) == 1.0 and measured("b", 50.0) == 9.0
    assert slowed_by_slowest(groups, measured) == {"count": 3, "rounds": 3, "share": 1.0}
    assert slowed_by_slowest([], rate) == {"count": 0, "rounds": 0, "share": None}


def test_plans_seen_lists_each_planned_plan_once():
    run = {"inner_steps": 10, "codec": "int8", "from_round": 0, "reason": "the run's H and codec"}
    planned = {"inner_steps": 10, "codec": "int4", "overlap": False, "from_round": 12, "reason": "passes the budget"}
    behind = {"inner_steps": 80, "codec": "int4", "overlap": True, "from_round": 20, "reason": "passes the budget"}
    statuses = [
        {"modules": [{"module_id": "L0M0", "plan": {**run, "next": None}}]},
        {"modules": [{"module_id": "L0M0", "plan": {**run, "next": planned}}]},
        {"modules": [{"module_id": "L0M0", "plan": {**planned, "next": None}}, {"module_id": "embed"}]},
        {"modules": [{"module_id": "L0M0", "plan": {**planned, "next": behind}}]},
    ]
    assert plans_seen(statuses) == [{"module": "L0M0", **planned}, {"module": "L0M0", **behind}]


def test_unrelayed_connections_are_those_between_namespaces_off_the_relay_ports():
    lines = [
        "0      0      127.0.0.1:40000 127.0.0.1:51234",  # the relay to its daemon, inside the namespace
        "0      0      10.87.0.2:51000 10.87.0.3:40001",  # to another peer's relay (p2p)
        "0      0      10.87.0.2:40002 10.87.0.4:52000",  # into our lane's relay
        "0      0      10.87.0.2:53000 10.87.0.1:7700",  # to the coordinator
        "0      0      [::ffff:10.87.0.2]:46662 [::ffff:10.87.0.1]:10165",  # the same, IPv4-mapped
        "0      0      10.87.0.2:54000 10.87.0.5:40000",  # straight to a daemon: not relayed
    ]
    assert unrelayed(lines, "10.87.0.1") == ["10.87.0.2:54000 -> 10.87.0.5:40000"]


def _run(util: float, bpb: float, slowed: tuple[int, int], plans: int = 0, diff: float = 0.0,
         tokens: tuple[int, ...] = (100, 100)) -> dict:
    count, rounds = slowed
    part = {"count": count, "rounds": rounds, "share": count / rounds}
    return {"utilization": util, "bpb": {"mean": bpb}, "replica_max_abs_diff": diff, "plan_changes_total": float(plans),
            "tokens_by_peer": {f"p{i + 1}": t for i, t in enumerate(tokens)},
            "plans": [{"module": "L0M0", "inner_steps": 20}] * plans,
            "rounds_slowed_by_slowest": {**part, "measured": {"count": 0, "rounds": rounds, "share": 0.0}}}


def test_the_keys_are_over_the_seeds_each_seed_a_paired_difference():
    runs = {0: {"planner": _run(0.9, 2.0, (1, 10), plans=2, tokens=(300, 100)), "fixed": _run(0.5, 2.1, (4, 10))},
            1: {"planner": _run(0.95, 2.3, (0, 20), plans=1, diff=1e-3), "fixed": _run(0.6, 2.2, (5, 10))}}
    out = summarize(runs)
    assert out["tokens_planner_over_fixed_by_seed"] == {"0": 2.0, "1": 1.0} and out["tokens_planner_over_fixed"] == 1.5
    assert out["utilization_planner"] == pytest.approx(0.925) and out["utilization_fixed"] == pytest.approx(0.55)
    assert out["utilization_planner_by_seed"] == {"0": 0.9, "1": 0.95}
    assert out["bpb_planner_vs_fixed_by_seed"] == {"0": -0.1, "1": 0.1}
    assert out["bpb_planner_vs_fixed"] == pytest.approx(0.0) and out["bpb_planner_vs_fixed_stdev"] == pytest.approx(0.1414, abs=1e-4)
    assert out["rounds_slowed_by_slowest"]["planner"] == {"count": 1, "rounds": 30, "share": 0.0333,
                                                          "measured": {"count": 0, "rounds": 30, "share": 0.0}}
    assert out["rounds_slowed_by_slowest"]["fixed"]["share"] == pytest.approx(0.45)
    assert out["replica_max_abs_diff"] == 1e-3
    assert out["plan_changes"]["count"] == 3 and [p["seed"] for p in out["plan_changes"]["plans"]] == [0, 0, 1]
    one = summarize({0: {"planner": _run(0.9, 2.0, (1, 10))}})  # one variant: no difference, no spread
    assert "bpb_planner_vs_fixed" not in one and "tokens_planner_over_fixed" not in one
    assert one["utilization_planner"] == 0.9


def test_reseed_changes_the_seed_and_keeps_the_coordinator_table(tmp_path):
    from models.presets import PRESETS, load_run_config, read_toml

    cfg = PRESETS["demo"]().replace(outer={"inner_steps": 10})
    path = tmp_path / "run.toml"
    path.write_text(cfg.to_toml(coordinator={"planner": True, "planner_codecs": "int4"}))
    reseed(path, 2)
    assert load_run_config(path, ignore_sections=("coordinator",)) == cfg.replace(seed=2)
    assert read_toml(path)["coordinator"] == {"planner": True, "planner_codecs": "int4"}


def test_an_overlap_budget_goes_to_the_planner_run_only_and_names_its_own_result():
    from bench.planner import result_name, variant_settings

    assert variant_settings("planner") == {"planner": True, "planner_codecs": "int4"}
    assert variant_settings("planner", 0.3) == {"planner": True, "planner_codecs": "int4", "overlap_budget": 0.3}
    assert variant_settings("fixed", 0.3) == {"planner": False}
    assert (result_name(0.0), result_name(0.3)) == ("planner", "planner_overlap")
