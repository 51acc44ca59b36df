"""Nothing left on disk, the parts without a network: a benchmark's work directory goes at
its end, by an error or a stop signal too, unless asked to stay (and then it says where), and no
benchmark makes one another way; the watchdog's removal of the unix sockets a stopped tree bound
removes only dead ones, with torch's shared-memory directory. The demo and a killed peer, end to
end: ``tests/peer/test_stopping.py``."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile

import psutil
import pytest

from bench.common import work_directory
from helpers.procs import ROOT
from peer.node.leftovers import SHM_DIR_PREFIX, bound_sockets, remove_dead_sockets


def test_a_work_directory_goes_at_the_end_and_on_a_stop(capsys):
    with work_directory("hp-test-") as work:
        (work / "logs").mkdir()
        (work / "logs" / "a.log").write_text("x")
    assert not work.exists()
    with pytest.raises(KeyboardInterrupt):  # what run_main makes of SIGTERM and SIGHUP
        with work_directory("hp-test-") as work:
            raise KeyboardInterrupt
    assert not work.exists()
    assert capsys.readouterr().err == ""


def test_a_work_directory_asked_for_stays_and_is_named(tmp_path, capsys):
    with work_directory("hp-test-", keep=True) as kept:
        pass
    try:
        assert kept.is_dir() and f"work directory kept at {kept}" in capsys.readouterr().err
    finally:
        kept.rmdir()
    with work_directory("hp-test-", given=tmp_path / "mine") as given:
        (given / "f").write_text("x")
    assert (tmp_path / "mine" / "f").exists() and f"kept at {tmp_path / 'mine'}" in capsys.readouterr().err


def test_no_benchmark_makes_a_temp_dir_another_way():
    makers = [p.name for p in (ROOT / "bench").rglob("*.py")
              if p.name != "common.py" and "mkdtemp(" in p.read_text(encoding="utf-8")]
    assert not makers, f"use bench.common.work_directory (removed at the end unless --keep): {makers}"


def _listener(path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.listen()
    return s


def test_only_dead_sockets_go_with_an_emptied_shm_directory(tmp_path):
    shm = tmp_path / f"{SHM_DIR_PREFIX}abc"
    shm.mkdir()
    live = _listener(tmp_path / "live.sock")
    dead = _listener(shm / "manager.sock")
    dead.close()  # closed without unlink: what a process killed by a signal leaves
    (tmp_path / "plain.sock").write_text("not a socket")
    try:
        removed = remove_dead_sockets([str(tmp_path / "live.sock"), str(shm / "manager.sock"),
                                       str(tmp_path / "plain.sock"), str(tmp_path / "gone.sock")])
        assert removed == [str(shm / "manager.sock"), str(shm)]
        assert (tmp_path / "live.sock").exists() and (tmp_path / "plain.sock").exists()
    finally:
        live.close()


def test_the_sockets_a_process_bound_in_the_temp_dir_are_seen(tmp_path):
    """A child binds a socket in the temp dir and one outside it (``/dev/shm``): the scan sees the first."""
    if not os.access("/dev/shm", os.W_OK):
        pytest.skip("no writable /dev/shm to bind a socket outside the temp dirs")
    outside = tempfile.mkdtemp(dir="/dev/shm")
    code = ("import socket, sys\n"
            "for path in sys.argv[1:]:\n"
            "    s = socket.socket(socket.AF_UNIX); s.bind(path); s.listen(); globals()[path] = s\n"
            "print('up', flush=True); sys.stdin.read()\n")
    inside = str(tmp_path / "x.sock")
    proc = subprocess.Popen([sys.executable, "-c", code, inside, os.path.join(outside, "y.sock")],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "up"
        assert bound_sockets([psutil.Process(proc.pid)]) == {inside}
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)
        shutil.rmtree(outside, ignore_errors=True)
