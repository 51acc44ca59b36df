"""Checkpoints: safetensors round trips, atomic writes, clear errors for corrupt or foreign files."""

from __future__ import annotations

import pytest
import torch

from models.checkpoint import CheckpointError, load_module, load_tensors, module_file, save_module, save_tensors
from models.config import LatticeConfig
from models.errors import HivepathError
from models.lattice import ModularLM


def test_tensors_and_metadata_round_trip(tmp_path):
    tensors = {"a": torch.randn(3, 4), "b": torch.arange(5, dtype=torch.int64), "c": torch.randn(2).to(torch.bfloat16)}
    save_tensors(tmp_path / "x.safetensors", tensors, {"round": "3", "module_id": "L0M1"})
    back, meta = load_tensors(tmp_path / "x.safetensors")
    assert meta == {"round": "3", "module_id": "L0M1"}
    assert set(back) == set(tensors)
    for k in tensors:
        assert back[k].dtype == tensors[k].dtype and torch.equal(back[k], tensors[k])


def test_write_is_atomic_and_leaves_no_temporaries(tmp_path):
    path = tmp_path / "m.safetensors"
    save_tensors(path, {"w": torch.ones(4)}, {})
    save_tensors(path, {"w": torch.zeros(4)}, {})  # overwrite in place
    assert [p.name for p in tmp_path.iterdir()] == ["m.safetensors"]
    assert torch.equal(load_tensors(path)[0]["w"], torch.zeros(4))
    with pytest.raises(TypeError):
        save_tensors(path, {"w": torch.ones(4)}, {"round": 3})  # type: ignore[dict-item]
    assert torch.equal(load_tensors(path)[0]["w"], torch.zeros(4))  # the failed save changed nothing
    assert [p.name for p in tmp_path.iterdir()] == ["m.safetensors"]


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_corrupt_file_raises_a_clear_error(tmp_path, damage):
    path = tmp_path / "m.safetensors"
    save_tensors(path, {"w": torch.randn(64)}, {"module_id": "embed"})
    data = path.read_bytes()
    path.write_bytes({"truncate": data[: len(data) // 2], "garbage": b"\x00\xff" * 40, "empty": b""}[damage])
    with pytest.raises(CheckpointError, match="corrupt") as e:
        load_tensors(path)
    assert isinstance(e.value, HivepathError)


def test_missing_file_raises_checkpoint_error(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_tensors(tmp_path / "nope.safetensors")


def test_module_checkpoints_round_trip_and_refuse_foreign_files(tmp_path):
    cfg = LatticeConfig(d_model=16, n_heads=2, seq_len=8, vocab_size=32)
    model = ModularLM(cfg, seed=1)
    save_module(tmp_path, "L0M1", model.module_state("L0M1"), cfg.content_hash(), round="2")
    fresh = ModularLM(cfg, seed=2)
    fresh.load_module_state("L0M1", load_module(tmp_path, "L0M1", cfg.content_hash()))
    a, b = model.module_state("L0M1"), fresh.module_state("L0M1")
    assert all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(CheckpointError, match="lattice"):
        load_module(tmp_path, "L0M1", "0" * 16)
    module_file(tmp_path, "L0M0").write_bytes(module_file(tmp_path, "L0M1").read_bytes())
    with pytest.raises(CheckpointError, match="holds module 'L0M1'"):
        load_module(tmp_path, "L0M0", cfg.content_hash())
