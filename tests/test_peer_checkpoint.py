"""Peer checkpoints: atomic snapshots, pruning, fallback past a corrupt one, disk errors reported."""

from __future__ import annotations

import os

import pytest
import torch

from peer.checkpoint import CheckpointDir, CheckpointError


def _groups(value: float):
    return {"L0M0": {"w": torch.full((3, 4), value)}, "outer": {"momentum": torch.arange(5.0) * value}}


def test_save_and_load_latest(tmp_path):
    ckpt = CheckpointDir(tmp_path, keep=2)
    assert ckpt.load_latest() is None
    ckpt.save(1, _groups(1.0), {"path": "0,1"})
    ckpt.save(2, _groups(2.0), {"path": "0,1"})
    snap = ckpt.load_latest()
    assert snap.round_no == 2 and snap.meta["path"] == "0,1"
    assert torch.equal(snap.groups["L0M0"]["w"], torch.full((3, 4), 2.0))
    assert torch.equal(snap.groups["outer"]["momentum"], torch.arange(5.0) * 2)


def test_prunes_beyond_keep(tmp_path):
    ckpt = CheckpointDir(tmp_path, keep=2)
    for r in range(5):
        ckpt.save(r, _groups(float(r)), {})
    assert [p.name for p in ckpt.snapshots()] == ["round-000004", "round-000003"]


def test_corrupt_latest_falls_back_to_previous(tmp_path, caplog):
    ckpt = CheckpointDir(tmp_path, keep=3)
    ckpt.save(1, _groups(1.0), {})
    newest = ckpt.save(2, _groups(2.0), {})
    (newest / "L0M0.safetensors").write_bytes(b"\x00garbage")
    snap = ckpt.load_latest()
    assert snap.round_no == 1
    assert "corrupt" in caplog.text


def test_failed_write_keeps_previous(tmp_path):
    ckpt = CheckpointDir(tmp_path, keep=2)
    ckpt.save(1, _groups(1.0), {})
    bad = {"modules/L0M0": {"w": torch.ones(2)}, "../escape": {"w": torch.ones(1)}}
    with pytest.raises(ValueError):
        ckpt.save(2, bad, {})
    assert [p.name for p in ckpt.snapshots()] == ["round-000001"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".round")]


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/dev/shm"), reason="needs root to mount a tiny tmpfs")
def test_disk_full_reports_and_keeps_previous(tmp_path):
    import subprocess

    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)]).returncode != 0:
        pytest.skip("cannot mount tmpfs here")
    try:
        ckpt = CheckpointDir(mnt, keep=2)
        ckpt.save(1, {"m": {"w": torch.ones(100)}}, {})
        with pytest.raises(CheckpointError, match="previous checkpoint is kept"):
            ckpt.save(2, {"m": {"w": torch.ones(100_000)}}, {})
        snap = ckpt.load_latest()
        assert snap.round_no == 1 and torch.equal(snap.groups["m"]["w"], torch.ones(100))
    finally:
        subprocess.run(["umount", "-l", str(mnt)])  # lazy: loaded tensors may still map its files
