"""Reachability at join behind a real NAT (issue 17, part 1): a coordinator and a public peer on the
bridge, and a peer in a home namespace behind a router that masquerades (iptables, the kernel's own
NAT: the public side cannot dial it back).

The coordinator dials each joining peer's announced addresses back: the public peer is ``reachable``
at its address, the NATed one ``unreachable``, seen from its router's address. Each peer says so in
one line at start; the coordinator's ``/status.json``, its status page and ``/metrics`` show it; the
NATed peer's address is never handed out as a bootstrap peer. A third peer, NATed in client mode,
announces nothing (``not_listening``), and still measures its link to the coordinator.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from chaos.nsnet import CHAOS_PREFIX, CHAOS_SUBNET, NsNetwork
from chaos.scenario import prepare_dataset
from helpers import wait_for
from helpers.procs import ROOT

pytestmark = pytest.mark.integration


@pytest.fixture
def nat_bridge():
    """Namespaces ``hpc-p0..3``: the coordinator in 0, a public peer in 1, and in 2 and 3 a router
    with a peer behind it (``hpc-h2``, ``hpc-h3``)."""
    from bench.netns import NetnsBridge, netns_available

    why = netns_available()
    if why:
        pytest.skip(f"network namespaces unavailable: {why}")
    with NetnsBridge(4, rate="100mbit", subnet=CHAOS_SUBNET, prefix=CHAOS_PREFIX, nat=[2, 3]) as b:
        yield b


def test_the_coordinator_finds_who_is_behind_nat_and_each_peer_says_so(procs, tmp_path, nat_bridge):
    data = prepare_dataset(tmp_path / "data")
    net = NsNetwork(procs, tmp_path, data.dir, data.manifest_hash, nat_bridge, inner_steps=4)
    net.start_coordinator()
    net.start_peer_in("public", 1)
    wait_for(lambda: (net.status() or {}).get("peers"), 120, "the public peer to join")
    net.start_peer_in("natted", 2)
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

    # one line each, at start
    assert re.search(rf"reachable at /ip4/{re.escape(nat_bridge.address(1))}/tcp/\d+", net.procs.log("public"))
    line = next(l for l in net.procs.log("natted").splitlines() if "cannot be reached" in l)
    assert f"(its connections come from {nat_bridge.address(2)})" in line and "--announce-maddrs" in line
    assert "client mode: other peers cannot dial this one" in net.procs.log("client")

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
