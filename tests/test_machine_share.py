"""Peers on one machine divide its cores (issue 17, "several peers on one machine"): each registers in
a shared directory under a lock the kernel drops when it dies, and uses ``cores // peers`` threads.

Real processes: each member below is a fresh interpreter holding a :class:`MachineShare`; it recounts
when told to on stdin and prints its thread count. A member killed with SIGKILL (no clean-up runs)
stops counting at the next recount and its file is removed.
"""

from __future__ import annotations

import signal
import subprocess
import sys

from helpers.procs import ROOT
from peer.node.machine_share import MachineShare

MEMBER = r"""
import sys
from pathlib import Path
from peer.node.machine_share import MachineShare
share = MachineShare(lambda n: None, directory=Path(sys.argv[1]), cores=12)
with share:
    print(share.threads, flush=True)
    for line in sys.stdin:
        print(share.update(), flush=True)
"""


class Member:
    def __init__(self, directory):
        self.proc = subprocess.Popen([sys.executable, "-c", MEMBER, str(directory)], cwd=ROOT, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.first = int(self.proc.stdout.readline())

    def recount(self) -> int:
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        return int(self.proc.stdout.readline())

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
        self.proc.wait(timeout=30)


def test_peers_divide_the_cores_and_a_killed_one_stops_counting(tmp_path):
    members = []
    try:
        for _ in range(3):
            members.append(Member(tmp_path))
        assert [m.first for m in members] == [12, 6, 4]  # each saw the ones before it
        assert [m.recount() for m in members] == [4, 4, 4]
        victim = members.pop(1)
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait(timeout=10)
        assert (tmp_path / str(victim.proc.pid)).exists()  # nothing cleaned up after SIGKILL...
        assert [m.recount() for m in members] == [6, 6]
        assert not (tmp_path / str(victim.proc.pid)).exists()  # ...until a live peer recounted
        members.pop().close()  # a clean exit removes its own file
        assert members[0].recount() == 12
        assert sorted(p.name for p in tmp_path.iterdir()) == [str(members[0].proc.pid)]
    finally:
        for m in members:
            m.close()


def test_an_unusable_directory_leaves_the_threads_to_torch(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    applied = []
    with MachineShare(applied.append, directory=blocker / "peers", cores=8) as share:
        assert share.update() == 0 and applied == []
    assert "cannot register" in caplog.text and "--threads" in caplog.text


def test_never_fewer_than_one_thread(tmp_path):
    applied = []
    for i in range(3):
        (tmp_path / str(10**7 + i)).touch()  # files of dead peers (no lock held): removed, not counted
    with MachineShare(applied.append, directory=tmp_path, cores=1) as share:
        assert share.threads == 1 and applied == [1]
    assert list(tmp_path.iterdir()) == []
