"""Peers on one machine divide its cores: each registers in
a shared directory under a lock the kernel drops when it dies, and uses ``cores // peers`` threads.

Real processes: each member below is a fresh interpreter holding a :class:`MachineShare`; it recounts
when told to on stdin and prints its thread count. A member killed with SIGKILL (no clean-up runs)
stops counting at the next recount and its file is removed.
"""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from helpers.procs import ROOT
from peer.node.machine_share import MachineShare, registration

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
        assert (tmp_path / registration(victim.proc.pid)).exists()  # nothing cleaned up after SIGKILL...
        assert [m.recount() for m in members] == [6, 6]
        assert not (tmp_path / registration(victim.proc.pid)).exists()  # ...until a live peer recounted
        members.pop().close()  # a clean exit removes its own file
        assert members[0].recount() == 12
        assert sorted(p.name for p in tmp_path.iterdir()) == [registration(members[0].proc.pid)]
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
        (tmp_path / registration(10**7 + i)).touch()  # files of dead peers (no lock held): removed, not counted
    with MachineShare(applied.append, directory=tmp_path, cores=1) as share:
        assert share.threads == 1 and applied == [1]
    assert list(tmp_path.iterdir()) == []


# -- devices and memory ------------------------------------------------------------------------------

CLAIMER = r"""
import sys
from pathlib import Path
from models.errors import HivepathError
from peer.node.machine_share import MachineShare
from peer.node.machine_share import choose_device
share = MachineShare(None, directory=Path(sys.argv[1]), cores=12)
with share:
    try:
        print(share.claim_device(lambda others: choose_device(sys.argv[2], others, int(sys.argv[3]))), flush=True)
    except HivepathError as e:
        print(f"error: {e}", flush=True)
    for line in sys.stdin:
        print(share.peers_on(share.device), flush=True)
"""


class Claimer(Member):
    def __init__(self, directory, choice: str, gpus: int):
        self.proc = subprocess.Popen([sys.executable, "-c", CLAIMER, str(directory), choice, str(gpus)], cwd=ROOT,
                                     text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.claimed = self.proc.stdout.readline().strip()


def test_auto_takes_a_gpu_no_other_peer_uses_and_fails_naming_them(tmp_path):
    peers = []
    try:
        peers += [Claimer(tmp_path, "auto", gpus=2), Claimer(tmp_path, "auto", gpus=2)]
        assert sorted(p.claimed for p in peers) == ["cuda:0", "cuda:1"]
        third = Claimer(tmp_path, "auto", gpus=2)
        peers.append(third)
        names = {p.claimed: registration(p.proc.pid) for p in peers[:2]}
        assert third.claimed == (f"error: --device auto: every GPU of this machine has a peer already (cuda:0 by peer "
                                 f"{names['cuda:0']}; cuda:1 by peer {names['cuda:1']}); pass --device cuda:N to "
                                 "share one of them, or --device cpu")
        shared = Claimer(tmp_path, "cuda:1", gpus=2)  # asked for by name: shared, and its memory with it
        peers.append(shared)
        assert shared.claimed == "cuda:1" and shared.recount() == 2
        gone = peers.pop(0)
        gone.proc.send_signal(signal.SIGKILL)  # its GPU is free again for the next auto
        gone.proc.wait(timeout=10)
        late = Claimer(tmp_path, "auto", gpus=2)
        peers.append(late)
        assert late.claimed == gone.claimed
    finally:
        for p in peers:
            p.close()


def test_cpu_peers_count_each_other_for_memory(tmp_path):
    peers = []
    try:
        peers += [Claimer(tmp_path, "auto", gpus=0) for _ in range(3)]
        assert [p.claimed for p in peers] == ["cpu"] * 3
        assert [p.recount() for p in peers] == [3, 3, 3]
    finally:
        for p in peers:
            p.close()


def test_choose_device_alone_and_by_name():
    from models.errors import HivepathError
    from peer.node.machine_share import choose_device

    assert choose_device("auto", {}, gpus=0) == "cpu"
    assert choose_device("auto", {"7@h": "cuda:0"}, gpus=1) == "cuda:0", "one GPU: shared, not refused"
    assert choose_device("auto", {"7@h": "cuda:0", "8@h": "cpu"}, gpus=3) == "cuda:1"
    assert choose_device("CUDA", {}, gpus=2) == "cuda:0" and choose_device("cuda:1", {"7@h": "cuda:1"}, gpus=2) == "cuda:1"
    with pytest.raises(HivepathError) as refused:  # every GPU taken: each named with the peers on it
        choose_device("auto", {"9@h": "cuda:1", "7@h": "cuda:0", "10@h": "cpu", "8@g": "cuda:1"}, gpus=2)
    assert str(refused.value) == ("--device auto: every GPU of this machine has a peer already (cuda:0 by peer 7@h; "
                                  "cuda:1 by peer 8@g, 9@h); pass --device cuda:N to share one of them, or --device cpu")
    for choice, gpus, problem in (("cuda", 0, "no usable CUDA GPU"), ("cuda:2", 2, "cuda:0 to cuda:1"),
                                  ("tpu", 1, "not one of auto, cpu, cuda, cuda:N")):
        with pytest.raises(HivepathError, match=problem):
            choose_device(choice, {}, gpus=gpus)


def test_memory_is_the_free_memory_divided_unless_max_memory_says(monkeypatch):
    import collections

    import torch

    from peer.node import resources

    memory = collections.namedtuple("memory", "available")
    monkeypatch.setattr(resources.psutil, "virtual_memory", lambda: memory(24 * 2**30))
    cpu = torch.device("cpu")
    assert resources.usable_memory_bytes(cpu) == 24 * 2**30
    assert resources.usable_memory_bytes(cpu, sharing=4) == 6 * 2**30
    assert resources.usable_memory_bytes(cpu, max_memory_gb=10, sharing=4) == 10 * 2**30
    assert resources.usable_memory_bytes(cpu, max_memory_gb=100, sharing=4) == 24 * 2**30
