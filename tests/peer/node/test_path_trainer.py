"""The path trainer's inner optimizer follows the run's inner config as the simulator's and the stage
runner's do: the learning rate warms up over ``inner.warmup_steps`` and gradients are clipped to
``inner.grad_clip``. (A ready AdamW handed to the outer optimizer would apply neither: a peer
joining onto trained modules would take full-size Adam steps on every weight from its first one.)"""

from __future__ import annotations

import pytest
import torch

from helpers.solo import SoloAverager, one_path_dataset
from models.training import warmup_lr
from peer.node import CheckpointDir, PeerStatus
from peer.node.trainer import PathTrainer

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return one_path_dataset(tmp_path_factory.mktemp("path-trainer-data"))


def test_the_path_trainer_warms_the_learning_rate_up_and_clips_gradients(dataset, tmp_path):
    from models.presets import tiny_cpu

    cfg = tiny_cpu().replace(lattice={"levels": 1, "modules_per_level": 1, "d_model": 32, "seq_len": 32},
                             inner={"batch_size": 4, "lr": 1e-2, "warmup_steps": 10, "grad_clip": 1e-3},
                             outer={"inner_steps": 1000})
    trainer = PathTrainer(cfg, (0,), dataset, torch.device("cpu"), SoloAverager(),
                          CheckpointDir(tmp_path / "checkpoints", keep=1), "solo", PeerStatus())
    clipped = []
    params = [p for group in trainer.opt.param_groups for p in group["params"]]
    hook = trainer.opt.inner.register_step_pre_hook(
        lambda opt, args, kwargs: clipped.append(float(torch.nn.utils.get_total_norm([p.grad for p in params]))))
    try:
        for step in range(3):
            trainer.train_step()
            assert trainer.opt.param_groups[0]["lr"] == pytest.approx(warmup_lr(cfg.inner, step))
    finally:
        hook.remove()
    assert trainer.opt.param_groups[0]["lr"] < cfg.inner.lr
    assert clipped and max(clipped) <= 1e-3 * (1 + 1e-4), clipped  # each step's gradients, clipped first
