"""One live process per work dir: a second ``peer join`` or ``archive`` on the same
directory stops at start-up with one line naming the holder's pid (exit 6), whatever ``--identity`` it
is given; the lock goes with the holder."""

from __future__ import annotations

import os
import subprocess

import pytest

from peer.localnet import wait_for
from peer.localnet import free_port, hivepath_cmd
from peer.node.workdir import LOCK_FILE, WorkDirInUseError, lock_work_dir


def test_a_held_work_dir_is_refused_with_the_holders_pid(tmp_path):
    with lock_work_dir(tmp_path):
        with pytest.raises(WorkDirInUseError) as e:
            lock_work_dir(tmp_path, "--dir")
    message = str(e.value)
    assert e.value.exit_code == 6 and "\n" not in message
    assert f"(pid {os.getpid()})" in message and "--dir" in message and str(tmp_path.resolve()) in message
    lock_work_dir(tmp_path).release()  # free again once released


def _holder_pid(work):
    text = (work / LOCK_FILE).read_text().strip() if (work / LOCK_FILE).exists() else ""
    return int(text) if text else None


@pytest.mark.integration
@pytest.mark.parametrize("command", ["peer", "archive"])
def test_second_process_on_one_work_dir_exits_6_naming_the_first(procs, tmp_path, command):
    """The first process waits on a coordinator that never answers (it holds the directory meanwhile);
    the second, even with an identity file of its own, is refused at once: the directory is what is held."""
    work = tmp_path / "work"
    token = tmp_path / "token"
    token.write_text("test-token-0123456789")
    common = ["--coordinator", f"127.0.0.1:{free_port()}", "--token-file", str(token), "--status-port", "0",
              "--coordinator-timeout", "600"]  # asked to wait: nothing answering is not given up after 10 s
    where = ["peer", "join", "--work-dir", str(work)] if command == "peer" else ["archive", "--dir", str(work)]
    first = procs.start("first", hivepath_cmd(*where, *common))
    wait_for(lambda: _holder_pid(work) == first.pid, 60, "the first process to lock the work dir")
    second = subprocess.run(hivepath_cmd(*where, *common, "--identity", str(tmp_path / "other.key")),
                            capture_output=True, text=True, timeout=120)
    assert second.returncode == 6, second.stderr
    err = second.stderr.strip()
    assert f"(pid {first.pid})" in err and "in use" in err and "Traceback" not in second.stderr
    assert (work / "checkpoints").exists() is False and not (tmp_path / "other.key").exists()
    procs.kill("first")  # the kernel drops the lock with the process
    with lock_work_dir(work):
        pass
