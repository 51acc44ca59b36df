"""bench.byzantine's attacked run on a tiny dense model: the defence bans a x100 sender through the
coordinator in the first round and keeps it from ruining the model; the control (plain mean, no
bans) bans no one and is ruined. (Whether an honest peer is banned too is reported by the bench,
``honest_banned``: in this set-up one is, see docs/BENCHMARKS.md.)"""

from __future__ import annotations

import pytest
import torch

from bench.byzantine import Attacked, _bpb
from models.corpus import default_corpus
from models.data import Dataset, prepare
from models.presets import tiny_cpu
from peer.simulator import DiLoCoSimulator


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    out = tmp_path_factory.mktemp("byz") / "data"
    prepare(default_corpus(), out, levels=1, modules=1, tokenizer="bytes")
    ds = Dataset(out)
    cfg = tiny_cpu().replace(lattice={"levels": 1, "modules_per_level": 1, "vocab_size": ds.manifest["vocab_size"]},
                             outer={"aggregator": "trimmed_mean", "norm_bound": 2.0, "inner_steps": 3},
                             data={"manifest_hash": ds.manifest_hash, "tokenizer": ds.manifest["tokenizer"]})
    sim = DiLoCoSimulator(cfg, [(0,)], 1, lambda k, p: ds.dense_batches("train", 8, cfg.lattice.seq_len, 5),
                          outer_steps=False)
    sim.train(30)
    return ds, cfg, {mid: sim.global_state(mid) for mid in sim.module_ids}


def test_defence_bans_a_scaled_sender_and_the_control_does_not(setup):
    ds, cfg, state = setup
    torch.set_num_threads(1)
    defended = Attacked(ds, cfg, state, 5, [4], "scaled", True, seed=0).run(2, ds, cfg)
    control = Attacked(ds, cfg, state, 5, [4], "scaled", False, seed=0).run(2, ds, cfg)
    assert defended["rounds_to_ban"] == 1
    assert control["rounds_to_ban"] is None and control["reports"] == 0
    assert defended["bpb"] < control["bpb"] - 1.0, (defended, control)


def test_a_clean_run_starts_from_the_pretrained_state(setup):
    ds, cfg, state = setup
    run = Attacked(ds, cfg, state, 5, [], None, True, seed=0)
    assert _bpb(run.sim.global_model(), ds, cfg) == pytest.approx(_bpb(_model(cfg, state), ds, cfg))


def _model(cfg, state):
    from models.lattice import ModularLM

    model = ModularLM(cfg.lattice, seed=cfg.seed, module_ids=list(state))
    for mid, named in state.items():
        model.load_module_state(mid, named)
    return model
