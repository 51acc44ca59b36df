"""Checkpoints: safetensors round trips, atomic writes, clear errors for corrupt or foreign files."""

from __future__ import annotations

import json

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


# -- the layout on disk, pinned independently of the writer -------------------------------------


def _relative_files(root) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_a_snapshot_laid_out_by_hand_loads(tmp_path):
    """Checkpoints and archives written before this code (raw safetensors, run.json without a final
    newline) keep loading: the layout is pinned here by building it without models.checkpoint."""
    from safetensors.torch import save_file

    from models.checkpoint import CheckpointDir, resolve_snapshot

    root = tmp_path / "work" / "checkpoints"
    snap = root / "round-000007"
    (snap / "modules").mkdir(parents=True)
    (snap / "outer").mkdir()
    weight = torch.randn(3, 2)
    save_file({"weight": weight}, str(snap / "modules" / "L0M0.safetensors"),
              metadata={"module_id": "L0M0", "lattice_hash": "h"})
    save_file({"momentum.0": torch.ones(3, 2)}, str(snap / "outer" / "L0M0.safetensors"))
    (snap / "run.json").write_text(json.dumps({"round": 7, "groups": ["modules/L0M0", "outer/L0M0"],
                                               "rounds": {"L0M0": 7}}, indent=1, sort_keys=True))
    (root / "LATEST").write_text("round-000007")

    loaded = CheckpointDir(root).load_latest()
    assert loaded.round_no == 7 and loaded.module_round("L0M0") == 7 and loaded.module_round("L0M1") == -1
    params, momentum = loaded.module_state("L0M0", ["weight"])
    assert torch.equal(params[0], weight) and torch.equal(momentum[0], torch.ones(3, 2))
    assert torch.equal(load_module(snap, "L0M0", "h")["weight"], weight)  # a snapshot is a run directory
    assert resolve_snapshot(root) == snap and resolve_snapshot(tmp_path / "work") == snap
    assert resolve_snapshot(tmp_path) == tmp_path


def test_a_snapshot_is_written_in_the_pinned_layout(tmp_path):
    from safetensors.torch import save

    from models.checkpoint import CheckpointDir, module_groups, module_tensors

    params, momentum = [torch.randn(4), torch.randn(2, 3)], [torch.randn(4), torch.randn(2, 3)]
    groups, metadata = module_groups("L1M0", ["b", "w"], params, momentum, "h")
    back_params, back_momentum = module_tensors(groups, "L1M0", ["b", "w"])
    assert all(a is b for a, b in zip(back_params + back_momentum, params + momentum))
    written = CheckpointDir(tmp_path).save(3, groups, {"rounds": {"L1M0": 3}}, metadata)
    assert written == tmp_path / "round-000003"
    assert _relative_files(tmp_path) == ["LATEST", "round-000003/modules/L1M0.safetensors",
                                         "round-000003/outer/L1M0.safetensors", "round-000003/run.json"]
    assert (tmp_path / "LATEST").read_text() == "round-000003"
    assert (written / "outer" / "L1M0.safetensors").read_bytes() == save({"momentum.0": momentum[0],
                                                                          "momentum.1": momentum[1]})
    tensors, meta = load_tensors(written / "modules" / "L1M0.safetensors")
    assert meta == {"module_id": "L1M0", "lattice_hash": "h"} and torch.equal(tensors["w"], params[1])
    summary = json.loads((written / "run.json").read_text())
    assert summary == {"rounds": {"L1M0": 3}, "round": 3, "groups": ["modules/L1M0", "outer/L1M0"]}


# -- run.json: SnapshotSummary --------------------------------------------------------------------


def test_the_summary_round_trips_and_keeps_a_writers_own_keys():
    from models.checkpoint import SUMMARY_VERSION, SnapshotSummary
    from models.presets import tiny_cpu

    cfg = tiny_cpu()
    written = SnapshotSummary.of(cfg, ["embed", "L0M0"], paths=["0,0"], data_dir="/d", manifest_hash="m",
                                 rounds={"embed": 3}, peer_id="p").to_dict()
    assert written["summary_version"] == SUMMARY_VERSION and written["config_hash"] == cfg.content_hash()
    assert written["data"] == {"dir": "/d", "manifest_hash": "m"} and written["paths"] == ["0,0"]
    back = SnapshotSummary.from_dict(json.loads(json.dumps(written)))
    assert back.to_dict() == written and back.extra == {"rounds": {"embed": 3}, "peer_id": "p"}


def test_the_summary_reader_takes_a_stage_servers_snapshot_and_refuses_a_newer_version():
    """A stage server's snapshots (written before every writer built the summary) name no path and no
    dataset; a file of a newer summary version is refused by name; a file of no version is version 1."""
    from models.checkpoint import SnapshotSummary, SummaryError
    from models.presets import tiny_cpu

    cfg = tiny_cpu()
    stage = {"config": cfg.to_dict(), "config_hash": cfg.content_hash(), "modules": ["L1M0"], "rounds": {"L1M0": 4},
             "dense": False, "unix_time": 1.0, "peer_id": "p", "round": 4, "groups": ["modules/L1M0", "outer/L1M0"]}
    read = SnapshotSummary.from_dict(stage)
    assert (read.version, read.paths, read.data_dir, read.manifest_hash) == (1, (), "", "")
    assert read.modules == ("L1M0",) and read.extra["round"] == 4
    with pytest.raises(SummaryError, match="summary version 99, written by a newer hivepath"):
        SnapshotSummary.from_dict({**stage, "summary_version": 99})
    with pytest.raises(SummaryError, match="lacks config, dense"):
        SnapshotSummary.from_dict({"modules": ["L1M0"]})
    with pytest.raises(SummaryError, match="'data' must hold 'dir' and 'manifest_hash'"):
        SnapshotSummary.from_dict({**stage, "data": {"dir": "/d"}})


def test_a_stage_servers_snapshot_loads_as_a_run_directory(tmp_path):
    """``load_run_dir`` (eval, generate, export) reads a stage server's snapshot: its modules, no path."""
    from models.checkpoint import save_module
    from models.presets import tiny_cpu
    from models.run_dir import load_run_dir

    cfg = tiny_cpu()
    model = ModularLM(cfg.lattice, seed=0, module_ids=["L0M1"])
    save_module(tmp_path, "L0M1", model.module_state("L0M1"), cfg.lattice.content_hash())
    (tmp_path / "run.json").write_text(json.dumps({"config": cfg.to_dict(), "config_hash": cfg.content_hash(),
                                                   "modules": ["L0M1"], "dense": False, "rounds": {"L0M1": 2}}))
    rd = load_run_dir(tmp_path, with_data=False)
    assert rd.trained_paths == [] and rd.manifest_hash == "" and list(rd.summary["modules"]) == ["L0M1"]
