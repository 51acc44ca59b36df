"""The archive's scoring of its snapshots (peer.node.archive_eval): the bits per byte it reports for
each complete path are what ``train-local`` measured on the same run directory and data, and the
background evaluator hands each result to one delivered heartbeat. A real archive's report reaching the
coordinator's status page is asserted in test_peer_network's three-peer network test."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from helpers import write_corpus
from peer.localnet import hivepath_cmd, wait_for
from models.corpus import corpus_from_paths
from models.data import Dataset, prepare
from peer.node.archive_eval import SnapshotEvaluator, evaluate_snapshot

ENV = {"HIVEPATH_THREADS": "1", "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("archive_eval")
    src = write_corpus(root / "src", per_domain=20)
    prepare(corpus_from_paths([str(src / d) for d in ("scripture", "plays", "code")]), root / "d", levels=2, modules=2)
    out = root / "run"
    r = subprocess.run(hivepath_cmd("train-local", "--data", str(root / "d"), "--path", "1,0", "--steps", "3",
                                    "--eval-docs", "2", "--out", str(out)),
                       capture_output=True, text=True, timeout=240, env={**os.environ, **ENV})
    assert r.returncode == 0, r.stderr
    return out, Dataset(root / "d")


def test_scores_each_complete_path_as_train_local_did(trained):
    out, dataset = trained
    summary = json.loads((out / "run.json").read_text())
    results = evaluate_snapshot(out, dataset, 2)
    assert [r.path for r in results] == [(1, 0)], "only the path whose modules the snapshot holds"
    assert results[0].bpb == pytest.approx(summary["eval"]["per_path"]["1,0"]["bpb"], rel=1e-9)
    assert 0 < results[0].bpb < 64


def test_evaluator_keeps_results_until_a_heartbeat_delivered_them(trained):
    out, dataset = trained
    evaluator = SnapshotEvaluator(dataset, 2)
    assert evaluator.pending() == []
    evaluator.submit(out)
    wait_for(lambda: evaluator.scored == 1, 120, "the snapshot scored")
    sent = evaluator.pending()
    assert [r.path for r in sent] == [(1, 0)]
    assert evaluator.pending() is sent, "sent again until delivered"
    evaluator.delivered(sent)
    assert evaluator.pending() == []
    with pytest.raises(ValueError, match="max_documents"):
        SnapshotEvaluator(dataset, 0)
    with pytest.raises(ValueError, match="min_interval"):
        SnapshotEvaluator(dataset, 1, min_interval=-1.0)
