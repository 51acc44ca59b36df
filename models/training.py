"""The inner loop shared by ``train-local``, the simulator and peers: AdamW with warm-up (and an
optional cosine decay), clipping, autocast.

DiLoCo (Douillard et al. 2023) runs H steps of AdamW on each worker between outer steps; this module
is one worker's inner optimizer. On CUDA the forward pass runs under bf16 autocast; on CPU in fp32.
The step returns the loss as a detached tensor so the loop never forces a device sync by itself.
"""

from __future__ import annotations

import contextlib
import math
from typing import ContextManager, Iterable, Union

import torch
import torch.nn as nn

from models.config import InnerConfig

__all__ = ["pick_device", "autocast", "make_adamw", "warmup_lr", "InnerLoop"]


def pick_device(name: str = "auto") -> torch.device:
    """``auto`` -> CUDA when available, else CPU; otherwise the named device."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def autocast(device: Union[str, torch.device]) -> ContextManager:
    """bf16 autocast on CUDA; a no-op (fp32) elsewhere."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def make_adamw(params: Iterable[nn.Parameter], inner: InnerConfig) -> torch.optim.AdamW:
    """AdamW with decoupled weight decay on matrices only (norm weights are not decayed)."""
    params = [p for p in params if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": inner.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(
        [g for g in groups if g["params"]], lr=inner.lr, betas=(inner.beta1, inner.beta2), eps=1e-8
    )


def warmup_lr(inner: InnerConfig, step: int) -> float:
    """The learning rate of inner step ``step`` (0-based): linear warm-up over ``warmup_steps`` to
    ``lr``; then constant, or with ``decay_steps > 0`` a cosine decay to ``min_lr_ratio * lr`` at step
    ``decay_steps`` and that floor after it."""
    if step < inner.warmup_steps:
        return inner.lr * (step + 1) / inner.warmup_steps
    if inner.decay_steps <= 0:
        return inner.lr
    frac = min(1.0, (step - inner.warmup_steps) / (inner.decay_steps - inner.warmup_steps))
    floor = inner.min_lr_ratio
    return inner.lr * (floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * frac)))


class InnerLoop:
    """One worker's inner optimisation of ``model`` (any module returning ``(logits, loss)``).

    ``step(x, y)`` does forward (autocast), backward, gradient clipping, the AdamW step with the
    warm-up learning rate, and returns the detached loss.
    """

    def __init__(self, model: nn.Module, inner: InnerConfig, device: Union[str, torch.device] = "cpu"):
        self.model = model
        self.inner = inner
        self.device = torch.device(device)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = make_adamw(self.params, inner)
        self.steps = 0

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One inner step on a batch ``x, y`` (B, T); returns the loss (0-dim tensor, detached)."""
        lr = warmup_lr(self.inner, self.steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        with autocast(self.device):
            _, loss = self.model(x, y)
        loss.backward()
        if self.inner.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.inner.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        return loss.detach()
