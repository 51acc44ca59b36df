"""The coordinator's dial-back (``coordinator/reachability.py``) on real sockets: an address that
accepts is reachable, a closed port or an unroutable one is not, loopback is dialled only for a join
that came from loopback, and a peer that announces nothing is not listening."""

from __future__ import annotations

import asyncio
import socket

import pytest

from coordinator.reachability import (
    NOT_LISTENING,
    REACHABLE,
    UNREACHABLE,
    Reachability,
    dial_back,
    observed_host,
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
