"""``train-local`` and the DiLoCo simulator: the outer step's numerics against a hand computation,
error feedback, DiPaCo sqrt scaling, and real ``hivepath`` runs whose loss falls."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest
import torch

from helpers import write_corpus
from peer.localnet import hivepath_cmd
from models.config import LatticeConfig, RunConfig
from models.presets import tiny_cpu
from models.corpus import corpus_from_paths
from models.data import prepare
from models.lattice import ModularLM
from models.training import InnerLoop
from peer.averaging import flatten
from peer.simulator import DiLoCoSimulator

torch.set_num_threads(1)

ENV = {"HIVEPATH_THREADS": "1", "OMP_NUM_THREADS": "1"}


def _cfg(**outer) -> RunConfig:
    base = tiny_cpu()
    return base.replace(lattice={"d_model": 16, "n_heads": 2, "seq_len": 8, "vocab_size": 32},
                        inner={"batch_size": 2, "warmup_steps": 2}, outer={"inner_steps": 3, **outer})


def _batches(k: int, path):
    gen = torch.Generator().manual_seed(100 + k)
    while True:
        chunk = torch.randint(0, 32, (2, 9), generator=gen)  # (B, T+1)
        yield chunk[:, :-1], chunk[:, 1:]


def test_outer_step_matches_a_hand_computation():
    cfg = _cfg(codec="none").replace(lattice={"levels": 1, "modules_per_level": 1})
    sim = DiLoCoSimulator(cfg, [(0,)], workers=2, batches=_batches)
    sim.train(3)
    # The same two workers, by hand.
    init = ModularLM(cfg.lattice, seed=cfg.seed)
    locals_ = []
    for k in range(2):
        model = ModularLM(cfg.lattice, seed=cfg.seed)
        loop = InnerLoop(model.path_model((0,)), cfg.inner)
        it = _batches(k, (0,))
        for _ in range(3):
            loop.step(*next(it))
        locals_.append(model)
    tokens = 3 * cfg.inner.batch_size * cfg.lattice.seq_len
    lr, m = cfg.outer.lr, cfg.outer.momentum
    for mid in cfg.lattice.module_ids():
        g0 = flatten(init.mods[mid].parameters())
        deltas = [g0 - flatten(w.mods[mid].parameters()) for w in locals_]
        avg = (deltas[0] * float(tokens) + deltas[1] * float(tokens)) / (2.0 * tokens)  # weighted mean, worker order
        buf = avg  # momentum buffer starts at zero
        expected = g0 - (avg + buf * m) * lr  # Nesterov
        got = flatten(sim.global_state(mid).values())
        assert torch.allclose(got, expected, atol=1e-7), mid
        for w in sim.workers:  # every worker was reset to the global copy
            assert torch.equal(flatten(w.module_params(mid)), got)


def test_error_feedback_keeps_what_the_codec_dropped():
    cfg = _cfg(codec="int8")
    sim = DiLoCoSimulator(cfg, cfg.lattice.paths(), workers=4, batches=_batches)
    before = {mid: flatten(sim.outer[mid].global_params) for mid in sim.module_ids}
    sim.train(3)
    for mid in sim.module_ids:
        holders = sim.holders(mid)
        assert len(holders) == len(cfg.lattice.paths_through(mid))
        for w in holders:
            r = w.residual[mid]
            assert r.abs().max() > 0  # int8 dropped something ...
            assert r.abs().max() < 1e-2 * max(1e-12, float(before[mid].abs().max())) + 1e-3  # ... but little
        # Holders end identical to the global copy.
        g = flatten(sim.outer[mid].global_params)
        assert all(torch.equal(flatten(w.module_params(mid)), g) for w in holders)


def test_sqrt_sharing_scales_shared_modules():
    def moved(sqrt_sharing: bool) -> dict[str, torch.Tensor]:
        cfg = _cfg(codec="none", sqrt_sharing=sqrt_sharing, momentum=0.0, lr=1.0)
        sim = DiLoCoSimulator(cfg, cfg.lattice.paths(), workers=4, batches=_batches)
        start = {mid: flatten(sim.outer[mid].global_params) for mid in sim.module_ids}
        sim.train(3)
        return {mid: start[mid] - flatten(sim.outer[mid].global_params) for mid in sim.module_ids}

    plain, scaled = moved(False), moved(True)
    for mid, n_paths in (("embed", 4), ("L0M0", 2), ("L1M1", 2), ("head", 4)):
        assert torch.allclose(scaled[mid], plain[mid] * math.sqrt(n_paths), rtol=1e-4, atol=1e-7), mid


def test_simulator_refuses_too_few_workers():
    cfg = _cfg()
    with pytest.raises(ValueError, match="cannot cover 4 paths"):
        DiLoCoSimulator(cfg, cfg.lattice.paths(), workers=2, batches=_batches)


@pytest.fixture(scope="module")
def data_2x2(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tl")
    src = write_corpus(root / "src", per_domain=40)
    prepare(corpus_from_paths([str(src / d) for d in ("scripture", "plays", "code")]), root / "d", levels=2, modules=2)
    return root / "d"


def _run(*args: str, cwd=None, timeout=240) -> subprocess.CompletedProcess:
    import os

    return subprocess.run(hivepath_cmd(*args), capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **ENV}, cwd=cwd)


def test_train_local_all_paths_loss_falls_and_eval_reproduces(data_2x2, tmp_path):
    out = tmp_path / "run"
    r = _run("train-local", "--data", str(data_2x2), "--steps", "60", "--inner-steps", "20", "--eval-docs", "4",
             "--out", str(out))
    assert r.returncode == 0, r.stderr
    summary = json.loads((out / "run.json").read_text())
    assert summary["first_loss"] - summary["final_loss"] > 1.0, summary["loss_history"]
    assert summary["workers"] == 4 and summary["outer_steps"] and summary["paths"] == ["0,0", "0,1", "1,0", "1,1"]
    assert sorted(p.name for p in (out / "modules").iterdir()) == sorted(
        f"{m}.safetensors" for m in LatticeConfig(**summary["config"]["lattice"]).module_ids())
    assert set(summary["eval"]["per_path"]) >= {"0,0", "0,1", "1,0", "1,1"}
    assert 0 < summary["eval"]["bpb"] < 8 and "bits/byte (routed)" in r.stderr
    r = _run("eval", "--from", str(out), "--max-docs", "4", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["bpb"] == pytest.approx(summary["eval"]["bpb"], rel=1e-9)


def test_train_local_one_path_and_dense(data_2x2, tmp_path):
    r = _run("train-local", "--data", str(data_2x2), "--path", "1,0", "--steps", "30", "--eval-docs", "2",
             "--out", str(tmp_path / "one"))
    assert r.returncode == 0, r.stderr
    one = json.loads((tmp_path / "one" / "run.json").read_text())
    assert one["paths"] == ["1,0"] and not one["outer_steps"] and one["modules"] == ["embed", "L0M1", "L1M0", "head"]
    assert one["final_loss"] < one["first_loss"]
    r = _run("train-local", "--data", str(data_2x2), "--dense", "--workers", "2", "--inner-steps", "10",
             "--steps", "20", "--codec", "fp16", "--eval-docs", "2", "--out", str(tmp_path / "dense"))
    assert r.returncode == 0, r.stderr
    dense = json.loads((tmp_path / "dense" / "run.json").read_text())
    assert dense["dense"] and dense["modules"] == ["embed", "L0M0", "head"] and dense["config"]["outer"]["codec"] == "fp16"
    assert dense["final_loss"] < dense["first_loss"]


def test_train_local_bad_input_gives_one_line(data_2x2, tmp_path):
    r = _run("train-local", "--data", str(data_2x2), "--workers", "2", "--steps", "2", "--out", str(tmp_path / "x"))
    assert r.returncode == 2 and "cannot cover 4 paths" in r.stderr and "Traceback" not in r.stderr
    r = _run("train-local", "--data", str(data_2x2), "--path", "5,0", "--steps", "2", "--out", str(tmp_path / "x"))
    assert r.returncode == 2 and "config field 'path'" in r.stderr
    r = _run("train-local", "--data", str(tmp_path / "nowhere"), "--steps", "2")
    assert r.returncode == 2 and "not a prepared dataset" in r.stderr
    assert not (tmp_path / "x").exists()


def test_train_local_prepares_the_builtin_corpus_on_a_fresh_machine(tmp_path):
    r = _run("train-local", "--preset", "tiny", "--path", "0,1", "--steps", "5", "--eval-docs", "1",
             "--out", "run", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    manifest = json.loads((tmp_path / "data" / "default-bytes" / "manifest.json").read_text())
    assert manifest["corpus"] == "default" and manifest["lattice"] == {"levels": 2, "modules_per_level": 2}
    summary = json.loads((tmp_path / "run" / "run.json").read_text())
    assert summary["config"]["data"]["manifest_hash"] == summary["data"]["manifest_hash"]


def test_eval_refuses_a_run_with_another_dataset(data_2x2, tmp_path):
    out = tmp_path / "run"
    r = _run("train-local", "--data", str(data_2x2), "--path", "0,0", "--steps", "3", "--eval-docs", "1", "--out", str(out))
    assert r.returncode == 0, r.stderr
    src = write_corpus(tmp_path / "src", per_domain=12, seed=9)
    prepare(corpus_from_paths([str(src)]), tmp_path / "other", levels=2, modules=2)
    r = _run("eval", "--from", str(out), "--data", str(tmp_path / "other"))
    assert r.returncode == 4 and "manifest" in r.stderr and "Traceback" not in r.stderr


def test_config_file_then_flags_override_the_preset(tmp_path):
    from argparse import Namespace

    from hivepath.cmd_train_local import resolve_config
    from models.errors import ConfigError

    toml = tmp_path / "run.toml"
    toml.write_text('preset = "demo"\nseed = 4\n[outer]\ncodec = "fp16"\ninner_steps = 7\n[lattice]\nd_model = 64\n')
    base = dict(preset=None, config=str(toml), inner_steps=None, codec=None, outer_lr=None, outer_momentum=None,
                seed=None, dense=False)
    cfg = resolve_config(Namespace(**base))
    assert (cfg.run_id, cfg.seed, cfg.outer.codec, cfg.outer.inner_steps, cfg.lattice.d_model) == ("demo", 4, "fp16", 7, 64)
    cfg = resolve_config(Namespace(**{**base, "inner_steps": 3, "codec": "int4", "seed": 9, "outer_lr": 0.5, "dense": True}))
    assert (cfg.outer.inner_steps, cfg.outer.codec, cfg.seed, cfg.outer.lr) == (3, "int4", 9, 0.5)
    assert (cfg.lattice.levels, cfg.lattice.modules_per_level, cfg.lattice.d_model) == (1, 1, 64)
    with pytest.raises(ConfigError, match="preset"):
        resolve_config(Namespace(**{**base, "preset": "tiny"}))
    with pytest.raises(ConfigError, match="momentum"):
        resolve_config(Namespace(**{**base, "outer_momentum": 1.5}))
    assert resolve_config(Namespace(**base)).inner.decay_steps == 0
    cfg = resolve_config(Namespace(**{**base, "lr_decay": True, "steps": 500}))
    assert (cfg.inner.decay_steps, cfg.inner.min_lr_ratio) == (500, 0.1)
    with pytest.raises(ConfigError, match="--lr-decay needs --steps above the warm-up"):
        resolve_config(Namespace(**{**base, "lr_decay": True, "steps": 3}))


@pytest.mark.gpu
def test_inner_loop_trains_on_cuda_under_bf16_autocast():
    cfg = _cfg()
    model = ModularLM(cfg.lattice, seed=0).cuda().path_model((0, 0))
    loop = InnerLoop(model, cfg.inner, "cuda")
    x = torch.randint(0, 32, (2, 8), device="cuda")
    first = float(loop.step(x, x))
    for _ in range(30):
        last = float(loop.step(x, x))
    assert next(model.parameters()).dtype == torch.float32  # weights stay fp32; autocast computes in bf16
    assert last < first - 0.5
