"""Fault suite: the disk fills up while a checkpoint is written.

A small tmpfs is mounted as the checkpoint directory and filled for real, so ``ENOSPC`` comes from
the kernel, in the middle of a safetensors write. Invariants: the partial snapshot is gone, ``LATEST``
still names the previous one, which loads bit-identically; the error is reported once per failed
save with the directory, the free space and the fix; training goes on; the next save after space is
freed works. Needs root (``mount``); skipped with the reason otherwise.
"""

from __future__ import annotations

import errno
import logging
import os
import subprocess
from pathlib import Path

import pytest
import torch

from helpers.solo import SoloAverager, one_path_dataset
from peer.node import CheckpointDir, CheckpointError

torch.set_num_threads(1)


@pytest.fixture
def small_disk(tmp_path):
    """A 256 KiB tmpfs mounted at ``tmp_path/disk`` (unmounted lazily at the end)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a tmpfs (the CI and these machines run tests as root)")
    mnt = tmp_path / "disk"
    mnt.mkdir()
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)], capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {out.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)])  # lazy: loaded tensors may still map its files


def fill(disk: Path, leave: int = 0) -> Path:
    """Write a filler file until the disk is full (or only about ``leave`` bytes remain)."""
    filler = disk / "filler"
    chunk = b"\xff" * 4096
    with open(filler, "wb", buffering=0) as f:  # unbuffered: no pending bytes to fail at close
        try:
            while not leave or _free(disk) > leave + len(chunk):
                f.write(chunk)
        except OSError as e:
            assert e.errno == errno.ENOSPC, e
    return filler


def _free(disk: Path) -> int:
    st = os.statvfs(disk)
    return st.f_bavail * st.f_frsize


def groups(seed: int, n: int = 2048) -> dict[str, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "modules/L0M0": {"w": torch.randn(n, generator=gen), "b": torch.randn(7, generator=gen).half()},
        "outer/L0M0": {"momentum.0": torch.randn(n, generator=gen)},
    }


def assert_loads_identically(ckpt: CheckpointDir, round_no: int, expected: dict) -> None:
    snap = ckpt.load_latest()
    assert snap is not None and snap.round_no == round_no
    assert snap.groups.keys() == expected.keys()
    for g, tensors in expected.items():
        for k, t in tensors.items():
            got = snap.groups[g][k]
            assert got.dtype == t.dtype and torch.equal(got, t), f"{g}/{k} differs"


def test_disk_full_keeps_the_previous_snapshot_and_the_next_save_works(small_disk):
    ckpt = CheckpointDir(small_disk / "checkpoints", keep=2)
    first = groups(1)
    ckpt.save(1, first, {"note": "first"})
    filler = fill(small_disk, leave=8 * 1024)  # room for a little, not for a 16 KiB snapshot

    with pytest.raises(CheckpointError) as info:
        ckpt.save(2, groups(2), {"note": "second"})
    err = info.value
    msg = str(err)
    assert err.errno == errno.ENOSPC
    assert "\n" not in msg and str(ckpt.root) in msg and "round-000002" in msg
    assert "No space left on device (ENOSPC" in msg and "free" in msg
    assert "the previous checkpoint round-000001 is kept" in msg
    assert "--keep-checkpoints (now 2)" in msg and "free space" in msg
    # nothing half-written is left behind, LATEST still names the previous snapshot
    assert sorted(p.name for p in ckpt.root.iterdir()) == ["LATEST", "round-000001"]
    assert (ckpt.root / "LATEST").read_text() == "round-000001"
    assert_loads_identically(ckpt, 1, first)

    # a same-round rewrite (a drain re-saves its last round) failing on the full disk keeps the old one
    with pytest.raises(CheckpointError):
        ckpt.save(1, groups(99), {"note": "rewrite"})
    assert_loads_identically(ckpt, 1, first)
    assert sorted(p.name for p in ckpt.root.iterdir()) == ["LATEST", "round-000001"]

    filler.unlink()  # the operator frees space: the next save works
    third = groups(3)
    ckpt.save(3, third, {"note": "third"})
    assert (ckpt.root / "LATEST").read_text() == "round-000003"
    assert_loads_identically(ckpt, 3, third)
    assert [p.name for p in ckpt.snapshots()] == ["round-000003", "round-000001"]


def test_completely_full_disk_fails_at_the_first_byte(small_disk):
    ckpt = CheckpointDir(small_disk / "archive", keep=3, keep_flag="--keep")
    first = groups(5, n=256)
    ckpt.save(4, first, {})
    fill(small_disk)
    with pytest.raises(CheckpointError) as info:
        ckpt.save(5, groups(6, n=256), {})
    assert info.value.errno == errno.ENOSPC and "--keep (now 3)" in str(info.value)
    assert not [p for p in ckpt.root.iterdir() if p.name.startswith(".")], "temporary files removed"
    assert_loads_identically(ckpt, 4, first)


# -- a peer's trainer on the full disk ----------------------------------------------------------


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return one_path_dataset(tmp_path_factory.mktemp("disk-full-data"))


def test_a_training_peer_reports_the_full_disk_and_keeps_training(small_disk, dataset, caplog):
    from models.presets import tiny_cpu
    from peer.node import PeerStatus
    from peer.node import PathTrainer

    cfg = tiny_cpu().replace(lattice={"levels": 1, "modules_per_level": 1, "d_model": 16, "seq_len": 16},
                             inner={"batch_size": 2, "warmup_steps": 1}, outer={"inner_steps": 2, "round_timeout": 5.0})
    status = PeerStatus()
    ckpt = CheckpointDir(small_disk / "checkpoints", keep=2)
    trainer = PathTrainer(cfg, (0,), dataset, torch.device("cpu"), SoloAverager(), ckpt, "solo", status)

    def until_round(n: int):
        return lambda: "done" if status.round_no >= n else None

    trainer.run(until_round(1), lambda report: None)
    assert (ckpt.root / "LATEST").read_text() == "round-000001" and status.checkpoint_error == ""
    good = ckpt.load_latest()

    filler = fill(small_disk)
    with caplog.at_level(logging.ERROR, logger="peer.node.trainer"):
        trainer.run(until_round(3), lambda report: None)  # two rounds, two failed checkpoints
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 2, "one error per failed save"
    assert all("No space left on device" in r.getMessage() and "round-000001 is kept" in r.getMessage()
               for r in errors)
    assert status.round_no == 3 and status.step >= 6, "training went on"
    assert "No space left" in status.checkpoint_error
    assert (ckpt.root / "LATEST").read_text() == "round-000001"
    kept = ckpt.load_latest()
    assert kept.round_no == 1 and all(torch.equal(kept.groups[g][k], good.groups[g][k])
                                      for g in good.groups for k in good.groups[g])

    filler.unlink()
    trainer.run(until_round(4), lambda report: None)
    assert (ckpt.root / "LATEST").read_text() == "round-000004" and status.checkpoint_error == ""
    assert ckpt.load_latest().meta["rounds"] == {m: 4 for m in trainer.module_ids}
