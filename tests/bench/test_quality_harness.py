"""The quality sweep harness (``bench.quality*``) on a tiny config: every variant of the four
experiments runs and yields well-formed records, bytes follow the all-reduce formula, the routing
analysis agrees with routed evaluation, and a broken variant is recorded as failed, not dropped."""

from __future__ import annotations

import itertools
import json
import math
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

from bench.quality_report import summarize, tables
from bench.quality_runs import allreduce_bytes
from bench.quality_scale import SCALES, tiny
from bench.quality_sweeps import EXPERIMENTS, Point, grid, load_context, run_point, run_points
from models.corpus import Corpus, default_corpus
from models.data import prepare
from peer.localnet import wait_for
from peer.compression import get_codec

ROOT = Path(__file__).resolve().parents[2]

REQUIRED = ("diloco_best_bytes_ratio", "diloco_bpb_gap_at_best", "dipaco_bpb", "dense_p_bpb", "dense_2p_bpb",
            "dense_p_equal_compute_bpb", "hetero_speedup")


def _small_default(docs_per_source: int = 60) -> Corpus:
    """The first documents of each domain of the built-in corpus: real text, prepared in a second."""
    full = default_corpus()
    cut = lambda read: lambda corpus: itertools.islice(read(corpus), docs_per_source)  # noqa: E731
    return Corpus(name="default-small", sources=[(name, cut(read)) for name, read in full.sources])


@pytest.fixture(scope="module")
def data_dirs(tmp_path_factory):
    out = tmp_path_factory.mktemp("quality") / "bytes"
    prepare(_small_default(), out, levels=2, modules=2, tokenizer="bytes")
    return {"bytes": str(out)}


@pytest.fixture(scope="module")
def records(data_dirs):
    return run_points(grid(tiny()), tiny(), data_dirs, device="cpu", jobs=1)


def test_grid_covers_every_experiment_and_runner():
    points = grid(tiny())
    assert {p.experiment for p in points} == set(EXPERIMENTS)
    assert {p.runner for p in points} == {"sync", "diloco", "equivalence", "dense", "dipaco", "hetero", "sparse"}
    assert len({p.name for p in points}) == len(points)
    assert [p.experiment for p in grid(tiny(), ["hetero"])] == ["hetero"] * 3
    with pytest.raises(ValueError, match="unknown experiment"):
        grid(tiny(), ["nope"])


def test_every_variant_runs_and_is_well_formed(records):
    points = grid(tiny())
    assert [r["name"] for r in records] == [p.name for p in points]
    for r in records:
        assert r["status"] == "ok", (r["name"], r.get("error"), r.get("traceback"))
        res = r["result"]
        # learned something: better than a uniform byte predictor (8 bits per byte; a diverged model is
        # worse), and where the curve has several points, lower at the end than at its first evaluation
        assert math.isfinite(res["bpb"]) and 0 < res["bpb"] < 8.0, (r["name"], res["bpb"])
        curve = res["curve"]
        assert curve and curve[-1]["bpb"] == res["bpb"]
        assert len(curve) == 1 or curve[-1]["bpb"] < curve[0]["bpb"], (r["name"], curve)
        assert all(a["tokens"] < b["tokens"] for a, b in zip(curve, curve[1:])), r["name"]
        assert res["tokens"] == curve[-1]["tokens"] > 0


def test_bytes_follow_the_allreduce_formula(records):
    s = tiny()
    by = {r["name"]: r["result"] for r in records}
    sync, dl = by["sync-bytes"], by["diloco-bytes-H3-int4"]
    numel = sync["params"]
    assert sync["bytes_per_worker"] == pytest.approx(s.steps * allreduce_bytes(4 * numel, 4))
    assert allreduce_bytes(100, 4) == 150 and allreduce_bytes(100, 1) == 0
    # int4 is encoded per module; two rounds of H=3 in 6 steps.
    assert dl["rounds"] == 2
    assert dl["bytes_per_worker"] < by["diloco-bytes-H3-none"]["bytes_per_worker"] < sync["bytes_per_worker"]
    assert by["diloco-bytes-H3-none"]["bytes_per_worker"] == pytest.approx(2 * allreduce_bytes(get_codec("none").encoded_size(numel), 4))
    # Tokens are equal at equal steps and per-worker batch: DiLoCo against synchronous.
    assert dl["tokens"] == sync["tokens"]


def test_sparse_bytes_are_the_encoded_messages(records):
    """Sparse codecs: a member sends its parts to the other reducers and the average of its own part to the
    other members; uplink sizes are exact, averages are the encoded replies of the real rounds."""
    from bench.quality_sparse import sparse_summary
    from peer.averaging.partition import part_bounds, segment_bounds

    by = {r["name"]: r["result"] for r in records}
    sp = by["sparse-bytes-H2-topk16b2-lr1-m0"]
    codec = get_codec("topk16b2")
    assert sum(sp["module_numels"].values()) == sp["params"]
    up = sum(3 * codec.encoded_size(b - a) for n in sp["module_numels"].values() for s0, s1 in segment_bounds(n)
             for a, b in part_bounds(s1 - s0, [1.0] * 4) if b > a) / 4
    assert sp["rounds"] == 3 and sp["bytes_up"] == pytest.approx(3 * up)
    assert sp["bytes_down"] > 0 and sp["bytes_per_worker"] == pytest.approx(sp["bytes_up"] + sp["bytes_down"])
    assert sp["bytes_per_worker"] < by["diloco-bytes-H3-int4"]["bytes_per_worker"]
    summary = sparse_summary({n: r for n, r in by.items()}, [], {"replica_max_abs_diff": 0.0})
    assert summary["sparse_points"][0]["codec"] == "topk16b2" and summary["replica_max_abs_diff"] == 0.0


def test_dipaco_dense_and_routing_records(records):
    by = {r["name"]: r["result"] for r in records}
    dip = by["dipaco-2x2"]
    assert dip["params_per_path"] == by["dense-p"]["params"]
    assert by["dense-2p"]["params"] > 1.5 * by["dense-p"]["params"]
    assert by["dense-p-equal-compute"]["tokens"] == 4 * by["dense-p"]["tokens"] == dip["tokens"]
    routing = dip["routing"]
    # Per-token scoring of the analysis agrees with routed bits-per-byte evaluation.
    assert routing["bpb_prefix_routed"] == pytest.approx(dip["bpb"], rel=1e-4)
    assert routing["bpb_oracle_per_document"] <= routing["bpb_prefix_routed"] + 1e-9
    assert 0.0 <= routing["router_accuracy"] <= 1.0
    assert set(routing["bpb_rerouted"]) == {"8"}
    assert set(dip["shards"]) == {"0-0", "0-1", "1-0", "1-1"}


def test_simulator_and_peer_optimizer_agree_bit_for_bit(records):
    eq = next(r["result"] for r in records if r["name"].startswith("equivalence-"))
    assert eq["max_abs_weight_diff"] == 0.0 and eq["max_abs_diff_between_peers"] == 0.0
    assert eq["bpb"] == eq["simulator_bpb"]


def test_hetero_modes_share_the_simulated_clock(records):
    by = {r["name"]: r["result"] for r in records}
    step, time_, fast = by["hetero-step"], by["hetero-time"], by["hetero-fast"]
    assert time_["steps_per_round"] == [4, 4, 4, 1]
    assert step["steps_per_round"] == [4, 4, 4, 4] and step["round_time"] == 16
    assert fast["steps_per_round"] == [4, 4, 4]
    assert step["sim_time"] == time_["sim_time"] == fast["sim_time"]


def test_summary_has_the_issue_keys_and_tables_render(records):
    summary = summarize(records)
    for key in REQUIRED:
        assert key in summary
    for key in ("dipaco_bpb", "dense_p_bpb", "dense_2p_bpb", "dense_p_equal_compute_bpb"):
        assert isinstance(summary[key], float)
    assert summary["points_failed"] == {}
    assert len(summary["points_ok"]) == len(records)
    text = tables(records)
    assert "DiLoCo vs synchronous" in text and "DiPaCo vs dense" in text and "Heterogeneity" in text


def test_broken_variant_is_reported_failed_not_dropped(data_dirs):
    ctx = load_context(tiny(), data_dirs, "cpu")
    points = [Point("good", "diloco", "diloco", {"inner_steps": 3, "codec": "none"}),
              Point("bad-codec", "diloco", "diloco", {"inner_steps": 3, "codec": "bogus"}),
              Point("bad-runner", "outer", "no_such_runner")]
    recs = [run_point(ctx, p) for p in points]
    assert [r["status"] for r in recs] == ["ok", "failed", "failed"]
    assert "codec" in recs[1]["error"] and "no_such_runner" in recs[2]["error"]
    summary = summarize(recs)
    assert set(summary["points_failed"]) == {"bad-codec", "bad-runner"}
    assert "Failed points" in tables(recs)


def test_worker_processes_record_failures_too(data_dirs):
    points = [Point("hetero-fast", "hetero", "hetero", {"mode": "fast", "inner_steps": 4}),
              Point("bad-mode", "hetero", "hetero", {"mode": "sideways"})]
    recs = run_points(points, tiny(), data_dirs, device="cpu", jobs=2)
    assert [r["name"] for r in recs] == ["hetero-fast", "bad-mode"]
    assert recs[0]["status"] == "ok" and recs[1]["status"] == "failed"
    assert "sideways" in recs[1]["error"]


STOPPED_RUN = textwrap.dedent("""
    import json, multiprocessing, os, sys, time
    from pathlib import Path
    from bench import quality_runs
    from bench.common import run_main
    from bench.quality_scale import tiny
    from bench.quality_sweeps import Point, run_points

    def run_marked(ctx, name):  # a point that says it began, then takes a second
        with open(os.environ["MARKS"], "a") as f:
            f.write(name + "\\n")
        time.sleep(1.0)
        return {"name": name}

    quality_runs.run_marked = run_marked  # (the spawned workers import this file too)

    if __name__ == "__main__":
        out, data_dirs = Path(sys.argv[1]), json.loads(sys.argv[2])
        points = [Point(f"mark-{i}", "hetero", "marked", {"name": f"mark-{i}"}) for i in range(40)]

        def on_result(record):
            workers = [p.pid for p in multiprocessing.active_children()]
            with open(out / "done.jsonl", "a") as f:
                f.write(json.dumps({"name": record["name"], "workers": workers}) + "\\n")

        run_main(lambda: run_points(points, tiny(), data_dirs, device="cpu", jobs=2, on_result=on_result))
""")


def test_a_stopped_run_drops_the_points_not_begun_and_stops_its_workers(data_dirs, tmp_path):
    """SIGTERM to a run with worker processes (``--jobs``) stops it: the points not begun are not run
    and its workers exit with it (a pool left through a plain shutdown runs every queued point first).
    Each point writes its name when it begins and takes a second."""
    script = tmp_path / "run.py"
    script.write_text(STOPPED_RUN)
    done, marks = tmp_path / "done.jsonl", tmp_path / "marks.txt"
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path), json.dumps(data_dirs)], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "MARKS": str(marks)}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: proc.poll() is not None or (done.exists() and done.read_text().count("\n") >= 1), 300,
                 "the first point's record", interval=0.2)
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, out[-3000:]
    records = [json.loads(line) for line in done.read_text().splitlines()]
    assert 1 <= len(records) < 40
    workers = {pid for r in records for pid in r["workers"]}
    assert workers

    def gone(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True
    wait_for(lambda: all(gone(pid) for pid in workers), 120, "the workers to exit", interval=0.2)
    # no point began after the workers were stopped: at most those running and just handed out then
    begun = marks.read_text().split()
    assert len(begun) <= len(records) + 2 * 2, begun


@pytest.mark.parametrize("name", sorted(SCALES))
def test_every_preset_builds_its_grid_and_names_only_its_own_points_first(name):
    """A preset's ``priority`` lists points of its own grid, unique, and they come first, in order: a
    misspelt name would silently leave the point it meant to run last (or not at all when compute runs out)."""
    scale = SCALES[name]()
    points = grid(scale)
    names = [p.name for p in points]
    assert len(names) == len(set(names)), f"{name}: duplicate point names"
    missing = [n for n in scale.priority if n not in names]
    assert not missing, f"{name}: priority names points that are not in its grid: {missing}"
    assert names[:len(scale.priority)] == list(scale.priority)


def test_the_report_names_the_scale_that_met_the_goal_without_taking_its_figures(tmp_path):
    import json

    from bench.quality_report import goal_across_scales

    def write(name: str, meets: bool, ratio: float, gap: float, point: str) -> None:
        (tmp_path / f"quality_{name}.json").write_text(json.dumps(
            {"diloco_meets_goal": meets, "diloco_best_bytes_ratio": ratio if meets else None,
             "diloco_bpb_gap_at_best": gap if meets else None, "diloco_best_point": point if meets else None}))

    quick = {"diloco_meets_goal": False, "diloco_best_bytes_ratio": None, "scale_name": "quick"}
    assert goal_across_scales(quick, tmp_path) == {"diloco_best_scale": None}  # no scale met it
    write("wide", False, 0, 0, "")
    write("horizon", True, 1068.0, 0.013, "sparse-bytes-H16-topk16b2-lr1-m0")
    write("long", True, 1010.0, 0.019, "diloco-x")
    (tmp_path / "quality_broken.json").write_text("{not json")
    assert goal_across_scales(quick, tmp_path) == {  # named apart: quick's own keys stay its own
        "diloco_best_scale": None, "goal_elsewhere_file": "quality_horizon.json", "goal_elsewhere_bytes_ratio": 1068.0,
        "goal_elsewhere_bpb_gap": 0.013, "goal_elsewhere_point": "sparse-bytes-H16-topk16b2-lr1-m0"}
    # a scale that met it itself keeps its own point
    assert goal_across_scales({"diloco_meets_goal": True, "scale_name": "quick"}, tmp_path) == {
        "diloco_best_scale": "quick"}


def test_seeds_and_rates_change_the_run_and_the_summary_judges_the_mean(records):
    """The ``seeds`` experiment trains other weights and batches at another seed and another run at
    another rate (a seed or rate ignored would repeat ``sync-bytes`` bit for bit), and its summary
    compares each seeded point with the kept baseline at the same seed."""
    from bench.quality_seeds import seeds_summary

    s = tiny()
    by = {r["name"]: r["result"] for r in records}
    assert {"sync-bytes-lr0.006", "seed1/sync-bytes", "seed1/sync-bytes-lr0.006",
            "seed1/sparse-bytes-H2-topk16b2-lr1-m0"} <= set(by)
    assert by["seed1/sync-bytes"]["bpb"] != by["sync-bytes"]["bpb"]
    assert by["sync-bytes-lr0.006"]["bpb"] != by["sync-bytes"]["bpb"]
    assert by["seed1/sparse-bytes-H2-topk16b2-lr1-m0"]["bpb"] != by["sparse-bytes-H2-topk16b2-lr1-m0"]["bpb"]
    summary = seeds_summary(by, s, goal_ratio=1.0, goal_gap=10.0)
    lr = summary["sync_lr_best"]
    assert lr in (s.lr, 6e-3)
    base = {0: by["sync-bytes" if lr == s.lr else "sync-bytes-lr0.006"],
            1: by["seed1/sync-bytes" if lr == s.lr else "seed1/sync-bytes-lr0.006"]}
    row = summary["seed_points"][0]
    expected = {str(k): (by[n]["bpb"] - base[k]["bpb"]) / base[k]["bpb"]
                for k, n in ((0, "sparse-bytes-H2-topk16b2-lr1-m0"), (1, "seed1/sparse-bytes-H2-topk16b2-lr1-m0"))}
    assert row["gap_by_seed"] == pytest.approx(expected)
    assert summary["sparse_bpb_gap_mean"] == pytest.approx(sum(expected.values()) / 2)
    assert "Over seeds 0, 1" in tables(records, s)
    full = summarize(records, s)  # the report's summary carries the same keys (its goal: 1000x)
    assert full["sync_lr_best"] == lr and full["seed_points"] == summary["seed_points"]


def test_the_kept_rate_is_the_best_mean_and_a_point_missing_a_seed_is_not_judged():
    from bench.quality_scale import Scale
    from bench.quality_seeds import seeds_summary

    s = Scale(name="t", lr=1e-3, seed=0, seeds=(1, 2), sync_lrs=(2e-3,))
    r = lambda bpb, sent=1000.0: {"bpb": bpb, "bytes_per_worker": sent}  # noqa: E731
    ok = {"sync-bytes": r(2.0, 4e6), "seed1/sync-bytes": r(2.2, 4e6), "seed2/sync-bytes": r(1.6, 4e6),  # mean 1.933
          "sync-bytes-lr0.002": r(1.9, 4e6), "seed1/sync-bytes-lr0.002": r(2.0, 4e6),
          "seed2/sync-bytes-lr0.002": r(1.95, 4e6),  # mean 1.95: seed 2 alone would pick the other rate
          "sparse-bytes-H16-topk16b2-lr1-m0": r(2.0), "seed1/sparse-bytes-H16-topk16b2-lr1-m0": r(2.2),
          "seed2/sparse-bytes-H16-topk16b2-lr1-m0": r(1.6),
          "sparse-bytes-H8-topk16b2-lr1-m0": r(1.5), "seed1/sparse-bytes-H8-topk16b2-lr1-m0": r(1.5)}
    out = seeds_summary(ok, s, goal_ratio=1000.0, goal_gap=0.02)
    assert out["sync_lr_best"] == 1e-3 and out["sync_lr_best_at_edge"]
    assert [p["name"] for p in out["seed_points"]] == ["sparse-bytes-H16-topk16b2-lr1-m0"]  # H8 lacks seed 2
    assert out["sparse_bpb_gap_mean"] == pytest.approx(0.0) and out["sparse_goal_met_on_mean"]
    assert out["sparse_bytes_ratio_at_mean_point"] == pytest.approx(4000.0)
    ok["seed2/sparse-bytes-H16-topk16b2-lr1-m0"] = r(1.7)  # +6.25% at one seed: mean 2.08%, over the goal
    out = seeds_summary(ok, s, goal_ratio=1000.0, goal_gap=0.02)
    assert out["sparse_bpb_gap_mean"] == pytest.approx(0.0625 / 3) and not out["sparse_goal_met_on_mean"]
    assert out["sparse_bpb_gap_stdev"] > 0
    assert seeds_summary(ok, Scale(name="t"), 1000.0, 0.02) == {}  # no seeds: no keys


def test_a_points_key_leaves_out_the_grid_fields_and_keeps_the_sizes():
    """Adding a point to a grid (a field marked grid in :class:`bench.quality_scale.Scale`) keeps
    every other point's key, so stored points are reused; a size every point trains at does not."""
    from bench.quality import GRID_FIELDS, point_key

    scale = tiny()
    point = grid(scale)[0]
    key = point_key(point, scale, "cpu", "code")
    assert {"diloco_grid", "sparse_grid", "seeds", "priority"} <= set(GRID_FIELDS)
    assert "d_model" not in GRID_FIELDS and "steps" not in GRID_FIELDS
    assert point_key(point, scale.replace(seeds=(1, 2), priority=(point.name,)), "cpu", "code") == key
    assert point_key(point, scale.replace(d_model=scale.d_model * 2), "cpu", "code") != key
    assert point_key(point, scale, "cpu", "other code") != key
