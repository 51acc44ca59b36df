"""Network namespaces of ``peer.localnet.netns``: each bridge's names carry its process's id, so two runs
of one benchmark (or a test that runs one beside it) never remove each other's namespaces, and a run
removes only what a run killed before its clean-up left behind."""

from __future__ import annotations

import subprocess
import sys

import pytest

from peer.localnet.netns import NetnsBridge, netns_available

PREFIX = "hpz"
"""A prefix no benchmark or other test uses."""

pytestmark = pytest.mark.skipif(bool(netns_available()), reason=netns_available() or "")


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _other_process_bridge() -> str:
    """Open a bridge of ``PREFIX`` in another process, left open while it sleeps; the code it runs."""
    return ("import sys, time\n"
            "from peer.localnet.netns import NetnsBridge\n"
            f"b = NetnsBridge(2, prefix={PREFIX!r}, subnet='10.76.1')\n"
            "b.open()\n"
            "print(' '.join([b.switch, *b.names]), flush=True)\n"
            "try:\n"
            "    sys.stdin.read()\n"
            "finally:\n"
            "    b.close()\n")


def test_a_bridge_leaves_another_live_process_s_namespaces_and_removes_a_dead_one_s():
    other = subprocess.Popen([sys.executable, "-c", _other_process_bridge()], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        theirs = set(other.stdout.readline().split())
        assert len(theirs) == 3 and theirs <= _namespaces()
        dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True).stdout.strip()
        leftover = f"{PREFIX}{dead}-p0"  # as a run killed before its clean-up leaves it
        subprocess.run(["ip", "netns", "add", leftover], check=True)
        with NetnsBridge(2, prefix=PREFIX, subnet="10.76.0") as ours:
            assert {ours.switch, *ours.names} <= _namespaces()
            assert not theirs & {ours.switch, *ours.names}
            assert theirs <= _namespaces(), "a bridge removed another live run's namespaces"
            assert leftover not in _namespaces(), "a dead run's namespace was left"
        assert not {ours.switch, *ours.names} & _namespaces()
        assert theirs <= _namespaces()
    finally:
        other.communicate("", timeout=60)
    assert not theirs & _namespaces()
