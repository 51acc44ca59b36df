"""Peers of several versions in one run, as real processes on loopback (docs/upgrade.md).

One dense run (a 1x1 lattice: every peer holds every module): a peer of this release averages with a
peer that speaks the previous minor of every contract (the same code, ``HIVEPATH_TEST_PROTOCOL``), and
their replicas stay bit-identical; a peer of the next major is refused at join with a message naming
both versions (exit 7). Then the operator restarts the coordinator with ``min_peer_version`` above
this release: the peer still running drains, keeps its checkpoint and exits 7, and a new one is
refused at join.
"""

from __future__ import annotations

import signal

import pytest

from peer.localnet import wait_for
from helpers.network import tiny_network
from helpers.replicas import assert_identical_at_equal_rounds
from peer.node import CheckpointDir
from protos import versions

pytestmark = pytest.mark.integration

DENSE = {"levels": 1, "modules_per_level": 1}
"""Admits every release; every peer holds every module, so each round is one group of all of them."""


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    from models.corpus import default_corpus
    from models.data import Dataset, prepare

    out = tmp_path_factory.mktemp("data") / "default-bytes-1x1"
    prepare(default_corpus(), out, levels=1, modules=1, tokenizer="bytes")
    return Dataset(out)


def test_mixed_versions_average_or_are_refused_by_name(procs, tmp_path, dataset):
    net = tiny_network(procs, tmp_path / "net", dataset.dir, dataset.manifest_hash, inner_steps=5, lattice=DENSE,
                       coordinator={"min_peer_version": ""})
    try:
        net.start_coordinator()
        current = net.start_peer("current")
        net.env = {**net.env, "HIVEPATH_TEST_PROTOCOL": "all=1.0"}
        # alone after the current peer stops, it steps a round a second until the restarted coordinator
        # drains it: it keeps every snapshot, so the rounds it shared with the current peer are still there
        previous = net.start_peer("previous", "--keep-checkpoints", "1000")
        net.env = {**net.env, "HIVEPATH_TEST_PROTOCOL": "all=2.0"}
        net.start_peer("next")
        net.env = {k: v for k, v in net.env.items() if k != "HIVEPATH_TEST_PROTOCOL"}

        # the next major is refused at join, by name, in one line
        assert procs.procs["next"].wait(timeout=300) == 7, procs.log("next")[-3000:]
        refusal = [line for line in procs.log("next").splitlines() if line.startswith("hivepath: error:")]
        ours = versions.CONTRACTS["coordinator"].text
        assert len(refusal) == 1 and f"protocol: this peer speaks 2.0 and the coordinator {ours}" in refusal[0], \
            procs.log("next")[-3000:]

        # this release and the previous minor average together, round after round
        wait_for(lambda: procs.log("current").count("averaged by 2") >= 3, 300,
                 "the current and the previous-minor peer to average three rounds together")
        assert "averaged by 2" in procs.log("previous")
        first_line = next(line for line in procs.log("current").splitlines() if not line.startswith("{"))
        assert f"hivepath {versions.RELEASE}" in first_line and "protocols coordinator" in first_line
        status = net.status_json()
        assert sorted(p["version"] for p in status["peers"]) == ["", versions.RELEASE]  # 1.0 states no release
        assert status["versions"]["release"] == versions.RELEASE

        assert net.stop("current", timeout=180) == 0
        # the operator requires a newer release than this one and restarts the coordinator
        net.run_toml.write_text(net.run_toml.read_text().replace('min_peer_version = ""',
                                                                 'min_peer_version = "99.0"'))
        procs.signal("coordinator", signal.SIGTERM)
        procs.procs["coordinator"].wait(timeout=60)
        procs.start("coordinator2", procs.procs["coordinator"].args, env=net.env)
        code = procs.procs["previous"].wait(timeout=300)
        log = procs.log("previous")
        assert code == 7, log[-3000:]
        # told by a heartbeat, or refused at the re-join a heartbeat makes when its lease did not survive the restart
        error = [line for line in log.splitlines() if line.startswith("hivepath: error:")]
        assert len(error) == 1 and "99.0 or newer" in error[0] and "pip install -U 'hivepath>=99.0'" in error[0], log[-3000:]
        assert CheckpointDir(previous / "checkpoints").snapshots(), "the drained peer kept no checkpoint"
        assert_identical_at_equal_rounds([current / "checkpoints", previous / "checkpoints"], min_pairs=2)

        # a peer below min_peer_version is refused at join, naming what to install
        net.start_peer("late")
        assert procs.procs["late"].wait(timeout=300) == 7, procs.log("late")[-3000:]
        late = procs.log("late")
        assert f"this peer runs hivepath {versions.RELEASE} and the run requires 99.0 or newer" in late
    finally:
        net.close()
