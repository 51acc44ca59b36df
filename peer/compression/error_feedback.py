"""Local error feedback on a module's flat pseudo-gradient (what the codec drops is sent next round)."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["ErrorFeedback"]


class ErrorFeedback:
    """Local error feedback (Seide et al. 2014; Karimireddy et al. 2019): what the codec dropped from
    this round's delta is added to the next round's, so the sum of what was sent tracks the sum of
    the true deltas to within one round's quantisation error.

    Usage per round: ``x = ef.add(delta)``; send ``x``; ``ef.update(x, sent)`` with ``sent`` what the
    group actually received (the codec round trip of ``x``). If nothing was sent, skip ``update``.
    """

    def __init__(self, numel: int, decay: float = 1.0):
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"error feedback decay must be in (0, 1], got {decay}")
        self.residual = torch.zeros(numel, dtype=torch.float32)  # (numel,)
        self.decay = float(decay)
        """The residual is scaled by this before it is added (SparseLoCo's beta; 1: plain error feedback)."""

    def add(self, flat: Tensor) -> Tensor:
        """``flat + decay * residual`` as a new CPU fp32 vector."""
        if flat.shape != self.residual.shape:
            raise ValueError(f"delta of shape {tuple(flat.shape)} does not fit residual {tuple(self.residual.shape)}")
        residual = self.residual if self.decay == 1.0 else self.residual * self.decay
        return flat.to(device="cpu", dtype=torch.float32) + residual

    def update(self, sent_input: Tensor, sent: Tensor) -> None:
        """Keep ``sent_input - sent``: the part of the last exchanged vector the codec dropped."""
        a, b = sent_input.to(torch.float32).reshape(-1), sent.to(torch.float32).reshape(-1)
        if a.shape == self.residual.shape and b.shape == a.shape and a.device == self.residual.device:
            torch.sub(a, b, out=self.residual)  # in place: no fresh vector of the module's size a round
        else:
            self.residual = a - b

    def reset(self) -> None:
        self.residual.zero_()

    def state_dict(self) -> dict[str, Tensor]:
        return {"residual": self.residual.clone()}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        residual = state["residual"].to(device="cpu", dtype=torch.float32).reshape(-1)
        if residual.shape != self.residual.shape:
            raise ValueError(f"residual of {residual.numel()} elements does not fit {self.residual.numel()}")
        self.residual = residual.clone()
