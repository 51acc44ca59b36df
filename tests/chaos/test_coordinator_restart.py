"""Fault suite: the coordinator killed with ``kill -9`` mid-run and restarted on the same
``--db``, in a network of a coordinator, an archive and three peers on loopback.

While it is down the peers keep training and averaging (every peer completes two more rounds with the
coordinator process dead); once it is back, its status lists the same live peers as before the kill
(from its SQLite store and the peers' heartbeats). Then the usual invariants: replicas identical at
equal rounds, no acknowledged round lost, every process exits on SIGTERM, loss still falling.
"""

from __future__ import annotations

import pytest

from peer.localnet.faults import FaultInjector, rounds_done
from peer.localnet.checks import acknowledged_rounds
from chaos.scenario import finish_and_check, prepare_dataset
from peer.localnet.checks import settled
from helpers.network import tiny_network

pytestmark = pytest.mark.integration


def live_peers(net) -> set[str]:
    return {p["peer_id"] for p in (net.status() or {}).get("peers", []) if p["state"] == "active"}


def test_coordinator_kill9_and_restart_on_the_same_db(procs, tmp_path):
    data = prepare_dataset(tmp_path / "data")
    net = tiny_network(procs, tmp_path, data.dir, data.manifest_hash, inner_steps=8, lease_timeout=8.0)
    inj = FaultInjector(net)
    names = ["peer0", "peer1", "peer2"]
    try:
        net.start_coordinator()
        archive = net.start_archive()
        works = [net.start_peer(n) for n in names]
        roots = [archive, *[w / "checkpoints" for w in works]]
        inj.when(lambda: settled(net, names) and {net.peer_id(n) for n in names} <= live_peers(net), 120,
                 "three live peers, the network formed")
        baseline = acknowledged_rounds(roots)
        before = live_peers(net)  # the three peers and the archive
        client = "peer.coordinator_client.client:"  # heartbeat failures ("unreachable", "stream ... ended")
        noticed = {n: net.procs.log(n).count(client) for n in names}
        inj.kill_coordinator()
        coordinator = net.procs.procs["coordinator"]
        # every peer notices (a failed heartbeat), then trains on: two more rounds with the coordinator dead
        inj.when(lambda: all(net.procs.log(n).count(client) > noticed[n] for n in names), 30,
                 "every peer to notice the coordinator is gone")
        at_notice = {n: rounds_done(net, n) for n in names}

        def advanced_while_down() -> bool:
            assert coordinator.poll() is not None, "the coordinator came back by itself?"
            return all(rounds_done(net, n) >= at_notice[n] + 2 for n in names)

        inj.when(advanced_while_down, 90, "every peer to finish 2 rounds while the coordinator is down")
        assert all(net.procs.procs[n].poll() is None for n in names), "a peer died with the coordinator"
        inj.restart_coordinator()
        # the same live peers, from the restored store and the peers' next heartbeats
        inj.when(lambda: live_peers(net) == before, 30, f"status to list the same live peers {sorted(before)}")
        at_restart = {n: rounds_done(net, n) for n in names}
        inj.when(lambda: all(rounds_done(net, n) >= at_restart[n] + 3 for n in names), 60, "3 rounds after the restart")
        # still the same live peers once the restart grace is over (every lease renewed by a heartbeat)
        inj.when(lambda: live_peers(net) == before, 30, f"status to still list the live peers {sorted(before)}")
        report = finish_and_check(net, names, roots, min_round=baseline, min_pairs=3)
        print(inj.timeline(), report)
    finally:
        net.close()
