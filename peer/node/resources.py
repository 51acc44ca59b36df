"""What this machine can do: device, memory, and measured training throughput on the run's model.

The coordinator assigns work by these numbers (a path when a whole path fits, one module as a
pipeline stage otherwise), so they are measured, not guessed: tokens/s comes from timing real
inner steps of the run's own path model on this device.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import psutil
import torch

from models.config import LatticeConfig, InnerConfig
from models.errors import HivepathError

__all__ = ["Capabilities", "resolve_device", "usable_memory_bytes", "measure_tokens_per_s", "measured_tokens_per_s",
           "MEASURED_FILE", "REUSE_SECONDS"]

MEASURED_FILE = "measured.json"
"""The work dir's record of the last throughput measurement (:func:`measured_tokens_per_s`)."""
REUSE_SECONDS = 3600.0
"""How old a measurement a restarted peer reuses instead of measuring again."""

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Capabilities:
    """What a peer reports at join."""

    device: str
    """``cpu`` or ``cuda:N`` with the GPU's name, e.g. ``cuda:0 (NVIDIA H100)``."""
    memory_bytes: int
    """Memory this peer may use for training (after ``--max-memory``)."""
    tokens_per_s: float
    """Measured inner-step throughput on one path of the run's model."""


def resolve_device(choice: str = "auto", others: Optional[dict[str, str]] = None) -> torch.device:
    """The device of ``--device choice`` on this machine, given the devices the other peers of the
    machine train on (``others``: registration -> device): :func:`peer.node.machine_share.choose_device` with
    torch's GPU count."""
    from peer.node.machine_share import choose_device

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return torch.device(choose_device(choice, others or {}, gpus))


def describe_device(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return "cpu"


def usable_memory_bytes(device: torch.device, max_memory_gb: Optional[float] = None, sharing: int = 1) -> int:
    """Memory this peer offers: ``--max-memory`` GB when given; else the device's free memory (GPU
    memory for CUDA, available RAM for CPU) divided among the ``sharing`` peers of this machine on
    that device (:meth:`peer.node.machine_share.MachineShare.peers_on`, this one included)."""
    if max_memory_gb is not None and max_memory_gb <= 0:
        raise HivepathError(f"--max-memory must be > 0 GB, got {max_memory_gb}")
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
    else:
        free = psutil.virtual_memory().available
    if max_memory_gb is not None:
        return int(min(free, int(max_memory_gb * 2**30)))
    share = int(free // max(1, sharing))
    if sharing > 1:
        log.info("sharing %s's %.1f GB free with %d other peer%s: offering %.1f GB (--max-memory GB to choose)",
                 f"the GPU {device}" if device.type == "cuda" else "the machine", free / 2**30, sharing - 1,
                 "s" if sharing > 2 else "", share / 2**30)
    return share


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


def _measure_key(lattice: LatticeConfig, inner: InnerConfig, device: torch.device) -> str:
    """What a throughput measurement depends on: the model and batch, the device, torch's threads and
    version, this release."""
    import dataclasses

    from models.config_fields import stable_hash
    from protos.versions import RELEASE

    return stable_hash({"lattice": dataclasses.asdict(lattice), "inner": dataclasses.asdict(inner),
                        "device": describe_device(device), "threads": torch.get_num_threads(),
                        "torch": torch.__version__, "release": RELEASE})


def measured_tokens_per_s(work_dir: Path, lattice: LatticeConfig, inner: InnerConfig, device: torch.device,
                          seconds: float = 2.0, reuse_seconds: float = REUSE_SECONDS) -> float:
    """:func:`measure_tokens_per_s`, or the figure the same work dir measured less than ``reuse_seconds``
    ago for the same model, batch, device, threads and release: a peer restarted after a crash or a
    kill (a preempted stage server) is back in seconds, not after another measurement. The figure only
    seeds the coordinator's choice of work; what the peer then trains or serves replaces it."""
    import json

    from models import strict_json
    from models.durable import atomic_write_text

    path = Path(work_dir) / MEASURED_FILE
    key = _measure_key(lattice, inner, device)
    try:
        last = json.loads(path.read_text())
        age = time.time() - float(last["measured_at"])
        if last["key"] == key and 0 <= age < reuse_seconds and float(last["tokens_per_s"]) > 0:
            log.info("reusing the %.0f tokens/s this work dir measured %.0fs ago (same model, device and threads)",
                     float(last["tokens_per_s"]), age)
            return float(last["tokens_per_s"])
    except (OSError, ValueError, KeyError, TypeError):
        pass  # none yet, or unreadable: measure
    rate = measure_tokens_per_s(lattice, inner, device, seconds=seconds)
    try:
        atomic_write_text(path, strict_json.dumps({"key": key, "tokens_per_s": rate, "measured_at": time.time()}))
    except OSError as e:  # a read-only or full disk: the next start measures again
        log.warning("could not record the measured throughput in %s: %s", path, e)
    return rate
