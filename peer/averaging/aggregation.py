"""The reduction rule of every module group: a weighted mean, optionally robust, bit-identical on every member.

The reduction rule makes replicas bit-identical whatever the codec (hivemind's stock all-reduce
does not: each peer adds a separately decompressed delta to its own copy). For each module and
round, members flatten their pseudo-gradients and encode them with the codec; the reducer of a part
decodes every contribution, sums them weighted in fp32 in a fixed order (sorted by peer id), divides
by the total weight, encodes the average ONCE, and sends those same bytes to every member; every
member, the reducer included, decodes those bytes and applies the result. A lone member's average is
the codec round trip of its own delta. Weights are tokens processed in the round (DiLoCo,
Douillard et al. 2023; time-bounded rounds give a slow peer a smaller weight).

The mean itself can be made robust to hostile members (:class:`Aggregation`, from the run's
``OuterConfig.aggregator`` and ``norm_bound``, so every member of a hash-checked group uses the same
rule): contributions holding NaN/Inf are dropped; with a norm bound, a contribution longer than
``norm_bound`` times the group's median norm is scaled down to it; ``trimmed_mean`` drops, per
coordinate, the largest and the smallest value (groups of 4 or more); ``centered_clip`` is
Karimireddy et al. 2021's centered clipping around the coordinate-wise median. Each rule runs on
what one reducer holds (one part, as in BTARD, Gorbunov et al. 2021); since the reducer computes it
once and every member applies its bytes, any deterministic rule keeps replicas bit-identical. Who
was dropped or clipped is reported (``AverageResult.suspects``) so that a peer caught repeatedly
can be reported to the coordinator.

:func:`reduce_encoded` is that rule for one part; :class:`peer.averaging.LocalAverager` applies it to
whole modules between threads of one process (tests, single-process runs); the networked averager over
hivemind's P2P (``peer.averaging.allreduce``) applies it per block-aligned part.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

import torch
from torch import Tensor

from models.config import AGGREGATORS
from peer.compression import Codec, weighted_mean

__all__ = ["AGGREGATORS", "Aggregation", "MEAN", "Reduced", "aggregate", "encode_aggregate", "reduce_part",
           "reduce_encoded"]


@dataclass(frozen=True)
class Aggregation:
    """How a group's contributions are combined: the same on every member (it is in the run config).

    ``rule``: ``mean`` (weighted mean), ``trimmed_mean`` (coordinate-wise, the largest and the
    smallest value dropped when there are 4 or more members) or ``centered_clip`` (Karimireddy et
    al. 2021, "Learning from History for Byzantine Robust Optimization": ``clip_iters`` steps of
    ``v += sum_k w_k clip_tau(x_k - v) / sum_k w_k`` from the coordinate-wise median, ``tau`` the
    median distance of the members to it). ``norm_bound`` > 0: a contribution longer than that many
    times the median norm is scaled down to it first (groups of 2 or more).
    """

    rule: str = "mean"
    norm_bound: float = 0.0
    clip_iters: int = 3

    def __post_init__(self) -> None:
        if self.rule not in AGGREGATORS:
            raise ValueError(f"aggregator '{self.rule}' is not one of {', '.join(AGGREGATORS)}")
        if not (math.isfinite(self.norm_bound) and self.norm_bound >= 0):
            raise ValueError(f"norm_bound must be a finite number >= 0, got {self.norm_bound}")
        if self.clip_iters < 1:
            raise ValueError(f"clip_iters must be >= 1, got {self.clip_iters}")

    @classmethod
    def from_config(cls, outer: "object") -> "Aggregation":
        """The rule of a run: ``OuterConfig.aggregator`` and ``OuterConfig.norm_bound``."""
        return cls(getattr(outer, "aggregator", "mean"), float(getattr(outer, "norm_bound", 0.0)))


MEAN = Aggregation()
"""The plain weighted mean (no robustness: the default)."""

TRIM_REPORT = 0.9
"""trimmed_mean reports a member trimmed at more than this fraction of the coordinates where members disagree."""
CLIP_REPORT = 0.5
"""centered_clip reports a member whose weight clipping cut below this fraction."""


@dataclass
class Reduced:
    """One part's aggregate and who shaped it."""

    value: Tensor
    """(n,) fp32 aggregate."""
    used: list[str]
    """Peer ids whose contributions are in ``value``, sorted (NaN/Inf contributions are not)."""
    suspects: dict[str, str] = field(default_factory=dict)
    """Peer id -> why it was dropped or clipped."""


def _lower_median(xs: Sequence[float]) -> float:
    return sorted(xs)[(len(xs) - 1) // 2]


def aggregate(contributions: Mapping[str, tuple[Tensor, float]], rule: Aggregation = MEAN) -> Reduced:
    """Combine ``peer_id -> (values (n,), weight)`` with ``rule``, in sorted peer-id order.

    Deterministic for given inputs (the reducer computes it once and every member applies the
    encoded result). With ``MEAN`` this is exactly :func:`weighted_mean`. Raises ValueError when no
    finite contribution is left or the weights are bad.
    """
    if rule.rule == "mean" and rule.norm_bound <= 0 and contributions:
        # NaN and Inf propagate into a mean: check the one result, not every contribution (the
        # reducer's hot path); only a non-finite result needs the per-contribution pass below
        order = sorted(contributions)
        value = weighted_mean([contributions[pid][0] for pid in order], [contributions[pid][1] for pid in order])
        # a NaN or Inf anywhere makes the sum one (one read, no mask); a sum that only overflows
        # takes the per-contribution pass below, which finds nothing to drop
        if math.isfinite(float(value.sum())):
            return Reduced(value, order, {})
    suspects: dict[str, str] = {}
    order = []
    for pid in sorted(contributions):
        if bool(torch.isfinite(contributions[pid][0]).all()):
            order.append(pid)
        else:
            suspects[pid] = "dropped: values hold NaN or Inf"
    if not order:
        raise ValueError("no finite contribution to aggregate")
    values = [contributions[pid][0].to(torch.float32) for pid in order]  # k x (n,)
    weights = [float(contributions[pid][1]) for pid in order]
    if rule.norm_bound > 0 and len(values) >= 2:
        norms = [float(torch.linalg.vector_norm(v)) for v in values]
        median = _lower_median(norms)
        bound = rule.norm_bound * median
        for i, (pid, norm) in enumerate(zip(order, norms)):
            if norm > bound:
                values[i] = values[i] * torch.tensor(bound / norm, dtype=torch.float32)
                suspects[pid] = f"clipped: norm {norm:.3g} > {rule.norm_bound:g} x median {median:.3g}"
    if rule.rule == "trimmed_mean" and len(values) >= 4:
        value = _trimmed_mean(order, values, weights, suspects)
    elif rule.rule == "centered_clip" and len(values) >= 2:
        value = _centered_clip(order, values, weights, rule.clip_iters, suspects)
    else:
        value = weighted_mean(values, weights)
    return Reduced(value, order, suspects)


def _trimmed_mean(order: list[str], values: list[Tensor], weights: list[float], suspects: dict[str, str]) -> Tensor:
    """Coordinate-wise weighted mean without each coordinate's largest and smallest value."""
    if not math.fsum(weights) > 0 or not all(math.isfinite(w) and w > 0 for w in weights):
        raise ValueError(f"weights must be finite numbers > 0, got {weights}")
    lo_val, hi_val = values[0].clone(), values[0].clone()  # (n,) each
    for v in values[1:]:
        torch.minimum(lo_val, v, out=lo_val)
        torch.maximum(hi_val, v, out=hi_val)
    # row by row (contiguous, elementwise): the first row holding the minimum and the first other row
    # holding the maximum are left out; masked rather than subtracted, so a huge value cancels nothing
    lo_taken = torch.zeros_like(lo_val, dtype=torch.bool)  # (n,)
    hi_taken = torch.zeros_like(lo_val, dtype=torch.bool)  # (n,)
    num, den = torch.zeros_like(lo_val), torch.zeros_like(lo_val)  # (n,) each
    trims = []
    for v, w in zip(values, weights):
        is_lo = (v == lo_val) & ~lo_taken  # (n,)
        lo_taken |= is_lo
        is_hi = (v == hi_val) & ~hi_taken & ~is_lo  # (n,)
        hi_taken |= is_hi
        keep = ~(is_lo | is_hi)  # (n,)
        wk = torch.tensor(w, dtype=torch.float32)
        num += torch.where(keep, v * wk, torch.zeros(()))
        den += torch.where(keep, wk, torch.zeros(()))
        trims.append(~keep)
    value = num / den  # (n,)
    # a member counts as trimmed only where its value was the one lowest or highest: ties (rows no
    # member's data touched, changed alike by weight decay) go to the first row, which would otherwise
    # be reported every round; the share is of the coordinates where the members disagree at all
    n_lo = sum((v == lo_val).to(torch.int32) for v in values)  # (n,)
    n_hi = sum((v == hi_val).to(torch.int32) for v in values)  # (n,)
    unique_lo, unique_hi = n_lo == 1, n_hi == 1  # (n,) each: the extreme is one member's alone
    contested = max(1, int((lo_val != hi_val).sum()))
    trimmed = [float((t & (((v == lo_val) & unique_lo) | ((v == hi_val) & unique_hi))).sum()) / contested
               for t, v in zip(trims, values)]
    for i, pid in enumerate(order):
        if trimmed[i] > TRIM_REPORT and pid not in suspects:
            suspects[pid] = f"trimmed at {trimmed[i]:.0%} of coordinates"
    return value


def _centered_clip(order: list[str], values: list[Tensor], weights: list[float], iters: int,
                   suspects: dict[str, str]) -> Tensor:
    """Centered clipping (Karimireddy et al. 2021) from the coordinate-wise median, weighted."""
    total = math.fsum(weights)
    if not total > 0 or not all(math.isfinite(w) and w > 0 for w in weights):
        raise ValueError(f"weights must be finite numbers > 0, got {weights}")
    stacked = torch.stack(values)  # (k, n)
    w = torch.tensor(weights, dtype=torch.float32)  # (k,)
    v = stacked.median(dim=0).values  # (n,) lower median: deterministic
    tau = _lower_median([float(d) for d in torch.linalg.vector_norm(stacked - v, dim=1)])
    scale = torch.ones_like(w)  # (k,)
    for _ in range(iters):
        diffs = stacked - v  # (k, n)
        dist = torch.linalg.vector_norm(diffs, dim=1)  # (k,)
        scale = torch.where(dist > tau, tau / dist.clamp_min(1e-30), torch.ones_like(dist))  # (k,)
        v = v + (diffs * (w * scale)[:, None]).sum(dim=0) / torch.tensor(total, dtype=torch.float32)
    for i, pid in enumerate(order):
        if float(scale[i]) < CLIP_REPORT and pid not in suspects:
            suspects[pid] = f"centered clip kept {float(scale[i]):.2g} of its distance to the aggregate"
    return v


def encode_aggregate(codec: Codec, reduced: Reduced, contributions: Mapping[str, tuple[Tensor, float]],
                     rule: Aggregation = MEAN, out: Optional[Tensor] = None) -> bytes:
    """The bytes a reducer answers every member with: ``codec.encode_average`` of the aggregate,
    told whether it is the plain weighted mean of the contributions it used (the sparse codec may
    then send those instead, :mod:`peer.compression.sparse`); with ``out``, what every member decodes
    from them is written there too (``codec.encode_average_into``)."""
    plain = rule.rule == "mean" and rule.norm_bound <= 0
    used = {pid: contributions[pid] for pid in reduced.used}
    if out is not None:
        return codec.encode_average_into(reduced.value, used, plain, out)
    return codec.encode_average(reduced.value, used, plain)


def reduce_part(codec: Codec, contributions: Mapping[str, tuple[bytes, float]], numel: int,
                rule: Aggregation = MEAN) -> tuple[bytes, Reduced]:
    """The reducer's job for one part: decode each ``peer_id -> (bytes, weight)``, aggregate with
    ``rule`` in sorted peer-id order, and encode the result once. Raises ValueError on malformed
    contributions or when none is usable."""
    decoded, undecodable = {}, {}
    for pid, (data, weight) in sorted(contributions.items()):
        try:
            decoded[pid] = (codec.decode(data, numel), weight)  # (numel,)
        except ValueError as e:  # malformed, or NaN/Inf inside: drop the sender, not the round
            undecodable[pid] = f"dropped: undecodable ({e})"
    if not decoded:
        raise ValueError(f"no decodable contribution: {'; '.join(undecodable.values())}")
    reduced = aggregate(decoded, rule)
    reduced.suspects.update(undecodable)
    return encode_aggregate(codec, reduced, decoded, rule), reduced


def reduce_encoded(codec: Codec, contributions: Mapping[str, tuple[bytes, float]], numel: int,
                   rule: Aggregation = MEAN) -> bytes:
    """:func:`reduce_part`'s encoded aggregate alone (with ``MEAN``: the weighted mean)."""
    return reduce_part(codec, contributions, numel, rule)[0]
