"""The module lattice: parameter counts, deterministic per-module init, shapes, causal masking,
shared parameters between paths, per-module state, and config validation."""

from __future__ import annotations

import pytest
import torch

from models.config import LatticeConfig
from models.presets import tiny_cpu
from models.errors import ConfigError
from models.lattice import ModularLM

torch.set_num_threads(1)

SMALL = LatticeConfig(d_model=16, n_heads=2, blocks_per_module=1, seq_len=16, vocab_size=64)


@pytest.mark.parametrize(
    "cfg",
    [
        SMALL,
        LatticeConfig(d_model=16, n_heads=2, blocks_per_module=2, seq_len=8, vocab_size=50, tie_embeddings=False),
        LatticeConfig(d_model=16, n_heads=4, levels=3, modules_per_level=2, seq_len=8, vocab_size=40, shared_embed=False),
        LatticeConfig(d_model=16, n_heads=2, levels=1, modules_per_level=1, seq_len=8, vocab_size=40),
    ],
)
def test_parameter_count_of_every_module_matches_config(cfg):
    model = ModularLM(cfg, seed=3)
    assert list(model.mods.keys()) == cfg.module_ids()
    for mid in cfg.module_ids():
        assert sum(p.numel() for p in model.mods[mid].parameters()) == cfg.module_param_count(mid), mid
    for path in cfg.paths():
        pm = model.path_model(path)
        assert sum(p.numel() for p in pm.parameters()) == cfg.path_param_count(path)


def test_module_init_depends_only_on_seed_and_module_id():
    full = ModularLM(SMALL, seed=7)
    path_only = ModularLM(SMALL, seed=7, module_ids=SMALL.path_modules((1, 0)))
    assert set(path_only.mods.keys()) == {"embed", "L0M1", "L1M0", "head"}
    for mid in path_only.mods:
        a, b = full.module_state(mid), path_only.module_state(mid)
        assert all(torch.equal(a[k], b[k]) for k in a), mid
    other_seed = ModularLM(SMALL, seed=8, module_ids=["L0M1"])
    assert not torch.equal(other_seed.module_state("L0M1")["blocks.0.qkv.weight"], full.module_state("L0M1")["blocks.0.qkv.weight"])
    # Sibling modules differ from each other.
    assert not torch.equal(full.module_state("L0M0")["blocks.0.qkv.weight"], full.module_state("L0M1")["blocks.0.qkv.weight"])


def test_forward_shapes_and_loss():
    model = ModularLM(SMALL).path_model((0, 1))
    idx = torch.randint(0, SMALL.vocab_size, (3, SMALL.seq_len))
    logits, loss = model(idx, idx)
    assert logits.shape == (3, SMALL.seq_len, SMALL.vocab_size)
    assert loss.dim() == 0 and torch.isfinite(loss)
    # An untrained model is near uniform: loss close to ln(V).
    assert abs(loss.item() - torch.log(torch.tensor(float(SMALL.vocab_size))).item()) < 0.5
    logits, loss = model(idx[:, :5])
    assert logits.shape == (3, 5, SMALL.vocab_size) and loss is None
    with pytest.raises(ValueError, match="seq_len"):
        model(torch.zeros(1, SMALL.seq_len + 1, dtype=torch.long))


def test_a_token_never_sees_the_future():
    model = ModularLM(SMALL, seed=1).path_model((1, 1)).eval()
    idx = torch.randint(0, SMALL.vocab_size, (2, SMALL.seq_len))
    changed = idx.clone()
    t = 9
    changed[:, t:] = (changed[:, t:] + 1) % SMALL.vocab_size
    with torch.no_grad():
        a, _ = model(idx)
        b, _ = model(changed)
    assert torch.allclose(a[:, :t], b[:, :t], atol=1e-6)
    assert not torch.allclose(a[:, t], b[:, t])


def test_paths_share_module_parameters_and_tied_head():
    model = ModularLM(SMALL)
    p00, p01 = model.path_model((0, 0)), model.path_model((0, 1))
    assert p00.modules_by_id()["L0M0"] is p01.modules_by_id()["L0M0"]
    assert p00.module_ids == ["embed", "L0M0", "L1M0", "head"]
    # Tied embeddings: the head owns only its final norm.
    assert [n for n, _ in model.mods["head"].named_parameters()] == ["ln_f.weight"]
    idx = torch.randint(0, SMALL.vocab_size, (2, 8))
    before, _ = p01(idx)
    with torch.no_grad():
        model.mods["L0M0"].blocks[0].fc.weight.add_(0.5)  # changed through the lattice ...
    after, _ = p01(idx)
    assert not torch.allclose(before, after)  # ... seen by the path


def test_module_state_roundtrip_is_strict():
    a, b = ModularLM(SMALL, seed=0), ModularLM(SMALL, seed=1)
    b.load_module_state("L1M0", a.module_state("L1M0"))
    sa, sb = a.module_state("L1M0"), b.module_state("L1M0")
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    broken = dict(sa)
    broken.pop(next(iter(broken)))
    with pytest.raises(RuntimeError):
        b.load_module_state("L1M0", broken)


def test_building_unknown_modules_or_paths_fails():
    with pytest.raises(ValueError, match="L5M0"):
        ModularLM(SMALL, module_ids=["L5M0"])
    partial = ModularLM(SMALL, module_ids=SMALL.path_modules((0, 0)))
    with pytest.raises(ValueError, match="L0M1"):
        partial.path_model((1, 0))
    with pytest.raises(ConfigError, match="path"):
        partial.path_model((2, 0))


def test_dense_model_is_a_one_by_one_lattice():
    cfg = LatticeConfig(d_model=16, n_heads=2, levels=1, modules_per_level=1, seq_len=8, vocab_size=32)
    model = ModularLM(cfg)
    assert cfg.paths() == [(0,)] and list(model.mods) == ["embed", "L0M0", "head"]
    logits, _ = model.path_model((0,))(torch.zeros(1, 8, dtype=torch.long))
    assert logits.shape == (1, 8, 32)


@pytest.mark.parametrize(
    "kwargs, field",
    [({"d_model": 30, "n_heads": 4}, "n_heads"), ({"levels": 0}, "levels"), ({"dropout": 1.5}, "dropout"),
     ({"vocab_size": 1}, "vocab_size"), ({"seq_len": "long"}, "seq_len")],
)
def test_config_validation_names_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=f"'{field}'"):
        LatticeConfig(**kwargs)


def test_per_path_embeddings_get_their_own_modules():
    cfg = LatticeConfig(d_model=16, n_heads=2, seq_len=8, vocab_size=32, shared_embed=False)
    model = ModularLM(cfg)
    pm = model.path_model((1, 0))
    assert pm.module_ids == ["embed_1_0", "L0M1", "L1M0", "head_1_0"]
    assert not torch.equal(model.mods["embed_1_0"].tok.weight, model.mods["embed_0_0"].tok.weight)


def test_bf16_autocast_forward_on_cpu_matches_fp32_loosely():
    model = ModularLM(tiny_cpu().lattice).path_model((0, 0))
    idx = torch.randint(0, 256, (2, 16))
    _, loss = model(idx, idx)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, loss16 = model(idx, idx)
    assert loss16.dtype == torch.float32 and abs(loss16.item() - loss.item()) < 0.1
