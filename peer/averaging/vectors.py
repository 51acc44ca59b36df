"""A module's tensors as one flat CPU fp32 vector and back: the form codecs encode and groups average."""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

import torch
from torch import Tensor

__all__ = ["flatten", "flat_view", "unflatten"]


def flatten(tensors: Iterable[Tensor], out: Optional[Tensor] = None) -> Tensor:
    """Concatenate tensors, in order, into one CPU fp32 1-D vector (a copy; written into ``out``, a
    CPU fp32 vector of their total size, when given)."""
    parts = [t.detach().reshape(-1).to(device="cpu", dtype=torch.float32) for t in tensors]
    if not parts:
        return torch.zeros(0, dtype=torch.float32) if out is None else out
    return torch.cat(parts) if out is None else torch.cat(parts, out=out)


def flat_view(tensors: Sequence[Tensor]) -> Tensor:
    """The CPU fp32 1-D vector ``tensors`` are consecutive views of (as :func:`unflatten` makes them),
    without a copy; :func:`flatten`'s copy of them otherwise."""
    if tensors and all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() for t in tensors):
        first, at = tensors[0], tensors[0].storage_offset()
        ptr = first.untyped_storage().data_ptr()
        for t in tensors:
            if t.untyped_storage().data_ptr() != ptr or t.storage_offset() != at:
                break
            at += t.numel()
        else:
            return first.as_strided((at - first.storage_offset(),), (1,))
    return flatten(tensors)


def unflatten(flat: Tensor, like: Sequence[Tensor]) -> list[Tensor]:
    """Split ``flat`` into CPU fp32 tensors shaped like ``like`` (views into ``flat``)."""
    sizes = [t.numel() for t in like]
    if flat.dim() != 1 or flat.numel() != sum(sizes):
        raise ValueError(f"cannot unflatten {tuple(flat.shape)} into tensors of {sum(sizes)} elements")
    flat = flat.to(device="cpu", dtype=torch.float32)
    return [chunk.view(t.shape) for chunk, t in zip(torch.split(flat, sizes), like)]
