"""Bootstrap from anything: a stock hivemind DHT node (``hivemind-dht``, hivemind's
own command, none of our code) is the only initial peer, and two real peers find each other through
it and average together. The coordinator hands out no initial peers here (``initial_peers = 0``), so
the stock node is the only way they can meet.
"""

from __future__ import annotations

import re
import shutil
import socket
import sys
from pathlib import Path

import pytest

from peer.localnet import hivepath_cmd, wait_for
from helpers.network import tiny_network

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    from chaos.scenario import prepare_dataset

    return prepare_dataset(tmp_path_factory.mktemp("data") / "ds")


def test_two_peers_meet_through_a_stock_hivemind_dht_node(procs, tmp_path, dataset):
    stock = shutil.which("hivemind-dht", path=str(Path(sys.executable).parent)) or "hivemind-dht"
    procs.start("stock", [stock, "--host_maddrs", "/ip4/127.0.0.1/tcp/0", "--identity_path", str(tmp_path / "stock.key")])
    maddr = wait_for(lambda: re.search(r"/ip4/127\.0\.0\.1/tcp/\d+/p2p/\w+", procs.log("stock")), 60,
                     "the stock DHT node's address").group(0)
    net = tiny_network(procs, tmp_path, dataset.dir, dataset.manifest_hash, inner_steps=4, coordinator={"initial_peers": 0})
    try:
        net.start_coordinator()
        for name in ("peer0", "peer1"):
            net.start_peer(name, "--initial-peers", maddr)
        # a module both hold (embed, head) is averaged by the two of them: they met through the stock node
        wait_for(lambda: all("averaged by 2" in net.procs.log(n) for n in ("peer0", "peer1")), 180,
                 "both peers to average a round together")
        assert procs.procs["stock"].poll() is None
        assert net.stop("peer0") == 0 and net.stop("peer1") == 0
    finally:
        net.close()


def test_a_listen_port_in_use_is_one_line_naming_it(procs, tmp_path, dataset):
    """Several peers on one machine: a second peer given a daemon port that another
    process holds exits 2 with one line naming the port and the fix, before it trains."""
    net = tiny_network(procs, tmp_path, dataset.dir, dataset.manifest_hash)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        try:
            net.start_coordinator()
            work = tmp_path / "peer0"
            procs.start("peer0", hivepath_cmd("peer", "join", "--work-dir", str(work), *net.common()[:-4],
                                              "--host-maddrs", f"/ip4/127.0.0.1/tcp/{port}", "--status-port", "0"),
                        env=net.env)
            assert procs.procs["peer0"].wait(timeout=120) == 2
            last = procs.log("peer0").strip().splitlines()[-1]
            assert last.startswith("hivepath: error: ") and f"port {port}: the port is in use" in last, last
            assert "--host-maddrs" in last and "Traceback" not in procs.log("peer0")
            assert not (work / "checkpoints").exists() or not any((work / "checkpoints").iterdir())
        finally:
            net.close()
