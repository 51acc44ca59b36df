"""The watchdog (``python -m peer.node.lifetime --watch PID``) sweeps the sessions of the children it saw
once their parent dies, but never a later session that was handed the same id.

A session id is its leader's pid. Once every process of a session has exited, the kernel may give
that pid to a new process, which may lead a session of its own: a stranger (on a busy machine,
another test's peer or demo). Before, the watchdog kept every session id it had ever seen and, when
its parent died, terminated whatever ran in those sessions then.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil
import pytest

from peer.node.lifetime import _leader_start, _same_session

NS_LAST_PID = "/proc/sys/kernel/ns_last_pid"


def _leader() -> subprocess.Popen:
    """A process that leads a session of its own (as ChildProcesses starts every child)."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)


def _end(p: subprocess.Popen) -> None:
    p.kill()
    p.wait()


def test_a_live_leader_is_the_session_seen_only_if_it_started_when_seen():
    p = _leader()
    try:
        started = _leader_start(p.pid)
        assert started is not None and os.getsid(p.pid) == p.pid
        assert _same_session(p.pid, started)
        assert not _same_session(p.pid, started - 1.0), "a leader that started at another time leads another session"
        assert not _same_session(p.pid, None), "the leader was gone when first seen: a live one now is new"
    finally:
        _end(p)
    assert _leader_start(p.pid) is None
    assert _same_session(p.pid, started), "no leader any more: what is left of the session is the one seen"


def _leader_with_pid(pid: int) -> subprocess.Popen:
    """A new session leader handed ``pid`` (free again): the kernel's next pid is set through
    ``ns_last_pid``; retried while other processes take it first."""
    for _ in range(50):
        with open(NS_LAST_PID, "w") as f:
            f.write(str(pid - 1))
        p = _leader()
        if p.pid == pid:
            return p
        _end(p)
    pytest.fail(f"could not start a process with pid {pid} in 50 tries (a busy machine takes it first)")


@pytest.mark.skipif(not os.access(NS_LAST_PID, os.W_OK) or os.geteuid() != 0,
                    reason="setting the next pid needs root (/proc/sys/kernel/ns_last_pid)")
def test_a_session_id_handed_to_a_new_leader_is_not_the_session_seen():
    first = _leader()
    seen_at = _leader_start(first.pid)
    # the scenario: a session that lived a while. /proc gives start times in 10 ms ticks, so the new
    # leader must start in a later tick than the first (a pid comes round again after 32768 others,
    # never within one tick, outside a test that hands it out on purpose)
    while psutil.boot_time() + time.clock_gettime(time.CLOCK_BOOTTIME) < seen_at + 0.05:  # /proc's clock
        time.sleep(0.005)
    _end(first)  # the whole session is gone: its id may be handed out again
    stranger = _leader_with_pid(first.pid)
    try:
        assert os.getsid(stranger.pid) == first.pid  # the same session id, a different session
        assert not _same_session(first.pid, seen_at)
    finally:
        _end(stranger)


@pytest.mark.skipif(not os.access(NS_LAST_PID, os.W_OK) or os.geteuid() != 0,
                    reason="setting the next pid needs root (/proc/sys/kernel/ns_last_pid)")
def test_stopping_children_spares_a_stranger_handed_the_pid_of_one_that_exited(tmp_path):
    """ChildProcesses.stop ends with SIGKILL to each child's session (it reaps p2p daemons left there);
    a child that exited and was reaped long before may have had its pid handed to a new session leader,
    which must live on."""
    from peer.node.lifetime import ChildProcesses

    children = ChildProcesses(tmp_path, watchdog=False)
    gone = children.start("gone", [sys.executable, "-c", "pass"])
    assert children.wait(["gone"], 60.0) == {"gone": 0}
    stranger = _leader_with_pid(gone.pid)
    try:
        assert children.stop() == {"gone": 0}
        with pytest.raises(subprocess.TimeoutExpired):  # a SIGKILL sent to it would end it well within this
            stranger.wait(timeout=2.0)
    finally:
        _end(stranger)
