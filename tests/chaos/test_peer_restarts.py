"""Fault suite: a peer killed with ``kill -9`` and restarted, twice, in a network of a
coordinator, an archive and three peers on loopback.

Faults fire on conditions (rounds reached), never on sleeps. Invariants at the end: replicas at equal
rounds bit-identical over every peer and the archive, no acknowledged round lost, every process exits
on SIGTERM, loss still falling; and the restarted peer really trained again after each restart.
"""

from __future__ import annotations

import pytest

from peer.localnet.faults import FaultInjector, rounds_done
from peer.localnet.checks import acknowledged_rounds
from chaos.scenario import finish_and_check, prepare_dataset
from peer.localnet.checks import settled
from helpers.network import tiny_network

pytestmark = pytest.mark.integration


@pytest.mark.slow  # the default run's kill -9 and bit-identical return: test_peer_network's kill9 test
def test_peer_killed_and_restarted_twice(procs, tmp_path):
    data = prepare_dataset(tmp_path / "data")
    net = tiny_network(procs, tmp_path, data.dir, data.manifest_hash, inner_steps=8, lease_timeout=6.0)
    inj = FaultInjector(net)
    names = ["peer0", "peer1", "peer2"]
    try:
        net.start_coordinator()
        archive = net.start_archive()
        works = [net.start_peer(n) for n in names]
        roots = [archive, *[w / "checkpoints" for w in works]]
        inj.when(lambda: settled(net, names), 120, "the network to form (3 rounds each, no fork left)")
        baseline = acknowledged_rounds(roots)
        for attempt in range(2):
            inj.kill("peer1")
            # the others keep going while it is down
            done = {n: rounds_done(net, n) for n in names}
            inj.when(lambda: rounds_done(net, "peer0") > done["peer0"], 60, "peer0 to finish a round without peer1")
            inj.restart("peer1")
            # the restarted incarnation trains again: its trainer logs a new round
            inj.when(lambda: rounds_done(net, "peer1") > done["peer1"], 90, f"restart {attempt + 1} of peer1 to finish a round")
        assert inj.fired("kill") == 2 and inj.fired("restart") == 2
        assert net.procs.log("peer1").count("joined run") + net.procs.log("peer1").count("rejoined") >= 3
        report = finish_and_check(net, names, roots, min_round=baseline, min_pairs=3)
        print(inj.timeline(), report)
    finally:
        net.close()
