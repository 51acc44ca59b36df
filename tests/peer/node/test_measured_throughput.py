"""A peer's start-up throughput measurement (``peer.node.resources.measured_tokens_per_s``): measured once
per work dir and reused by a restart within the hour with the same model, device and threads, so a killed
stage server or a crashed peer is back without measuring again; anything else measures afresh."""

from __future__ import annotations

import json
import time

import torch

from models.presets import tiny_cpu
from peer.node import resources
from peer.node.resources import MEASURED_FILE, measured_tokens_per_s

RUN = tiny_cpu()
CPU = torch.device("cpu")


def _counting(monkeypatch) -> list[float]:
    """Replace the measurement by a counted one that returns the next of 100, 200, ..."""
    calls: list[float] = []

    def measure(lattice, inner, device, seconds=2.0):
        calls.append(seconds)
        return 100.0 * len(calls)

    monkeypatch.setattr(resources, "measure_tokens_per_s", measure)
    return calls


def test_a_restart_reuses_the_work_dirs_measurement(monkeypatch, tmp_path):
    calls = _counting(monkeypatch)
    assert measured_tokens_per_s(tmp_path, RUN.lattice, RUN.inner, CPU) == 100.0
    assert measured_tokens_per_s(tmp_path, RUN.lattice, RUN.inner, CPU) == 100.0
    assert len(calls) == 1
    assert measured_tokens_per_s(tmp_path / "other", RUN.lattice, RUN.inner, CPU) == 200.0  # another work dir


def test_another_model_batch_thread_count_or_an_old_figure_is_measured_again(monkeypatch, tmp_path):
    calls = _counting(monkeypatch)
    measured_tokens_per_s(tmp_path, RUN.lattice, RUN.inner, CPU)
    bigger = RUN.replace(inner={"batch_size": RUN.inner.batch_size * 2})
    assert measured_tokens_per_s(tmp_path, bigger.lattice, bigger.inner, CPU) == 200.0
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert measured_tokens_per_s(tmp_path, bigger.lattice, bigger.inner, CPU) == 300.0
    finally:
        torch.set_num_threads(threads)
    record = json.loads((tmp_path / MEASURED_FILE).read_text())
    (tmp_path / MEASURED_FILE).write_text(json.dumps({**record, "measured_at": time.time() - 2 * resources.REUSE_SECONDS}))
    torch.set_num_threads(threads + 1)
    try:
        assert measured_tokens_per_s(tmp_path, bigger.lattice, bigger.inner, CPU) == 400.0
    finally:
        torch.set_num_threads(threads)
    assert len(calls) == 4


def test_an_unreadable_record_is_measured_over(monkeypatch, tmp_path):
    calls = _counting(monkeypatch)
    (tmp_path / MEASURED_FILE).write_text("{not json")
    assert measured_tokens_per_s(tmp_path, RUN.lattice, RUN.inner, CPU) == 100.0
    assert json.loads((tmp_path / MEASURED_FILE).read_text())["tokens_per_s"] == 100.0 and len(calls) == 1
