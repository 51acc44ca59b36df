"""A DHT that cannot start says why in one line: a TMPDIR too long for the unix socket torch's
shared-memory manager binds in it (hivemind shares tensors between its processes through that
manager) names the length and the fix, from a real start in a process of its own."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile

import pytest

from helpers.procs import ROOT
from peer.network.dht import SOCKET_PATH_MAX, shm_manager_failure

START = """
from peer.network.dht import DHTOptions, DHTStartError, start_dht
try:
    start_dht(DHTOptions(host_maddrs=["/ip4/127.0.0.1/tcp/0"]))
except DHTStartError as e:
    print(e)
"""


def test_a_too_long_tmpdir_stops_the_dht_start_naming_the_fix(tmp_path):
    long_dir = tmp_path / ("x" * max(1, SOCKET_PATH_MAX - len(str(tmp_path))))
    long_dir.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "HIVEMIND_MEMORY_SHARING_STRATEGY"}  # hivemind's default
    out = subprocess.run([sys.executable, "-c", START], cwd=ROOT, env={**env, "TMPDIR": str(long_dir)},
                         capture_output=True, text=True, timeout=120)
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1, (out.stdout, out.stderr[-2000:])
    assert lines[0].startswith(f"cannot start the DHT: TMPDIR {long_dir} is too long") and "TMPDIR=/tmp" in lines[0]


def test_a_short_tmpdir_names_the_managers_own_error(monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", "/tmp")
    message = shm_manager_failure("torch_shm_manager at \"x\": Permission denied\nframe #0: ...")
    assert message == ("cannot start the DHT: torch's shared-memory manager failed (torch_shm_manager at \"x\": "
                       "Permission denied); check that TMPDIR /tmp is a writable directory")


def test_initial_peers_that_never_answer_are_tried_again_then_named(caplog, monkeypatch):
    """A daemon that reached none of the initial peers starts again (a peer restarting, a NAT mapping
    not up yet), and after the last attempt the error names the peers and the fix. Each failed DHT
    process exits on its own rather than being killed: one killed between reporting its failure and
    releasing the lock hivemind's futures share across our forked processes leaves it held, and every
    DHT started later from this process then hangs before it can report that it is ready."""
    from hivemind.dht import DHT
    from hivemind.utils.mpfuture import MPFuture

    from peer.network.dht import BOOTSTRAP_ATTEMPTS, DHTOptions, DHTStartError, start_dht

    started, killed = [], []
    run = DHT.run_in_background
    monkeypatch.setattr(DHT, "run_in_background", lambda self, *a, **k: (started.append(self), run(self, *a, **k))[1])
    monkeypatch.setattr(DHT, "kill", lambda self: killed.append(self.pid))
    dead = "/ip4/127.0.0.1/tcp/9/p2p/QmXpfUhCkgDJYUCJSfuqj1TMJF8CsjLLbCCtiQTZAmMfLs"  # discard: nothing listens
    with caplog.at_level(logging.WARNING, logger="peer.network.dht"):
        with pytest.raises(DHTStartError, match="initial peers: /ip4/127.0.0.1/tcp/9/.*check that they are live"):
            start_dht(DHTOptions(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=[dead]))
    retries = [r for r in caplog.records if "reached none of the initial peers" in r.getMessage()]
    assert len(retries) == BOOTSTRAP_ATTEMPTS - 1
    assert len(started) == BOOTSTRAP_ATTEMPTS and killed == []
    assert [d.exitcode for d in started] == [0] * BOOTSTRAP_ATTEMPTS, "each exited on its own, cleanly"
    assert MPFuture._update_lock.acquire(timeout=10), "the futures' shared lock is free"
    MPFuture._update_lock.release()
