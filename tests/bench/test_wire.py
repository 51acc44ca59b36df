"""``bench.wire``'s and ``bench.wire_split``'s arithmetic on their runs' summaries, and their refusal of
settings they cannot compare."""

import subprocess
import sys
from pathlib import Path

import pytest

from bench.wire import wire_keys

ROOT = Path(__file__).resolve().parents[2]


def _run(payload: float, wire: float, rounds: int = 16, wall: float = 32.0, idle: float = 1000.0) -> dict:
    return dict(bytes_sent_per_peer=payload, wire_tx_bytes_per_peer=wire, rounds=rounds, wall_seconds=wall,
                idle_tx_bytes_per_peer_s=idle)


def test_ratios_control_bytes_and_upkeep():
    ddp = _run(payload=256 * 1_000_000, wire=256 * 1_100_000)
    sparse = _run(payload=16 * 10_000, wire=16 * 210_000)
    got = wire_keys(ddp, sparse, steps=256, modules=4, params=250_000)
    assert got["payload_bytes_ratio_vs_ddp"] == 1600.0
    assert got["wire_bytes_ratio_vs_ddp"] == round(256 * 1.1e6 / (16 * 210_000), 1)
    assert got["per_round_control_bytes"] == 200_000 and got["per_module_round_control_bytes"] == 50_000
    assert got["payload_bytes_per_round"] == 10_000 and got["wire_bytes_per_round"] == 210_000
    assert got["round_seconds_mean"] == 2.0 and got["upkeep_bytes_per_round"] == 2000
    assert got["ddp_wire_over_payload"] == 1.1 and got["ddp_wire_bytes_per_step"] == 1_100_000


def test_the_1000x_size_solves_the_linear_model():
    ddp = _run(payload=256 * 1_000_000, wire=256 * 1_100_000)
    sparse = _run(payload=16 * 10_000, wire=16 * 210_000)
    got = wire_keys(ddp, sparse, steps=256, modules=4, params=250_000)
    p = got["params_for_1000x_wire"]
    # at that size: DDP's payload per 16 steps over the sparse round's framed payload plus its control bytes
    ddp_bytes = 16 * (1_000_000 / 250_000) * p
    sparse_bytes = (10_000 / 250_000) * 1.1 * p + 200_000
    assert ddp_bytes / sparse_bytes == pytest.approx(1000.0, rel=1e-4)
    assert got["payload_ratio_limit"] == 1600.0


def test_no_size_reaches_1000x_when_the_payload_ratio_stays_under_it():
    ddp = _run(payload=256 * 1_000_000, wire=256 * 1_100_000)
    sparse = _run(payload=16 * 20_000, wire=16 * 220_000)  # 800x on the payload
    got = wire_keys(ddp, sparse, steps=256, modules=4, params=250_000)
    assert got["payload_ratio_limit"] == 800.0 and got["params_for_1000x_wire"] is None


def test_no_idle_window_leaves_the_upkeep_unreported():
    ddp = _run(payload=256e6, wire=280e6)
    sparse = _run(payload=160_000, wire=3_000_000, idle=None)
    got = wire_keys(ddp, sparse, steps=256, modules=4, params=250_000)
    assert got["idle_bytes_per_s"] is None and got["upkeep_bytes_per_round"] is None


@pytest.mark.parametrize("bench, argv, message", [
    ("wire", ["--variants", "h18"], "bench.wire runs ddp,sparse,sparse_plain_dht"),
    ("wire", ["--steps", "250"], "a multiple of the sparse run's H = 16"),
    ("wire_split", ["--variants", "h18"], "bench.wire_split runs sparse"),
    ("wire_split", ["--peers", "4"], "more peers than the cap"),
    ("wire_split", ["--steps", "60"], "a multiple of H = 16"),
])
def test_settings_it_cannot_compare_are_refused(bench, argv, message):
    out = subprocess.run([sys.executable, "-m", f"bench.{bench}", *argv], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_split_wire_counts_the_tree_as_payload_and_the_rest_as_control():
    """``bench.wire_split``: 17 holders capped at 4 are 8 buckets, so 9 of 17 members receive the
    round's average down a tree (bytes the averager does not count): each member's mean share of
    them is payload, and what the interface sent beyond is control."""
    from bench.wire_split import real_keys

    v = dict(rounds=4, failed_rounds=0, replica_max_abs_diff=0.0, replicas_identical=True, mean_group_size=2.5,
             bytes_sent_per_peer=4 * 50_000, wire_tx_bytes_per_peer=4 * 400_000, wall_seconds=40.0,
             wait_seconds_mean=8.0, idle_tx_bytes_per_peer_s=1000.0, failures=[])
    got = real_keys(v, peers=17, cap=4, module_sizes=[10_000, 7_000, 7_000, 10_000])
    tree = 34_000 * 9 / 17
    assert got["split_levels"] == 3
    assert got["tree_bytes_per_round_estimated"] == round(tree)
    assert got["payload_bytes_per_round"] == round(50_000 + tree)
    assert got["control_bytes_per_peer_round"] == round(400_000 - 50_000 - tree)
    assert got["compute_seconds_per_round"] == 8.0 and got["upkeep_bytes_per_round"] == 10_000


def test_split_wire_simulates_the_same_size_in_three_levels():
    from bench.wire_split import simulated

    sim = simulated(peers=17, cap=4, rate_mbit=50, round_seconds=8.0, round_timeout=60.0, rounds=4, preset="demo")
    assert sim["sim_split_levels"] == 3 and sim["sim_peer_rounds"] >= 17
    assert sim["sim_control_bytes_per_peer_round"] > 0


def test_dht_requests_per_round_average_each_peer_s_counts_over_its_rounds():
    from bench.utilization import _requests_per_round

    runs = [dict(rounds=8, dht_requests=dict(find_requests=80, store_requests=16)),
            dict(rounds=4, dht_requests=dict(find_requests=20, store_requests=4, hivemind_read_batches=2))]
    assert _requests_per_round(runs) == dict(find_requests=7.5, store_requests=1.5, hivemind_read_batches=0.2)
    # a peer with hivemind's DHT as it is counts nothing: no figure rather than a low one
    assert _requests_per_round([runs[0], dict(rounds=8, dht_requests=None)]) is None
