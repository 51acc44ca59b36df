"""bench.scale_calibrate's quick mode: a real coordinator and 4 real peers on loopback, and
the simulator describing the same run, give comparable figures. The target on the error lives in the
benchmark, not here."""

from __future__ import annotations

import math

import pytest

from bench.exchange_probe import SIZES
from bench.scale_calibrate import QUICK, calibrate, headline

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.mark.timeout(600)
def test_quick_calibration_compares_real_and_simulated_rounds(tmp_path):
    result = calibrate(QUICK, tmp_path)
    rows, model = result["rows"], result["model"]
    out = headline(QUICK, rows, model)
    assert out["largest_real_peers"] == 4 and [r["peers"] for r in rows] == [4]
    # the simulator ran with the exchange constants measured here at every size the probe takes,
    # whatever the largest network (a fit on 2-4 members takes latency for per-part cost), the fixed ones beside
    assert model["source"] == "probe" and [r["members"] for r in model["rows"]] == list(SIZES)
    assert out["sim_model"]["PART_CPU"] == model["part_cpu"] > 0 and out["sim_model"]["LATENCY"] >= 0
    row = rows[0]
    assert row["sim_fixed"]["round_s_median"] > 0
    assert out["sim_vs_real_noncompute_error_fixed_constants"] == row["noncompute_error_fixed"]
    for side in ("real", "sim"):
        f = row[side]
        assert f["round_s_median"] > 0, (side, f)
        # rounds are bounded by round_seconds, then averaged: never shorter than the compute budget
        assert f["round_s_median"] >= 0.9 * QUICK.round_seconds, (side, f)
        assert f["peer_rounds"] >= 4, (side, f)
        assert 1 <= f["group_size_mean"] <= 4, (side, f)
    assert row["sim"]["refused"] == 0
    assert row["real"]["failed_round_share"] < 0.5
    error = out["sim_vs_real_round_time_error"]
    assert error is not None and math.isfinite(error) and error >= 0
    assert error == pytest.approx(abs(row["sim"]["round_s_median"] - row["real"]["round_s_median"])
                                  / row["real"]["round_s_median"])
