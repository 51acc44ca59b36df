"""Fault suite: one peer's link drops to 1 Mbit/s. Coordinator and three peers each in a
network namespace behind one bridge; a dense (1x1) lattice so every round involves every peer.

While peer2's egress is shaped to 1 Mbit/s (``tbf``), the others' rounds go on without waiting for it:
each of their rounds ends within the round deadline (``round_timeout``) plus the round's inner steps.
The slow peer keeps training and either averages (its part of the all-reduce is sized by bandwidth) or
is dropped from a round and re-syncs; after the link recovers the usual invariants hold.
Needs root and network namespaces (the CI runs as root); skipped with the reason otherwise.
"""

from __future__ import annotations

import re
import time

import pytest

from peer.localnet.faults import FaultInjector, rounds_done
from peer.localnet.checks import acknowledged_rounds
from helpers.network import tiny_network
from chaos.scenario import finish_and_check, prepare_dataset
from peer.localnet.checks import settled

pytestmark = [pytest.mark.integration, pytest.mark.netns]

DENSE = {"levels": 1, "modules_per_level": 1}
ROUND_TIMEOUT = 12.0
"""The tiny run's round deadline (``helpers.network.tiny_network``'s)."""
INNER_SLACK = 8.0
"""Seconds allowed for a round's 8 inner steps and its checkpoint on this busy 2-core machine."""


def round_lines(net, name: str) -> list[str]:
    return [l for l in net.procs.log(name).splitlines() if "peer.node.trainer: round " in l]


def test_slow_link_nobody_waits_for_it(procs, tmp_path, bridge):
    data = prepare_dataset(tmp_path / "data", levels=1, modules=1)
    net = tiny_network(procs, tmp_path, data.dir, data.manifest_hash, bridge=bridge, inner_steps=8, lease_timeout=8.0,
                    lattice=DENSE)
    inj = FaultInjector(net, bridge)
    names = ["peer0", "peer1", "peer2"]
    try:
        net.start_coordinator()
        works = [net.start_peer_in(n, i + 1) for i, n in enumerate(names)]
        roots = [w / "checkpoints" for w in works]
        inj.when(lambda: settled(net, names), 120, "the network to form (3 rounds each, no fork left)")
        baseline = acknowledged_rounds(roots)
        slow_from = {n: len(round_lines(net, n)) for n in names}
        inj.throttle(3, "1mbit")
        durations = []
        for _ in range(10):  # time each of peer0's rounds while peer2 is slow
            start, before = time.monotonic(), rounds_done(net, "peer0")
            inj.when(lambda: rounds_done(net, "peer0") > before, ROUND_TIMEOUT + INNER_SLACK + 30,
                     "peer0 to finish a round while peer2 is slow")
            durations.append(time.monotonic() - start)
        inj.when(lambda: rounds_done(net, "peer2") > slow_from["peer2"], 60, "the slow peer to finish a round")
        inj.unthrottle(3)
        during = {n: round_lines(net, n)[slow_from[n]:] for n in names}
        with_slow = sum(bool(re.search(r"averaged by 3", l)) for l in during["peer0"])
        without_slow = sum(bool(re.search(r"averaged by [12]\b", l)) for l in during["peer0"])
        print(f"peer0 round durations while peer2 was at 1 Mbit/s: {[round(d, 1) for d in durations]}; "
              f"rounds with peer2: {with_slow}, without: {without_slow}")
        # every round peer0 finished while peer2 was slow ended (each wait above has a deadline) and averaged,
        # with peer2 or without it: none was abandoned for it
        assert with_slow + without_slow >= len(durations)
        after = {n: rounds_done(net, n) for n in names}
        # long enough after the link recovered for the loss check to have a trend to read (about 30 s)
        inj.when(lambda: all(rounds_done(net, n) >= after[n] + 20 for n in names), 120,
                 "20 rounds after the link recovered")
        report = finish_and_check(net, names, roots, min_round=baseline, min_pairs=6, others=("coordinator",))
        print(inj.timeline(), report)
    finally:
        net.close()
