"""The exchange planner end to end, as real processes on loopback: a coordinator that plans, and two
peers whose links it believes slow (``--upload-mbps``, in place of the join probe). The planner gives
the modules a lighter codec from an agreed round; both peers switch at that round, their exchanges
shrink, and their replicas stay bit-identical across the switch."""

from __future__ import annotations

import re

import pytest

from peer.localnet import wait_for
from helpers.network import tiny_network
from helpers.replicas import assert_identical_at_equal_rounds

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PLANNED = {"planner_codecs": "int4", "plan_interval": 1.0, "plan_lead_rounds": 2, "max_inner_steps_factor": 1}
"""The ``[coordinator]`` table of a dense run (both peers hold every module) whose planner may only change the
codec (H stays 5)."""


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    from models.corpus import default_corpus
    from models.data import Dataset, prepare

    out = tmp_path_factory.mktemp("data") / "default-bytes-1x1"
    prepare(default_corpus(), out, levels=1, modules=1, tokenizer="bytes")
    return Dataset(out)


def test_two_peers_switch_codec_at_the_planned_round_and_stay_identical(procs, tmp_path, dataset):
    net = tiny_network(procs, tmp_path / "net", dataset.dir, dataset.manifest_hash, inner_steps=5, coordinator=PLANNED,
                  lattice={"levels": 1, "modules_per_level": 1}, outer={"entropy": "none"})
    net.start_coordinator()
    # 0.05 Mbit/s: a round's exchange of the dense run's modules takes far more than its compute
    roots = [net.start_peer(name, "--upload-mbps", "0.05") for name in ("a", "b")]
    plan_re = re.compile(r"exchange plan: module L0M0: H=5, int4 from round (\d+)")
    wait_for(lambda: plan_re.search(procs.log("a")) and plan_re.search(procs.log("b")), 300,
             "both peers to hear of the planner's int4 plan for L0M0")
    start = int(plan_re.search(procs.log("a")).group(1))
    assert int(plan_re.search(procs.log("b")).group(1)) == start
    status = net.status_json()
    row = next(m for m in status["modules"] if m["module_id"] == "L0M0")
    assert (row["plan"]["next"] or row["plan"])["codec"] == "int4"

    def rounds_done(name: str) -> dict[int, dict]:
        return {e["round"]: e for e in net.progress_lines(name) if e.get("event") == "round"
                and e["module"] == "L0M0" and e["status"] == "done" and e["group_size"] == 2}

    wait_for(lambda: all(sum(r >= start + 1 for r in rounds_done(n)) >= 2 for n in ("a", "b")), 300,
             f"both peers to average two rounds of L0M0 together after round {start}")
    assert net.stop("a", timeout=180) == 0 and net.stop("b", timeout=180) == 0
    done = rounds_done("a")
    before = [e["bytes_sent"] for r, e in done.items() if r < start]
    after = [e["bytes_sent"] for r, e in done.items() if r >= start]
    assert before and after and max(after) < min(before), (start, sorted(done))  # int4 parts are about half int8's
    assert_identical_at_equal_rounds([r / "checkpoints" for r in roots], min_pairs=2)
