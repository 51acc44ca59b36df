"""The averaging contract every module group follows, and an in-process implementation of it.

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

:func:`reduce_encoded` is that rule for one part; :class:`LocalAverager` applies it to whole
modules between threads of one process (tests, single-process runs); the networked averager over
hivemind's P2P (``peer.allreduce``) applies it per block-aligned part.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Optional, Protocol, Sequence

import torch
from torch import Tensor

from peer.compression import Codec, flatten, get_codec, unflatten

__all__ = [
    "AGGREGATORS",
    "Aggregation",
    "MEAN",
    "Reduced",
    "SuspectHook",
    "aggregate",
    "reduce_part",
    "AverageResult",
    "ModuleAverager",
    "weighted_mean",
    "reduce_encoded",
    "LocalAverager",
    "LocalMember",
]

logger = logging.getLogger(__name__)


@dataclass
class AverageResult:
    """What one member gets back from one module's exchange."""

    averaged: Optional[list[Tensor]]
    """Weighted mean every member applies (identical bits on all); None if the round failed."""
    own_decoded: Optional[list[Tensor]]
    """What the group received from us after the codec (for error feedback); None if not sent."""
    group_size: int
    """Members whose contributions are in ``averaged``."""
    peers: list[str]
    """Peer ids that contributed, sorted."""
    bytes_sent: int
    bytes_received: int
    reason: str = ""
    """Why the round failed, or who was dropped from it."""
    suspects: dict[str, str] = field(default_factory=dict)
    """Peer id -> why its contribution was dropped or clipped, in the parts this peer reduced."""
    adopt: str = ""
    """Set when the round failed because other holders at this round hold a different state (a fork)
    and theirs is the one kept: the :func:`peer.outer.state_digest` to re-sync to."""

    @property
    def ok(self) -> bool:
        return self.averaged is not None


class ModuleAverager(Protocol):
    """Averages one module's pseudo-gradient with the other holders of that module.

    :class:`peer.diloco.DiLoCoOptimizer` calls :meth:`average` for all its modules at once, from
    several threads (one exchange per module), so implementations must be thread-safe across
    modules: a slow or missing member of one module's group must not delay another module's round.
    """

    def average(
        self, module_id: str, round_no: int, tensors: list[Tensor], weight: float, codec: str, timeout: float,
        digest: str = "",
    ) -> AverageResult:
        """Contribute ``tensors`` with ``weight`` to round ``round_no`` of ``module_id``'s group and
        return the group's weighted mean, or a failed result after at most ``timeout`` seconds.
        ``digest`` (:func:`peer.outer.state_digest` of the state the mean will be applied to): only
        members holding the same state may average together."""
        ...


def weighted_mean(values: Sequence[Tensor], weights: Sequence[float]) -> Tensor:
    """``sum_k w_k v_k / sum_k w_k`` in fp32, summed in the order given (callers sort by peer id).

    Each product and sum is one IEEE rounding, so every machine computes the same bits.
    """
    if not values or len(values) != len(weights):
        raise ValueError(f"need as many weights as values, got {len(values)} values and {len(weights)} weights")
    total = math.fsum(float(w) for w in weights)
    if not total > 0:
        raise ValueError(f"total weight must be > 0, got {total}")
    acc = torch.zeros_like(values[0], dtype=torch.float32)  # (n,)
    for v, w in zip(values, weights):
        acc.add_(v.to(torch.float32) * torch.tensor(float(w), dtype=torch.float32))  # fp32 product, then sum
    return acc / torch.tensor(total, dtype=torch.float32)


AGGREGATORS = ("mean", "trimmed_mean", "centered_clip")

SuspectHook = Callable[[str, str, int, str], None]
"""``on_suspect(peer_id, module_id, round_no, why)``: called once per (peer, module, round) whose
contribution a reducer here dropped or clipped, e.g. to report the peer to the coordinator."""


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
"""trimmed_mean reports a member trimmed at more than this fraction of the coordinates."""
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
        if bool(torch.isfinite(value).all()):
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
    trimmed = []
    for v, w in zip(values, weights):
        is_lo = (v == lo_val) & ~lo_taken  # (n,)
        lo_taken |= is_lo
        is_hi = (v == hi_val) & ~hi_taken & ~is_lo  # (n,)
        hi_taken |= is_hi
        keep = ~(is_lo | is_hi)  # (n,)
        wk = torch.tensor(w, dtype=torch.float32)
        num += torch.where(keep, v * wk, torch.zeros(()))
        den += torch.where(keep, wk, torch.zeros(()))
        trimmed.append(1.0 - float(keep.sum()) / max(1, v.numel()))
    value = num / den  # (n,)
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
    return codec.encode(reduced.value), reduced


def reduce_encoded(codec: Codec, contributions: Mapping[str, tuple[bytes, float]], numel: int,
                   rule: Aggregation = MEAN) -> bytes:
    """:func:`reduce_part`'s encoded aggregate alone (with ``MEAN``: the weighted mean)."""
    return reduce_part(codec, contributions, numel, rule)[0]


@dataclass
class _Contribution:
    encoded: bytes
    numel: int
    weight: float


@dataclass
class _Round:
    codec: str
    numel: int
    contributions: dict[str, _Contribution] = field(default_factory=dict)
    closed: bool = False
    result_bytes: Optional[bytes] = None
    members: list[str] = field(default_factory=list)
    reason: str = ""
    pending_pickups: set[str] = field(default_factory=set)
    suspects: dict[str, str] = field(default_factory=dict)


class LocalAverager:
    """An in-process, thread-safe module averager: members are threads of one process.

    Each member registers with :meth:`member` (its peer id and the modules it holds) and gets a
    :class:`ModuleAverager`. Round ``(module_id, round_no)`` closes when every registered holder of
    the module has contributed, or when the deadline of the first contribution (its ``timeout``)
    passes: absent members are dropped and the rest finish. A member that arrives after its round
    closed gets a failed result and keeps its local progress. The reduction follows the module
    docstring exactly, with one reducer for the whole module (byte counts: our encoded delta up, the
    encoded average down); the weights of every closed round are kept for inspection
    (:meth:`round_weights`).
    """

    def __init__(self, aggregation: Aggregation = MEAN, on_suspect: Optional[SuspectHook] = None) -> None:
        self.aggregation = aggregation
        self.on_suspect = on_suspect
        self._rule_fixed = False
        self._cond = threading.Condition()
        self._holders: dict[str, Optional[frozenset[str]]] = {}
        self._rounds: dict[tuple[str, int], _Round] = {}
        self._weights: dict[tuple[str, int], dict[str, float]] = {}

    def member(self, peer_id: str, module_ids: Optional[Iterable[str]] = None) -> "LocalMember":
        """Register ``peer_id`` as a holder of ``module_ids`` (None: of every module)."""
        with self._cond:
            if peer_id in self._holders:
                raise ValueError(f"peer id '{peer_id}' is already a member")
            self._holders[peer_id] = None if module_ids is None else frozenset(module_ids)
        return LocalMember(self, peer_id)

    def leave(self, peer_id: str) -> None:
        """Stop expecting ``peer_id`` in future rounds (open rounds may close sooner)."""
        with self._cond:
            self._holders.pop(peer_id, None)
            for key, rnd in list(self._rounds.items()):
                if not rnd.closed and self._expected(key[0]) <= set(rnd.contributions):
                    self._close(key, rnd)
            self._cond.notify_all()

    def round_weights(self, module_id: str, round_no: int) -> dict[str, float]:
        """Weights by peer id of a closed round (empty if it never closed)."""
        with self._cond:
            return dict(self._weights.get((module_id, round_no), {}))

    def _expected(self, module_id: str) -> set[str]:
        return {pid for pid, mods in self._holders.items() if mods is None or module_id in mods}

    def _close(self, key: tuple[str, int], rnd: _Round) -> None:
        """Reduce the contributions present (called with the lock held)."""
        rnd.closed = True
        absent = sorted(self._expected(key[0]) - set(rnd.contributions))
        codec = get_codec(rnd.codec)
        # the size most contributors agree on (ties: the smallest peer id's) is the module's size
        sizes = [rnd.contributions[pid].numel for pid in sorted(rnd.contributions)]
        rnd.numel = max(sizes, key=lambda n: (sizes.count(n), -sizes.index(n)))
        good = {pid: c for pid, c in rnd.contributions.items() if c.numel == rnd.numel}
        bad = sorted(set(rnd.contributions) - set(good))
        notes = []
        if absent:
            notes.append(f"dropped absent {', '.join(absent)}")
        if bad:
            notes.append(f"dropped wrong-size {', '.join(bad)}")
        try:
            rnd.result_bytes, reduced = reduce_part(
                codec, {p: (c.encoded, c.weight) for p, c in good.items()}, rnd.numel, self.aggregation)
            rnd.members = reduced.used
            rnd.suspects = reduced.suspects
            if reduced.suspects:
                notes.append("; ".join(f"{p}: {why}" for p, why in sorted(reduced.suspects.items())))
                if self.on_suspect is not None:
                    for p, why in sorted(reduced.suspects.items()):
                        self.on_suspect(p, key[0], key[1], why)
        except ValueError as e:
            rnd.result_bytes = None
            notes.append(f"reduction failed: {e}")
        rnd.reason = "; ".join(notes)
        rnd.pending_pickups = set(rnd.contributions)
        for c in rnd.contributions.values():
            c.encoded = b""
        self._weights[key] = {pid: good[pid].weight for pid in rnd.members}
        if notes:
            logger.info("round %s of %s closed: %s", key[1], key[0], rnd.reason)

    def _average(
        self, peer_id: str, module_id: str, round_no: int, tensors: list[Tensor], weight: float, codec: str,
        timeout: float,
    ) -> AverageResult:
        if not (math.isfinite(weight) and weight > 0):
            raise ValueError(f"weight must be a finite number > 0, got {weight}")
        c = get_codec(codec)
        flat = flatten(tensors)  # (n,)
        try:
            encoded = c.encode(flat)
        except ValueError as e:
            return AverageResult(None, None, 0, [], 0, 0, reason=f"not sent: {e}")
        own = c.decode(encoded, flat.numel())
        key = (module_id, round_no)
        deadline = time.monotonic() + timeout
        with self._cond:
            rnd = self._rounds.get(key)
            too_late = f"round {round_no} of {module_id} closed before we arrived"
            if rnd is None and key in self._weights:
                return AverageResult(None, None, 0, [], 0, 0, reason=too_late)
            if rnd is None:
                rnd = self._rounds[key] = _Round(codec=codec, numel=flat.numel())
            if rnd.closed:
                return AverageResult(None, None, 0, [], 0, 0, reason=too_late)
            if rnd.codec != codec:
                return AverageResult(None, None, 0, [], 0, 0, reason=f"group uses codec {rnd.codec}, not {codec}")
            rnd.contributions[peer_id] = _Contribution(encoded, flat.numel(), float(weight))
            if self._expected(module_id) <= set(rnd.contributions):
                self._close(key, rnd)
                self._cond.notify_all()
            while not rnd.closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    self._close(key, rnd)
                    self._cond.notify_all()
                    break
                self._cond.wait(left)
            rnd.pending_pickups.discard(peer_id)
            if not rnd.pending_pickups:
                self._rounds.pop(key, None)
            result_bytes, members, reason, suspects = rnd.result_bytes, list(rnd.members), rnd.reason, dict(rnd.suspects)
        if result_bytes is None or peer_id not in members:
            return AverageResult(None, None, 0, [], len(encoded), 0, reason=reason or "dropped from the round",
                                 suspects=suspects)
        averaged = c.decode(result_bytes, rnd.numel)
        return AverageResult(
            averaged=unflatten(averaged, tensors),
            own_decoded=unflatten(own, tensors),
            group_size=len(members),
            peers=members,
            bytes_sent=len(encoded),
            bytes_received=len(result_bytes),
            reason=reason,
            suspects=suspects,
        )


class LocalMember:
    """One member's view of a :class:`LocalAverager`: a :class:`ModuleAverager`."""

    def __init__(self, hub: LocalAverager, peer_id: str):
        self.hub = hub
        self.peer_id = peer_id

    def average(
        self, module_id: str, round_no: int, tensors: list[Tensor], weight: float, codec: str, timeout: float,
        digest: str = "",
    ) -> AverageResult:
        return self.hub._average(self.peer_id, module_id, round_no, tensors, weight, codec, timeout)

    def use_aggregation(self, rule: Aggregation) -> None:
        """Adopt the run's aggregation rule (``DiLoCoOptimizer`` calls this with its ``OuterConfig``);
        every member of one hub must use the same rule."""
        with self.hub._cond:
            if rule != self.hub.aggregation and (self.hub._rule_fixed or self.hub._rounds):
                raise ValueError(f"the group aggregates with {self.hub.aggregation}, not {rule}")
            self.hub.aggregation = rule
            self.hub._rule_fixed = True
