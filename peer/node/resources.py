"""What this machine can do: device, memory, and measured training throughput on the run's model.

The coordinator assigns work by these numbers (a path when a whole path fits, one module as a
pipeline stage otherwise), so they are measured, not guessed: tokens/s comes from timing real
inner steps of the run's own path model on this device.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Optional

import psutil
import torch

from models.config import LatticeConfig, InnerConfig
from models.errors import HivepathError

__all__ = ["Capabilities", "resolve_device", "usable_memory_bytes", "measure_tokens_per_s", "NoDeviceError"]

log = logging.getLogger(__name__)


class NoDeviceError(HivepathError):
    """The requested device does not exist on this machine."""

    exit_code = 2


@dataclass(frozen=True)
class Capabilities:
    """What a peer reports at join."""

    device: str
    """``cpu`` or ``cuda:N`` with the GPU's name, e.g. ``cuda:0 (NVIDIA H100)``."""
    memory_bytes: int
    """Memory this peer may use for training (after ``--max-memory``)."""
    tokens_per_s: float
    """Measured inner-step throughput on one path of the run's model."""


def resolve_device(choice: str = "auto") -> torch.device:
    """``auto`` picks CUDA when present; ``cuda`` without a GPU is a clear error."""
    choice = choice.lower()
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if choice.startswith("cuda"):
        if not torch.cuda.is_available():
            raise NoDeviceError("--device cuda was asked for but this machine has no usable CUDA GPU; use --device cpu")
        return torch.device(choice)
    if choice == "cpu":
        return torch.device("cpu")
    raise NoDeviceError(f"--device {choice!r} is not one of auto, cpu, cuda, cuda:N")


def describe_device(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return "cpu"


def usable_memory_bytes(device: torch.device, max_memory_gb: Optional[float] = None) -> int:
    """Free memory of the device (GPU memory for CUDA, available RAM for CPU), capped by the user."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
    else:
        free = psutil.virtual_memory().available
    if max_memory_gb is not None:
        if max_memory_gb <= 0:
            raise HivepathError(f"--max-memory must be > 0 GB, got {max_memory_gb}")
        free = min(free, int(max_memory_gb * 2**30))
    return int(free)


def measure_tokens_per_s(
    lattice: LatticeConfig,
    inner: InnerConfig,
    device: torch.device,
    seconds: float = 2.0,
    max_steps: int = 50,
) -> float:
    """Time real inner steps (forward, backward, AdamW) of one path on random tokens.

    The first step is a warm-up and is not counted. Returns tokens per second.
    """
    from models.lattice import ModularLM
    from models.training import InnerLoop

    path = lattice.paths()[0]
    lm = ModularLM(lattice, seed=0, module_ids=lattice.path_modules(path)).to(device)
    loop = InnerLoop(lm.path_model(path), inner, device)
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, lattice.vocab_size, (inner.batch_size, lattice.seq_len + 1), generator=gen).to(device)
    tokens = 0
    elapsed = 0.0
    for step in range(max_steps + 1):
        start = time.perf_counter()
        loop.step(x[:, :-1], x[:, 1:])
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if step > 0:
            elapsed += time.perf_counter() - start
            tokens += inner.batch_size * lattice.seq_len
            if elapsed >= seconds:
                break
    rate = tokens / max(elapsed, 1e-9)
    log.info("measured %.0f tokens/s on %s (%d steps)", rate, describe_device(device), step)
    return rate
