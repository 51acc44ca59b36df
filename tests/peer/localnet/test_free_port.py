"""The tests' port picker (``peer.localnet.free_port``): a port it hands out is free, below the kernel's
ephemeral range where it can be, never handed out twice by one process, and each pytest-xdist worker
draws from its own slice."""

from __future__ import annotations

import socket

import pytest

from peer.localnet import procs
from peer.localnet import free_port


def test_no_port_is_handed_out_twice_and_each_one_is_free():
    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
    for port in ports[:20]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free when handed out, and nobody took it since


def test_each_xdist_worker_draws_from_its_own_slice(monkeypatch):
    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    width = (low - 10000) // 4
    if width <= 1000:
        pytest.skip(f"the ephemeral range starts at {low}: no room below it to slice")
    monkeypatch.setattr(procs, "_HANDED", set())
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "4")
    for worker in range(4):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", f"gw{worker}")
        drawn = [free_port() for _ in range(30)]
        assert all(10000 + worker * width <= p < 10000 + (worker + 1) * width for p in drawn), (worker, drawn)
