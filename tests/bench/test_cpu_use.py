"""bench.cpu_use: the roles of a local network's processes, and the cores each used over a window."""

from __future__ import annotations

import os
import time

import pytest

from bench.cpu_use import ROLES, CpuWindow, role, summarize

VENV = "/work/.venv/bin"
PEER = [f"{VENV}/python", f"{VENV}/hivepath", "peer", "join", "--work-dir", "/tmp/w/peer0"]


@pytest.mark.parametrize("cmdline, parent, expected", [
    (PEER, [f"{VENV}/python", "-m", "bench.scale_calibrate"], "peer"),
    (PEER, PEER, "dht"),  # hivemind's DHT: a fork of the peer, with its command line
    ([f"{VENV}/../lib/python3.11/site-packages/hivemind/hivemind_cli/p2pd", "-listen=/unix/tmp/x"], PEER, "p2pd"),
    ([f"{VENV}/python", "-m", "peer.node.lifetime", "--watch", "42"], PEER, "watchdog"),
    ([f"{VENV}/python", f"{VENV}/hivepath", "coordinator", "serve", "--db", "state.db"], [], "coordinator"),
    ([f"{VENV}/python", "-m", "bench.scale_calibrate", "--quick"], ["bash"], "other"),
])
def test_each_process_of_a_local_network_gets_its_role(cmdline, parent, expected):
    assert role(cmdline, parent) == expected


def test_a_window_counts_what_each_process_used_in_it_and_what_ran_outside():
    before = {1: (100.0, "other", 5.0), 2: (101.0, "peer", 10.0), 3: (101.0, "dht", 2.0), 4: (102.0, "p2pd", 1.0),
              9: (103.0, "peer", 7.0)}
    after = {1: (100.0, "other", 5.5), 2: (101.0, "peer", 12.0), 3: (101.0, "dht", 2.5),
             4: (150.0, "p2pd", 0.5),  # pid 4 reused by a process started in the window: all its time counts
             5: (151.0, "p2pd", 1.0)}  # started in the window; pid 9 ended in it and counts nothing
    out = summarize(10.0, host_busy=8.0, before=before, after=after, cores=2)
    assert out["tree_cores"] == {"peer": 0.2, "dht": 0.05, "p2pd": 0.15, "other": 0.05}
    assert out["tree_processes"] == {"peer": 1, "dht": 1, "p2pd": 2, "other": 1}
    assert out["host_busy_cores"] == 0.8 and out["host_cores"] == 2
    assert out["outside_cores"] == pytest.approx(0.8 - 0.45)
    assert summarize(10.0, 1.0, before, after, 2)["outside_cores"] == 0.0  # never below zero (tick rounding)


def test_a_window_over_this_process_sees_its_cpu():
    window = CpuWindow(os.getpid())
    with pytest.raises(RuntimeError):
        window.stop()
    window.start()
    end = time.process_time() + 0.3
    while time.process_time() < end:  # 0.3 s of this process's CPU, however long the machine takes to give it
        pass
    out = window.stop()
    assert out["tree_cores"]["other"] > 0 and set(out["tree_cores"]) <= set(ROLES)
    assert 0 < out["host_busy_cores"] <= out["host_cores"] + 0.1
    assert out["outside_cores"] >= 0
