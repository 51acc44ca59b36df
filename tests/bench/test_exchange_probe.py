"""bench.exchange_probe: the fit of the simulator's exchange constants, and a probe of real averaging
processes on loopback."""

from __future__ import annotations

import psutil
import pytest

from bench.exchange_probe import fit, measure


def test_the_fit_recovers_latency_and_part_cpu_and_the_cores_slow_larger_groups():
    latency, part = 0.02, 0.01
    points = [(n, latency + part * (n - 1) * max(1.0, n / 2)) for n in (2, 3, 4, 6)]
    out = fit(points, cores=2)
    assert out["latency"] == pytest.approx(latency) and out["part_cpu"] == pytest.approx(part)
    assert out["max_residual_s"] == pytest.approx(0.0, abs=1e-12)
    # the same times read on 6 cores: no sharing, a different slope
    assert fit(points, cores=6)["part_cpu"] != pytest.approx(part)


def test_a_negative_intercept_is_refitted_through_the_origin_and_nothing_is_negative():
    out = fit([(2, 0.001), (3, 0.05), (4, 0.12)], cores=2)
    assert out["latency"] == 0.0 and out["part_cpu"] > 0
    assert fit([(2, 0.3), (3, 0.2)], cores=2)["part_cpu"] == 0.0
    with pytest.raises(ValueError, match="two sizes"):
        fit([(2, 0.1), (2, 0.2)], cores=2)


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_a_probe_averages_real_processes_at_each_size_and_fits_the_constants(tmp_path):
    from bench.scale_calibrate import MODULE, _dataset

    _, run = _dataset()
    out = measure(run, MODULE, sizes=(2, 3), rounds=3, work=tmp_path)
    assert [r["members"] for r in out["rows"]] == [2, 3]
    for r in out["rows"]:  # every counted round of every member averaged with all the others
        assert r["exchanges"] == r["members"] * 2 and r["failed"] == 0, r
        assert r["transfer_s_median"] > 0
    assert out["part_cpu"] >= 0 and out["latency"] >= 0 and out["cores"] >= 1
    assert out["wire_bytes"] > 0
    # every member printed its exchanges, and none is left running once it returns
    logs = sorted(p.name for p in (tmp_path / "logs").iterdir())
    assert logs == [f"n{n}-member{i}.log" for n in (2, 3) for i in range(n)]
    members = [p for p in psutil.Process().children(recursive=True)
               if "bench.exchange_probe" in " ".join(_cmdline(p))]
    assert members == [], members


def _cmdline(p) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:  # gone meanwhile
        return []
