"""A module's tensors as one flat CPU fp32 vector and back: the form codecs encode and groups average."""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

import torch
from torch import Tensor

__all__ = ["flatten", "unflatten"]


def flatten(tensors: Iterable[Tensor], out: Optional[Tensor] = None) -> Tensor:
    """Concatenate tensors, in order, into one CPU fp32 1-D vector (a copy; written into ``out``, a
    CPU fp32 vector of their total size, when given)."""
    parts = [t.detach().reshape(-1).to(device="cpu", dtype=torch.float32) for t in tensors]
    if not parts:
        return torch.zeros(0, dtype=torch.float32) if out is None else out
    return torch.cat(parts) if out is None else torch.cat(parts, out=out)


def unflatten(flat: Tensor, like: Sequence[Tensor]) -> list[Tensor]:
    """Split ``flat`` into CPU fp32 tensors shaped like ``like`` (views into ``flat``)."""
    sizes = [t.numel() for t in like]
    if flat.dim() != 1 or flat.numel() != sum(sizes):
        raise ValueError(f"cannot unflatten {tuple(flat.shape)} into tensors of {sum(sizes)} elements")
    flat = flat.to(device="cpu", dtype=torch.float32)
    return [chunk.view(t.shape) for chunk, t in zip(torch.split(flat, sizes), like)]
