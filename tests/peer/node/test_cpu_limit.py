"""``peer join --cpu-limit SHARE``: a volunteer on a machine they also use lets the peer train only a share of
the time. The trainer rests between inner steps (:class:`peer.node.trainer.CpuLimit`); a drain wakes it from
a rest. (The flag's range is swept with every other flag's: tests/hivepath/test_cli_sweep.py.)"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from helpers.solo import SoloAverager, one_path_dataset
from peer.node import CheckpointDir, PeerStatus
from peer.node.trainer import CpuLimit, PathTrainer

torch.set_num_threads(1)


def test_a_rest_is_the_step_time_times_the_idle_share():
    limit = CpuLimit(0.25)
    limit.after_step(0.02)
    assert limit.rested_s >= 0.06  # (1 - 0.25) / 0.25 = 3 times the step
    full = CpuLimit(1.0)
    full.after_step(5.0)
    assert full.rested_s == 0.0


def test_a_drain_wakes_the_trainer_from_its_rest():
    wake = threading.Event()
    limit = CpuLimit(0.001, wake=wake)
    done = threading.Event()
    threading.Thread(target=lambda: (limit.after_step(10.0), done.set()), daemon=True).start()  # a 10,000 s rest
    wake.set()
    assert done.wait(30), "the rest ended when the drain set the event"


@pytest.mark.parametrize("share", [0.0, -0.5, 1.5, float("nan")])
def test_a_share_outside_zero_to_one_is_refused(share):
    with pytest.raises(ValueError, match="cpu limit"):
        CpuLimit(share)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return one_path_dataset(tmp_path_factory.mktemp("cpu-limit-data"))


def _train(dataset, tmp_path, limit: CpuLimit, steps: int) -> tuple[float, PathTrainer]:
    from models.presets import tiny_cpu

    cfg = tiny_cpu().replace(lattice={"levels": 1, "modules_per_level": 1, "d_model": 32, "seq_len": 32},
                             inner={"batch_size": 4, "warmup_steps": 1}, outer={"inner_steps": 1000})
    status = PeerStatus()
    trainer = PathTrainer(cfg, (0,), dataset, torch.device("cpu"), SoloAverager(),
                          CheckpointDir(tmp_path / "checkpoints", keep=1), "solo", status, cpu_limit=limit)
    started = time.monotonic()
    trainer.run(lambda: "done" if status.step >= steps else None, lambda report: None)
    return time.monotonic() - started, trainer


def test_a_limited_trainer_rests_the_idle_share_of_its_time(dataset, tmp_path):
    wall, trainer = _train(dataset, tmp_path / "a", CpuLimit(0.25), steps=40)
    assert trainer.status.step == 40
    # every step is followed by three times its length of rest: resting is ~3/4 of the wall time
    assert trainer.cpu_limit.rested_s / wall >= 0.6, (trainer.cpu_limit.rested_s, wall)
    wall, trainer = _train(dataset, tmp_path / "b", CpuLimit(1.0), steps=40)
    assert trainer.cpu_limit.rested_s == 0.0
