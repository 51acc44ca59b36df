"""The weighted mean of a group's decoded contributions, the same bits on every machine.

A reducer's mean rule (:mod:`peer.averaging.aggregation`) and the sparse codec's gathered average
(:mod:`peer.compression.sparse`, which every member computes from the same bytes) are this one function.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import Tensor

__all__ = ["weighted_mean"]


def weighted_mean(values: Sequence[Tensor], weights: Sequence[float]) -> Tensor:
    """``sum_k w_k v_k / sum_k w_k`` in fp32, summed in the order given (callers sort by peer id).

    Each product and sum is one IEEE rounding, so every machine computes the same bits.
    """
    if not values or len(values) != len(weights):
        raise ValueError(f"need as many weights as values, got {len(values)} values and {len(weights)} weights")
    total = math.fsum(float(w) for w in weights)
    if not total > 0:
        raise ValueError(f"total weight must be > 0, got {total}")
    # the bits of ``0 + v_1 w_1 + ... + v_k w_k``, then one division, in one accumulator and one
    # scratch vector: the first product lands in the accumulator (``0 + v w``, an addcmul: +0.0 where
    # the product is -0.0, as the sum from zeros gives), each later one in the scratch and is added
    acc = torch.empty_like(values[0], dtype=torch.float32)  # (n,)
    scratch = torch.empty_like(acc) if len(values) > 1 else None  # (n,)
    for k, (v, w) in enumerate(zip(values, weights)):
        weight = torch.tensor(float(w), dtype=torch.float32)
        if k == 0:
            torch.addcmul(_ZERO, v.to(torch.float32), weight, out=acc)
        else:
            acc.add_(torch.mul(v.to(torch.float32), weight, out=scratch))  # fp32 product, then sum
    return acc.div_(torch.tensor(total, dtype=torch.float32))


_ZERO = torch.zeros(())
"""+0.0, the start of :func:`weighted_mean`'s sum."""
