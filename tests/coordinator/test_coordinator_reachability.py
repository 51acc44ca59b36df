"""The coordinator's dial-back (``coordinator/reachability.py``) on real sockets: an address that
accepts is reachable, a closed port or an unroutable one is not, loopback is dialled only for a join
that came from loopback, a peer that announces nothing is not listening, and one that announces a
relay circuit is relayed when the relay answers. Unreachable joins are handed relays, spread by load."""

from __future__ import annotations

import asyncio
import socket

import pytest

from coordinator.reachability import (
    NOT_LISTENING,
    REACHABLE,
    RELAYED,
    UNREACHABLE,
    Reachability,
    dial_back,
    observed_host,
    relay_load,
    relay_of,
    tcp_target,
)


@pytest.fixture
def listening():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the socket is


@pytest.mark.parametrize("maddr, target", [
    ("/ip4/10.0.0.5/tcp/31337/p2p/QmX", ("10.0.0.5", 31337)),
    ("/ip6/::1/tcp/7/p2p/QmX", ("::1", 7)),
    ("/ip4/0.0.0.0/tcp/31337", None),
    ("/ip4/10.0.0.5/tcp/0", None),
    ("/ip4/10.0.0.5/udp/31337/quic", None),
    ("/dns4/example.org/tcp/31337", None),
    ("/ip4/10.0.0.5/tcp/31337/p2p/QmR/p2p-circuit/p2p/QmX", None),
    ("/ip4/300.1.1.1/tcp/1", None),
    ("garbage", None),
])
def test_only_ip_tcp_addresses_are_dialled(maddr, target):
    assert tcp_target(maddr) == target


def test_the_observed_host_is_read_from_grpc_peer_strings():
    assert observed_host("ipv4:10.78.0.3:51234") == "10.78.0.3"
    assert observed_host("ipv6:[fe80::1%eth0]:51234") == "fe80::1"
    assert observed_host("unix:/tmp/sock") == ""


def test_a_listening_address_is_reachable_and_named(listening):
    closed = _closed_port()
    maddrs = [f"/ip4/127.0.0.1/tcp/{closed}/p2p/QmX", f"/ip4/127.0.0.1/tcp/{listening}/p2p/QmX"]
    got = asyncio.run(dial_back(maddrs, observed="127.0.0.1"))
    assert got == Reachability(REACHABLE, maddrs[1], "127.0.0.1")


def test_a_closed_port_is_unreachable():
    got = asyncio.run(dial_back([f"/ip4/127.0.0.1/tcp/{_closed_port()}"], observed="127.0.0.1"))
    assert got.state == UNREACHABLE and got.addr == ""


def test_loopback_is_not_dialled_for_a_join_from_elsewhere(listening):
    got = asyncio.run(dial_back([f"/ip4/127.0.0.1/tcp/{listening}"], observed="10.78.0.3"))
    assert got == Reachability(UNREACHABLE, "", "10.78.0.3")


def test_announcing_nothing_is_not_listening():
    assert asyncio.run(dial_back([], observed="10.78.0.3")).state == NOT_LISTENING


@pytest.mark.parametrize("maddr, found", [
    ("/ip4/10.0.0.5/tcp/4001/p2p/QmR/p2p-circuit", ("/ip4/10.0.0.5/tcp/4001", "QmR")),
    ("/ip4/10.0.0.5/tcp/4001/p2p/QmR/p2p-circuit/p2p/QmX", ("/ip4/10.0.0.5/tcp/4001", "QmR")),
    ("/ip4/10.0.0.5/tcp/4001/p2p/QmR", None),
    ("/p2p-circuit", None),
    ("/p2p/QmR/p2p-circuit", None),
])
def test_a_circuit_names_its_relay(maddr, found):
    assert relay_of(maddr) == found


def test_a_circuit_through_a_listening_relay_is_relayed(listening):
    circuit = f"/ip4/127.0.0.1/tcp/{listening}/p2p/QmRelay/p2p-circuit/p2p/QmX"
    got = asyncio.run(dial_back([f"/ip4/127.0.0.1/tcp/{_closed_port()}/p2p/QmX", circuit], observed="127.0.0.1"))
    assert got == Reachability(RELAYED, circuit, "127.0.0.1")


def test_a_circuit_through_a_dead_relay_is_unreachable():
    circuit = f"/ip4/127.0.0.1/tcp/{_closed_port()}/p2p/QmRelay/p2p-circuit"
    assert asyncio.run(dial_back([circuit], observed="127.0.0.1")).state == UNREACHABLE


def test_relay_load_counts_relayed_peers_per_relay():
    addrs = ["/ip4/10.0.0.5/tcp/1/p2p/QmA/p2p-circuit", "/ip4/10.0.0.5/tcp/1/p2p/QmA/p2p-circuit",
             "/ip4/10.0.0.6/tcp/1/p2p/QmB/p2p-circuit", "/ip4/10.0.0.7/tcp/1", ""]
    assert relay_load(addrs) == {"QmA": 2, "QmB": 1}


def test_an_unreachable_join_is_handed_the_least_loaded_reachable_peers_as_relays():
    from coordinator.core import Coordinator
    from coordinator.records import Capabilities
    from coordinator.settings import CoordinatorSettings
    from coordinator.store import MemoryStore
    from models.presets import tiny_cpu

    coord = Coordinator(tiny_cpu().replace(data={"manifest_hash": "ab" * 8}),
                        CoordinatorSettings(min_move_interval=0.0), MemoryStore(), clock=lambda: 1e6)

    def join(i: int, reach: Reachability):
        caps = Capabilities("cpu", 8 << 30, 1000.0, 0.0, 0.0, (f"/ip4/10.0.0.{i}/tcp/4000",))
        return coord.join(f"12D3KooWpeer{i:08d}", f"k{i}".encode(), caps, reachability=reach)

    for i in (1, 2, 3):  # three reachable peers
        assert join(i, Reachability(REACHABLE, f"/ip4/10.0.0.{i}/tcp/4000")).relays == []
    relay_of_ = {}
    for i in (4, 5, 6):  # NATed peers join: each handed two relays, never one already carrying more
        relays = join(i, Reachability(UNREACHABLE, "", "192.0.2.1")).relays
        assert len(relays) == 2 and all(r.startswith("/ip4/10.0.0.") and "/p2p/12D3KooWpeer" in r for r in relays)
        relay_of_[i] = relays[0]
        join(i, Reachability(RELAYED, f"{relays[0]}/p2p-circuit", "192.0.2.1"))
    assert len(set(relay_of_.values())) == 3, relay_of_  # spread over the three reachable peers
    # a relayed peer is never handed out as a bootstrap peer or a relay
    later = join(7, Reachability(UNREACHABLE, "", "192.0.2.1"))
    assert not any("10.0.0.4" in a or "10.0.0.5" in a or "10.0.0.6" in a for a in later.initial_peers + later.relays)
