"""A restarted peer resumes from its own checkpoint: with no other holder of its modules alive, a peer
stopped after a few rounds and started again on the same work directory loads its modules at the round
it checkpointed (not the seed's init, which is what it would get if the checkpoint were ignored) and
trains on from there. Real coordinator, real peer, real DHT and p2p daemon on loopback."""

from __future__ import annotations

import re

import pytest

from chaos.scenario import prepare_dataset
from helpers.network import tiny_network
from peer.localnet import wait_for

pytestmark = pytest.mark.integration

_ROUND = re.compile(r"peer\.node\.trainer: round (\d+): .*embed r(\d+)")
_START = re.compile(r"module embed: starting from (\w+) \(round (\d+)\)")


def _embed_rounds(text: str) -> list[int]:
    """The group round of ``embed`` in each of the trainer's round lines."""
    return [int(m[2]) for m in map(_ROUND.search, text.splitlines()) if m]


def test_restarted_peer_resumes_from_its_own_checkpoint(procs, tmp_path):
    data = prepare_dataset(tmp_path / "data")
    net = tiny_network(procs, tmp_path, data.dir, data.manifest_hash, inner_steps=4)
    try:
        net.start_coordinator()
        net.start_peer("peer0")
        wait_for(lambda: len(_embed_rounds(net.procs.log("peer0"))) >= 3, 180, "peer0 to finish 3 rounds")
        assert net.stop("peer0") == 0  # drains and checkpoints
        first = net.procs.log("peer0")
        starts = [(m[1], int(m[2])) for m in _START.finditer(first)]
        assert starts == [("init", 0)], starts  # the first incarnation had nothing to resume
        reached = max(_embed_rounds(first))
        assert reached >= 2

        net.start_peer("peer0")  # same work dir: same identity, same checkpoints
        wait_for(lambda: len(_START.findall(net.procs.log("peer0"))) >= 2, 120, "peer0 to load its state again")
        second = net.procs.log("peer0")[len(first):]
        origin, round_no = _START.search(second).groups()
        assert (origin, int(round_no)) == ("checkpoint", reached + 1), (origin, round_no, reached)
        # and it trains on from there, not from round 0
        wait_for(lambda: _embed_rounds(net.procs.log("peer0")[len(first):]), 120, "a round after the restart")
        assert min(_embed_rounds(net.procs.log("peer0")[len(first):])) > reached
    finally:
        net.close()
