"""The sparse codec through the real peer path: coordinator, assignment, matchmaking,
all-reduce and the outer step on loopback; replicas of every module stay bit-identical."""

from __future__ import annotations

import pytest

from bench.sparse_network import sparse_network

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_sparse_codec_keeps_replicas_bit_identical_over_the_network(tmp_path):
    out = sparse_network(tmp_path, peers=3, rounds=3, codec="topk16b2", inner_steps=5, timeout=300.0)
    assert out["assigned_codecs"] == ["topk16b2"] * 3  # the coordinator's assignment carried it
    assert out["exit_codes"] == [0, 0, 0]
    assert out["pairs_compared"] >= 3
    assert out["replica_max_abs_diff"] == 0.0
    assert all(b > 0 for b in out["bytes_sent_per_peer"])
