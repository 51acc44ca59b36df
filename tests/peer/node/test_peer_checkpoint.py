"""Peer checkpoints: atomic snapshots, pruning, fallback past a corrupt one, disk errors reported.

A real full disk (a tmpfs) is in ``tests/chaos/test_disk_full.py``."""

from __future__ import annotations

import errno

import pytest
import torch

from peer.node import CheckpointDir, CheckpointError


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


def test_a_failure_after_the_rename_removes_the_unnamed_snapshot(tmp_path):
    """The snapshot is complete but LATEST cannot be rewritten: it is removed, LATEST is unchanged."""
    ckpt = CheckpointDir(tmp_path, keep=3)
    ckpt.save(1, _groups(1.0), {})
    (tmp_path / ".LATEST.tmp").mkdir()  # a real fault: LATEST's temporary file cannot be written
    with pytest.raises(CheckpointError, match="round-000001 is kept") as info:
        ckpt.save(2, _groups(2.0), {})
    assert info.value.errno == errno.EISDIR
    assert [p.name for p in ckpt.snapshots()] == ["round-000001"]
    assert (tmp_path / "LATEST").read_text() == "round-000001"
    assert torch.equal(ckpt.load_latest().groups["L0M0"]["w"], torch.full((3, 4), 1.0))
    (tmp_path / ".LATEST.tmp").rmdir()
    ckpt.save(3, _groups(3.0), {})
    assert ckpt.load_latest().round_no == 3


def test_a_failed_rewrite_of_the_same_round_restores_it(tmp_path):
    ckpt = CheckpointDir(tmp_path, keep=2)
    ckpt.save(1, _groups(1.0), {})
    (tmp_path / ".LATEST.tmp").mkdir()
    with pytest.raises(CheckpointError):
        ckpt.save(1, _groups(5.0), {})
    assert torch.equal(ckpt.load_latest().groups["L0M0"]["w"], torch.full((3, 4), 1.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == [".LATEST.tmp", "LATEST", "round-000001"]


def test_leftovers_of_a_crash_are_pruned_after_a_save(tmp_path):
    ckpt = CheckpointDir(tmp_path, keep=2)
    (tmp_path / ".round-000007-abc").mkdir()
    (tmp_path / ".round-000007-abc" / "modules").mkdir()
    ckpt.save(8, _groups(8.0), {})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["LATEST", "round-000008"]


def test_error_numbers_and_fixes():
    from safetensors import SafetensorError

    from models.checkpoint.rounds import _errno_of

    assert _errno_of(SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")) == 28
    assert _errno_of(OSError(errno.EDQUOT, "Disk quota exceeded")) == errno.EDQUOT
    assert _errno_of(ValueError("bad")) is None
    ckpt = CheckpointDir("/nonexistent/ckpt", keep=4, keep_flag="--keep")
    quota = ckpt._failure_message("round-000002", OSError(errno.EDQUOT, "x"), errno.EDQUOT)
    assert "EDQUOT" in quota and "--keep (now 4)" in quota and "no previous checkpoint exists" in quota
    single = CheckpointDir("/nonexistent/ckpt", keep=1)._failure_message("round-000002", OSError(28, "x"), 28)
    assert "ENOSPC" in single and "--keep-checkpoints 1" in single and "fewer" not in single
    eio = ckpt._failure_message("round-000002", OSError(errno.EIO, "x"), errno.EIO)
    assert "EIO" in eio and "another disk" in eio and "\n" not in eio


def test_module_states_round_trip_and_a_failed_save_is_reported_not_raised(tmp_path, caplog):
    from models.checkpoint import load_module
    from peer.node import PeerStatus
    from peer.node.checkpoint import save_snapshot, saved_state, state_groups
    from peer.outer import ModuleState

    state = ModuleState([torch.randn(3), torch.randn(2, 2)], [torch.randn(3), torch.randn(2, 2)], 4)
    names = {"L0M1": ["b", "w"]}
    groups, metadata = state_groups({"L0M1": state}, names, "lattice-hash")
    ckpt, status = CheckpointDir(tmp_path, keep=2), PeerStatus()
    written = save_snapshot(ckpt, 4, groups, {"rounds": {"L0M1": 4}}, metadata, status)
    assert written is not None and status.checkpoint == str(written) and status.checkpoint_error == ""
    snap = ckpt.load_latest()
    back = saved_state(snap, "L0M1", names["L0M1"])
    assert back.round_no == 4 and back.digest == state.digest
    assert saved_state(snap, "L0M0", ["w"]) is None
    assert torch.equal(load_module(written, "L0M1", "lattice-hash")["w"], state.global_params[1])

    (tmp_path / ".LATEST.tmp").mkdir()  # LATEST cannot be rewritten: the save fails for real
    assert save_snapshot(ckpt, 5, groups, {"rounds": {"L0M1": 5}}, metadata, status) is None
    assert "round-000004 is kept" in status.checkpoint_error and status.checkpoint == str(written)
    assert [r.levelname for r in caplog.records if "could not write checkpoint" in r.getMessage()] == ["ERROR"]
