"""A module nobody holds starts from a held sibling of its level (peer.node.fresh_start): which sibling,
what is copied (the global copy; momentum zeroed, round 0), and the seed's init when none is held."""

from __future__ import annotations

import pytest
import torch

from models.config import LatticeConfig, OuterConfig
from models.lattice import ModularLM
from peer.diloco import DiLoCoOptimizer
from peer.node.fresh_start import sibling_ids, start_fresh_module
from peer.outer import ModuleState

LATTICE = LatticeConfig(levels=2, modules_per_level=4, d_model=16, n_heads=2, seq_len=8, vocab_size=32)


def test_siblings_are_the_modules_of_the_level_nearest_index_first():
    assert sibling_ids(LATTICE, "L1M2") == ["L1M1", "L1M3", "L1M0"]
    assert sibling_ids(LATTICE, "L0M0") == ["L0M1", "L0M2", "L0M3"]
    assert sibling_ids(LATTICE, "embed") == [] and sibling_ids(LATTICE, "head") == []
    private = LatticeConfig(levels=1, modules_per_level=2, shared_embed=False)
    assert sibling_ids(private, "embed_1") == ["embed_0"] and sibling_ids(private, "head_0") == ["head_1"]


def _opt(module_id: str) -> tuple[DiLoCoOptimizer, list[torch.Tensor]]:
    lm = ModularLM(LATTICE, seed=0, module_ids=[module_id])
    mod = lm.mods[module_id]
    opt = DiLoCoOptimizer({module_id: mod}, torch.optim.SGD(mod.parameters(), lr=0.1), OuterConfig())
    return opt, [p.detach().clone() for p in mod.parameters()]


def test_a_fresh_module_takes_the_first_held_siblings_global_copy_with_zero_momentum():
    opt, like = _opt("L1M2")
    trained = ModuleState([t + 1.0 for t in like], [torch.full_like(t, 5.0) for t in like], 37)
    asked = []

    def fetch(mid, like_, joining=True):
        asked.append((mid, joining))
        return trained if mid == "L1M3" else None  # L1M1, the nearest, has no holder

    assert start_fresh_module(opt, LATTICE, "L1M2", like, fetch) == "sibling:L1M3@37"
    # not as a joiner: the sibling's holders must not wait for us to declare its rounds
    assert asked == [("L1M1", False), ("L1M3", False)]
    st = opt.module_state("L1M2")
    assert st.round_no == 0 and all(torch.equal(g, t) for g, t in zip(st.global_params, trained.global_params))
    assert all(not m.any() for m in st.momentum)
    local = list(opt._modules["L1M2"].params)
    assert all(torch.equal(p.detach(), g) for p, g in zip(local, st.global_params))


def test_no_held_sibling_or_the_seed_rule_keeps_the_seed_init():
    opt, like = _opt("L0M1")
    assert start_fresh_module(opt, LATTICE, "L0M1", like, lambda mid, like_, **kw: None) == "init"
    untrained = ModuleState([t + 1.0 for t in like], [torch.zeros_like(t) for t in like], 0)
    assert start_fresh_module(opt, LATTICE, "L0M1", like, lambda mid, like_, **kw: untrained) == "init"  # round 0
    assert start_fresh_module(opt, LATTICE, "L0M1", like, None) == "init"
    called = []
    assert start_fresh_module(opt, LATTICE, "L0M1", like, lambda mid, l, **kw: called.append(mid), how="seed") == "init"
    assert called == [] and all(torch.equal(g, t) for g, t in zip(opt.module_state("L0M1").global_params, like))
    with pytest.raises(ValueError, match="fresh start 'zero'"):
        start_fresh_module(opt, LATTICE, "L0M1", like, None, how="zero")
