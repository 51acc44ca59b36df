"""A module's replicated state (the outer optimizer's fp32 global copy and momentum) and its digest.

Members of a group compare digests before they average (fork detection); state transfer serves a
:class:`ModuleState` to newcomers; checkpoints and the archive store it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

__all__ = ["ModuleState", "state_digest"]


def state_digest(global_params: Sequence[Tensor], momentum: Sequence[Tensor]) -> str:
    """A short fingerprint (16 hex digits, BLAKE2b) of a module's replicated state: the fp32 global
    copy and outer momentum, in order, with their shapes. Members of a group compare it before they
    average, so two copies that carry the same round number but differ (a fork) never average together.
    """
    h = hashlib.blake2b(digest_size=8)
    for t in (*global_params, *momentum):
        t = t.detach().to(device="cpu", dtype=torch.float32).contiguous()
        h.update(repr(tuple(t.shape)).encode())
        h.update(t.numpy().data if t.numel() else b"")
    return h.hexdigest()


@dataclass
class ModuleState:
    """A module's replicated state, as served to a newcomer."""

    global_params: list[Tensor]
    momentum: list[Tensor]
    round_no: int
    source: str = ""
    """The peer this state was fetched from ('' for a state of our own)."""

    @property
    def digest(self) -> str:
        """:func:`state_digest` of this state."""
        return state_digest(self.global_params, self.momentum)
