"""Volunteers behind a real NAT: peers in home namespaces, each behind a router of its own
that masquerades (iptables, the kernel's own NAT: the public side cannot dial them back).

Reachability at join: the coordinator dials each joining peer's announced addresses back: the public
peer is ``reachable`` at its address; a NATed one that joins while no reachable peer can relay for it
is ``unreachable``, seen from its router's address. Each peer says so in one line at start; the
coordinator's ``/status.json``, its status page and ``/metrics`` show it; a NATed peer's address is
never handed out as a bootstrap peer. A peer NATed in client mode announces nothing
(``not_listening``) and still measures its link to the coordinator.

Relays: NATed peers that join while a public peer is live are handed it as a relay, reserve a slot,
announce the circuit (``relayed``), and average with the public peer and with each other (the
modules held by NATed peers alone); once the network has formed, replicas are identical round after
round. Between private addresses each relayed connection carries at most 128 KiB before the relay
resets it (``peer.network.relays``); parts and join streams cut by a reset are sent again (what
``tests/peer/network/test_relayed_peers.py`` checks with modules larger than the limit; the tiny preset's fit
in one connection). Slow: a relay killed, and two peers behind the same NAT.
"""

from __future__ import annotations

import collections
import re
import subprocess
import sys

import pytest

from peer.localnet.checks import acknowledged_rounds, module_results, replica_check, stop_all
from chaos.scenario import CHAOS_PREFIX, CHAOS_SUBNET
from helpers.network import tiny_network
from chaos.scenario import prepare_dataset
from peer.localnet.checks import settled
from peer.localnet import wait_for
from helpers.procs import ROOT

pytestmark = pytest.mark.integration


@pytest.fixture
def nat_bridge():
    """Namespaces ``hpc<pid>-p0..3``: the coordinator in 0, a public peer in 1, and in 2 and 3 a router
    with a peer behind it (``hpc-h2``, ``hpc-h3``)."""
    from peer.localnet.netns import NetnsBridge, nat_available

    why = nat_available()
    if why:
        pytest.skip(f"network namespaces unavailable: {why}")
    with NetnsBridge(4, rate="100mbit", subnet=CHAOS_SUBNET, prefix=CHAOS_PREFIX, nat=[2, 3]) as b:
        yield b


def test_the_coordinator_finds_who_is_behind_nat_and_each_peer_says_so(procs, tmp_path, nat_bridge):
    data = prepare_dataset(tmp_path / "data")
    net = tiny_network(procs, tmp_path, data.dir, data.manifest_hash, bridge=nat_bridge, inner_steps=4)
    net.start_coordinator()
    # the NATed peer first: no reachable peer is there yet to relay for it
    net.start_peer_in("natted", 2)
    wait_for(lambda: (net.status() or {}).get("peers"), 120, "the NATed peer to join")
    net.start_peer_in("public", 1)
    net.start_peer_in("client", 3, "--client-mode")

    def rows() -> dict[str, dict]:
        return {p["peer_id"]: p for p in (net.status() or {}).get("peers", [])}

    wait_for(lambda: len(rows()) == 3, 120, "the NATed peers to join")
    public, natted, client = (re.search(r"DHT up: peer id (\w+)", net.procs.log(n)).group(1)
                              for n in ("public", "natted", "client"))
    by_id = rows()
    assert by_id[public]["reachability"] == "reachable"
    assert by_id[public]["reachable_addr"].startswith(f"/ip4/{nat_bridge.address(1)}/tcp/")
    assert by_id[natted]["reachability"] == "unreachable" and by_id[natted]["reachable_addr"] == ""
    assert by_id[natted]["observed_addr"] == nat_bridge.address(2)  # its router's address, not its own
    assert by_id[client]["reachability"] == "not_listening" and by_id[client]["observed_addr"] == nat_bridge.address(3)
    # every one measured its link to the coordinator (client mode and NATed included), through the NAT
    assert all(by_id[p]["upload_bps"] > 0 and by_id[p]["download_bps"] > 0 for p in (public, natted, client)), by_id

    # one line each, at start (logged just after the join the coordinator already counts: wait for it)
    said = re.compile(rf"INFO peer\.node\.startup: reachable at /ip4/{re.escape(nat_bridge.address(1))}/tcp/\d+")
    wait_for(lambda: said.search(net.procs.log("public")), 60, "the public peer's reachability line")
    line = next(l for l in net.procs.log("natted").splitlines() if "cannot be reached and no relay answers" in l)
    assert f"(its connections come from {nat_bridge.address(2)})" in line and "--announce-maddrs" in line
    wait_for(lambda: "client mode: other peers cannot dial this one" in net.procs.log("client"), 60,
             "the client-mode peer's reachability line")

    # the operator's views
    def fetch(path: str) -> str:
        url = f"http://{nat_bridge.address(0)}:{net.http_port}{path}"
        return subprocess.run(net._in(0, ["curl", "-sf", "-m", "5", url]), capture_output=True, text=True,
                              timeout=15).stdout

    metrics = fetch("/metrics")
    assert 'hivepath_coordinator_peers_reachability{reachability="unreachable"} 1.0' in metrics
    assert 'hivepath_coordinator_peers_reachability{reachability="reachable"} 1.0' in metrics
    assert 'hivepath_coordinator_peers_reachability{reachability="not_listening"} 1.0' in metrics
    assert "1 unreachable</b> (behind NAT or a firewall)" in fetch("/")

    # a newcomer is handed the public peer as a bootstrap, never the NATed one (asked from namespace 0)
    ask = ("from peer.coordinator_client import CoordinatorClient; "
           f"c = CoordinatorClient({net.address!r}, {net.token!r}, retry_timeout=5.0); "
           "print(' '.join(c.run_spec().initial_peers)); c.close()")
    spec = subprocess.run(net._in(0, [sys.executable, "-c", ask]), capture_output=True, text=True, timeout=60,
                          cwd=ROOT)
    assert spec.returncode == 0, spec.stderr[-2000:]
    handed = spec.stdout.split()
    assert any(public in a for a in handed) and not any(natted in a or client in a for a in handed), handed
    assert net.stop("client") == 0 and net.stop("natted") == 0 and net.stop("public") == 0


def _rows(net) -> dict[str, dict]:
    return {p["peer_id"]: p for p in (net.status() or {}).get("peers", [])}


@pytest.fixture
def nat_homes():
    """Namespaces ``hpc<pid>-p0..4``: the coordinator in 0, a public peer in 1, and in 2, 3 and 4 a router
    with a peer behind it."""
    from peer.localnet.netns import NetnsBridge, nat_available

    why = nat_available()
    if why:
        pytest.skip(f"network namespaces unavailable: {why}")
    with NetnsBridge(5, rate="100mbit", subnet=CHAOS_SUBNET, prefix=CHAOS_PREFIX, nat=[2, 3, 4]) as b:
        yield b


NATTED = ("nat2", "nat3", "nat4")


def test_natted_peers_average_through_a_relay_with_the_public_one_and_each_other(procs, tmp_path, nat_homes):
    """1 public + 3 NATed peers on the 2x2 lattice: the public peer takes the first path, the NATed ones
    the other three, so two level modules are held by NATed peers alone."""
    data = prepare_dataset(tmp_path / "data")
    net = tiny_network(procs, tmp_path, data.dir, data.manifest_hash, bridge=nat_homes, inner_steps=4)
    net.start_coordinator()
    works = {"public": net.start_peer_in("public", 1)}
    wait_for(lambda: (net.status() or {}).get("peers"), 120, "the public peer to join")
    works.update({name: net.start_peer_in(name, i) for i, name in enumerate(NATTED, start=2)})
    ids = wait_for(lambda: _ids(net, ["public", *NATTED]), 180, "the NATed peers to join and train")
    public = ids["public"]
    by_id = _rows(net)
    for name in NATTED:
        row = by_id[ids[name]]
        assert row["reachability"] == "relayed" and row["relay"] == public, row
        assert row["reachable_addr"].startswith(f"/ip4/{nat_homes.address(1)}/tcp/"), row
        assert f"behind NAT: relayed via {public}" in net.procs.log(name)

    # the work the coordinator gave: modules held by NATed peers alone, and modules shared with the public one
    held = {m["module_id"]: set(m["holders"]) for m in (net.status() or {}).get("modules", [])}
    natted_only = {m for m, h in held.items() if len(h) >= 2 and public not in h}
    assert len(natted_only) >= 2, f"modules held by NATed peers alone: {held}"
    roots = [works[n] / "checkpoints" for n in ("public", *NATTED)]
    # joiners fork from the first peers at start-up until the majority's state wins (chaos.scenario.settled):
    # replicas are compared from there on
    wait_for(lambda: settled(net, ["public", *NATTED]), 240, "the network to form (every peer in embed's group)")
    floor = acknowledged_rounds(roots)
    # NATed peers average the modules they alone hold with each other, through the relay
    grouped = {n: _grouped_modules(net.procs.log(n)) for n in NATTED}
    wait_for(lambda: all(sum(_grouped_modules(net.procs.log(n))[m] - grouped[n][m] for n in NATTED) >= 6
                         for m in natted_only), 240, f"rounds of {sorted(natted_only)} averaged by their NATed holders")
    wait_for(lambda: all(r >= floor.get(m, 0) + 3 for m, r in net.module_rounds().items()), 120,
             "3 more rounds of every module")
    # their tokens are counted by the coordinator
    assert all(_rows(net)[ids[n]]["tokens"] > 0 for n in NATTED), _rows(net)
    codes = stop_all(net, [*NATTED, "public"])
    assert all(c == 0 for c in codes.values()), codes
    # bit-identical replicas, among the NATed peers (through the relay) and with the public one
    check = replica_check(roots, min_round=floor)
    assert not check.mismatches and check.pairs >= 4, (check.pairs, check.mismatches[:5])


def _grouped_modules(log_text: str) -> collections.Counter:
    """Per module, the trainer's rounds in which it was averaged with another holder."""
    return collections.Counter(m for m, size in module_results(log_text) if size >= 2)


def _ids(net, names: list[str]) -> dict[str, str] | None:
    """Peer ids by name once every named peer prints progress and holds modules."""
    try:
        ids = {n: net.peer_id(n) for n in names}
    except AssertionError:
        return None
    held = {p for m in (net.status() or {}).get("modules", []) for p in m.get("holders", [])}
    return ids if set(ids.values()) <= held else None


@pytest.fixture
def two_relays():
    """Namespaces ``hpc<pid>-p0..4``: the coordinator in 0, public peers in 1 and 2, and in 3 and 4 a
    router with a peer behind it."""
    from peer.localnet.netns import NetnsBridge, nat_available

    why = nat_available()
    if why:
        pytest.skip(f"network namespaces unavailable: {why}")
    with NetnsBridge(5, rate="100mbit", subnet=CHAOS_SUBNET, prefix=CHAOS_PREFIX, nat=[3, 4]) as b:
        yield b


@pytest.mark.slow
def test_a_relay_killed_leaves_the_natted_peers_averaging_through_the_other(procs, tmp_path, two_relays):
    """Each NATed peer holds a slot on both public peers; ``kill -9`` of the relay the first one was
    found through leaves both NATed peers averaging, with each other and with the surviving public
    peer, through the other relay; replicas stay identical."""
    data = prepare_dataset(tmp_path / "data")
    net = tiny_network(procs, tmp_path, data.dir, data.manifest_hash, bridge=two_relays, inner_steps=4)
    net.start_coordinator()
    works = {"pubA": net.start_peer_in("pubA", 1), "pubB": net.start_peer_in("pubB", 2)}
    wait_for(lambda: len((net.status() or {}).get("peers", [])) == 2, 120, "the public peers to join")
    works.update(nat3=net.start_peer_in("nat3", 3), nat4=net.start_peer_in("nat4", 4))
    ids = wait_for(lambda: _ids(net, [*works]), 180, "every peer to join and train")
    for name in ("nat3", "nat4"):
        assert _rows(net)[ids[name]]["reachability"] == "relayed"
        line = next(l for l in net.procs.log(name).splitlines() if "reserving relay slots on" in l)
        assert ids["pubA"] in line and ids["pubB"] in line, line
    victim = next(n for n in ("pubA", "pubB") if ids[n] == _rows(net)[ids["nat3"]]["relay"])
    wait_for(lambda: min(net.module_rounds().values(), default=0) >= 3, 120, "3 rounds of every held module")
    net.procs.kill(victim)
    survivors = [n for n in works if n != victim]
    after = {n: len(_group_rounds(net.procs.log(n))) for n in ("nat3", "nat4")}
    wait_for(lambda: all(len(_group_rounds(net.procs.log(n))) >= after[n] + 4 for n in after), 240,
             "4 more rounds of the NATed peers averaged with another holder, after the kill")
    codes = stop_all(net, survivors)
    assert all(c == 0 for c in codes.values()), codes
    check = replica_check([works[n] / "checkpoints" for n in survivors])
    assert not check.mismatches and check.pairs >= 4, (check.pairs, check.mismatches[:5])


def _group_rounds(log_text: str) -> list[str]:
    """The trainer's round lines in which some module was averaged with another holder."""
    return [l for l in log_text.splitlines()
            if "peer.node.trainer: round " in l and re.search(r"averaged by [2-9]", l)]


@pytest.mark.slow
def test_two_peers_behind_the_same_nat_both_take_part(procs, tmp_path, nat_bridge):
    """Two peers in one home, behind one router (same outside address, different ports), and a public
    peer: the coordinator finds both behind NAT and relays both through the public peer; both train,
    average with the public peer and each other, their tokens are counted, and replicas stay identical."""
    data = prepare_dataset(tmp_path / "data")
    net = tiny_network(procs, tmp_path, data.dir, data.manifest_hash, bridge=nat_bridge, inner_steps=4)
    net.start_coordinator()
    works = {"public": net.start_peer_in("public", 1)}
    wait_for(lambda: (net.status() or {}).get("peers"), 120, "the public peer to join")
    works.update(homeA=net.start_peer_in("homeA", 2), homeB=net.start_peer_in("homeB", 2))
    names = [*works]
    ids = wait_for(lambda: _ids(net, names), 180, "both peers of the home to join and train")
    by_id = _rows(net)
    for name in ("homeA", "homeB"):
        row = by_id[ids[name]]
        assert row["reachability"] == "relayed" and row["relay"] == ids["public"], row
        assert row["observed_addr"] == nat_bridge.address(2), row  # one router's address for both
    roots = [works[n] / "checkpoints" for n in names]
    wait_for(lambda: settled(net, names), 240, "the network to form (every peer in embed's group)")
    floor = acknowledged_rounds(roots)
    held = {m["module_id"]: set(m["holders"]) for m in (net.status() or {}).get("modules", [])}
    shared = {m for m, h in held.items() if len(h) >= 2}
    grouped = {n: _grouped_modules(net.procs.log(n)) for n in ("homeA", "homeB")}
    # every module a home peer shares with another holder keeps averaging with it
    wait_for(lambda: all(_grouped_modules(net.procs.log(n))[m] >= grouped[n][m] + 3
                         for n in ("homeA", "homeB") for m in shared if ids[n] in held[m]), 240,
             "3 more rounds of every shared module of both home peers, averaged with another holder")
    assert all(_rows(net)[ids[n]]["tokens"] > 0 for n in ("homeA", "homeB"))
    codes = stop_all(net, ["homeA", "homeB", "public"])
    assert all(c == 0 for c in codes.values()), codes
    check = replica_check(roots, min_round=floor)
    assert not check.mismatches and check.pairs >= 3, (check.pairs, check.mismatches[:5])
