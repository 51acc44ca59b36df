"""Fixtures shared by every test: seeded randomness, reaped child processes, CUDA and Docker gates."""

from __future__ import annotations

import os
import random

import pytest

from helpers import ProcessGroup


@pytest.fixture(autouse=True)
def _seed():
    random.seed(0)
    try:
        import numpy as np

        np.random.seed(0)
    except ImportError:
        pass
    try:
        import torch

        torch.manual_seed(0)
    except ImportError:
        pass


@pytest.fixture
def procs(tmp_path):
    """Start real child processes; every one is terminated and reaped when the test ends."""
    group = ProcessGroup(tmp_path / "logs")
    try:
        yield group
    finally:
        group.close()


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)
