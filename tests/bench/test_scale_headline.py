"""bench.scale's headline keys, read from synthetic sweep rows (no simulation)."""

from __future__ import annotations

from bench.scale import headline, runs


def _row(run: str, peers: int, round_s: float, exchange_s: float, levels: int, group: float) -> dict:
    return {"run": run, "peers": peers, "peers_ever": peers, "refused": 0, "round_s_median": round_s,
            "exchange_s_median": exchange_s, "split_levels_max": levels, "group_size_mean": group,
            "dht_ops_per_peer_round": 10.0, "dht_bytes_per_peer_round": 1000.0 * peers,
            "coordinator_cpu_share": 0.1, "churn_compute_loss": 0.0, "max_group_members": 8,
            "upper_group_size_max": 8}


def test_ratio_runs_cover_ten_thousand_peers_with_the_small_cap():
    ratio = [cfg for tag, cfg in runs(quick=False, seed=0) if tag == "ratio"]
    assert [c.peers for c in ratio] == [10, 1000, 10_000]
    assert {c.max_group_size for c in ratio} == {8}


def test_headline_divides_each_ratio_run_by_the_ten_peer_run():
    rows = [_row("after", 10, 120.0, 4.0, 1, 6.0), _row("after", 10_000, 130.0, 40.0, 3, 36.0),
            _row("ratio", 10, 100.0, 4.0, 1, 5.0), _row("ratio", 1000, 110.0, 8.0, 2, 7.0),
            _row("ratio", 10_000, 150.0, 60.0, 5, 7.5)]
    out = headline(rows)
    assert out["round_time_ratio_1000_vs_10"] == 1.1
    assert out["round_time_ratio_10000_vs_10"] == 1.5
    assert out["noncompute_round_ratio_10000_vs_10"] == 15.0
    assert out["round_time_ratio_split_levels"] == [1, 2, 5]
    assert out["round_time_ratio_group_sizes"] == [5.0, 7.0, 7.5]


def test_headline_without_the_large_ratio_run_reports_none():
    rows = [_row("after", 10, 120.0, 4.0, 1, 6.0), _row("ratio", 10, 100.0, 4.0, 1, 5.0),
            _row("ratio", 1000, 110.0, 8.0, 2, 7.0)]
    out = headline(rows)
    assert out["round_time_ratio_1000_vs_10"] == 1.1
    assert out["round_time_ratio_10000_vs_10"] is None
    assert out["round_time_ratio_split_levels"] is None
