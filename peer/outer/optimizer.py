"""The DiLoCo outer optimizer of one module: Nesterov SGD on a CPU fp32 global copy.

DiLoCo (Douillard et al. 2023, "DiLoCo: Distributed Low-Communication Training of Language Models")
treats ``delta = global - local`` after H inner steps as a gradient of the global copy and applies
SGD with Nesterov momentum (lr 0.7, momentum 0.9). Every member of a module's group applies the same
averaged delta to the same global copy, so the copies stay bit-identical without a parameter server.
For that, all arithmetic here is element-wise fp32 on the CPU, one rounding per operation (no fused
``alpha=`` forms, whose vectorised kernels may use FMA on some CPUs and not on others).
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import torch
from torch import Tensor

from peer.outer.state import state_digest

__all__ = ["OuterOptimizer"]

logger = logging.getLogger(__name__)


class OuterOptimizer:
    """Nesterov SGD on a snapshot of ``params`` (DiLoCo's outer step).

    ``buf = m * buf + d``; then ``global -= lr * (d + m * buf)`` with Nesterov, else ``lr * buf``.
    The global copy and the momentum live on the CPU in fp32 whatever the params' device and dtype.
    """

    def __init__(self, params: Sequence[Tensor], lr: float = 0.7, momentum: float = 0.9, nesterov: bool = True):
        if lr <= 0:
            raise ValueError(f"outer lr must be > 0, got {lr}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"outer momentum must be in [0, 1), got {momentum}")
        self.lr = float(lr)
        self.momentum = float(momentum)
        self.nesterov = bool(nesterov)
        self.global_params: list[Tensor] = [p.detach().to(device="cpu", dtype=torch.float32).clone() for p in params]
        self.momentum_buffers: list[Tensor] = [torch.zeros_like(g) for g in self.global_params]

    @property
    def numel(self) -> int:
        return sum(g.numel() for g in self.global_params)

    def _check(self, tensors: Sequence[Tensor], what: str) -> None:
        if len(tensors) != len(self.global_params):
            raise ValueError(f"{what}: expected {len(self.global_params)} tensors, got {len(tensors)}")
        for i, (t, g) in enumerate(zip(tensors, self.global_params)):
            if t.shape != g.shape:
                raise ValueError(f"{what}: tensor {i} has shape {tuple(t.shape)}, expected {tuple(g.shape)}")

    @torch.no_grad()
    def digest(self) -> str:
        """:func:`state_digest` of this module's global copy and momentum."""
        return state_digest(self.global_params, self.momentum_buffers)

    def pseudo_gradient(self, params: Sequence[Tensor]) -> list[Tensor]:
        """``global - local`` for each parameter, as new CPU fp32 tensors."""
        self._check(params, "pseudo_gradient")
        return [g - p.detach().to(device="cpu", dtype=torch.float32) for g, p in zip(self.global_params, params)]

    @torch.no_grad()
    def step(self, averaged_delta: Sequence[Tensor]) -> None:
        """Apply one outer step with ``averaged_delta`` as the gradient of the global copy."""
        self._check(averaged_delta, "step")
        for g, buf, d in zip(self.global_params, self.momentum_buffers, averaged_delta):
            d = d.to(device="cpu", dtype=torch.float32)
            buf.mul_(self.momentum).add_(d)
            update = d + buf * self.momentum if self.nesterov else buf
            g.sub_(update * self.lr)

    @torch.no_grad()
    def sync_to(self, params: Sequence[Tensor]) -> None:
        """Copy the global copy into ``params`` in place (any device and dtype)."""
        self._check(params, "sync_to")
        for p, g in zip(params, self.global_params):
            p.data.copy_(g)

    def state_dict(self) -> dict[str, Any]:
        """Global copy and momentum (clones), plus the hyper-parameters for reference."""
        return {
            "global": [g.clone() for g in self.global_params],
            "momentum": [b.clone() for b in self.momentum_buffers],
            "lr": self.lr,
            "momentum_coef": self.momentum,
            "nesterov": self.nesterov,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the global copy and momentum (shapes must match; hyper-parameters stay as built)."""
        global_params = [t.detach().to(device="cpu", dtype=torch.float32) for t in state["global"]]
        momentum = [t.detach().to(device="cpu", dtype=torch.float32) for t in state["momentum"]]
        self._check(global_params, "load_state_dict(global)")
        self._check(momentum, "load_state_dict(momentum)")
        self.global_params = [t.clone() for t in global_params]
        self.momentum_buffers = [t.clone() for t in momentum]
