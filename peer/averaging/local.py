"""An in-process implementation of the averaging contract: members are threads of one process.

Used by tests and single-process runs; it applies the same reduction rule
(:func:`peer.averaging.aggregation.reduce_part`) as the networked averager, to whole modules.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Iterable, Optional

from torch import Tensor

from peer.averaging.aggregation import MEAN, Aggregation, reduce_part
from peer.averaging.contract import AverageResult, SuspectHook, require_codec
from peer.compression import Codec
from peer.averaging.vectors import flatten, unflatten

__all__ = ["LocalAverager", "LocalMember"]

logger = logging.getLogger(__name__)


@dataclass
class _Contribution:
    encoded: bytes
    numel: int
    weight: float


@dataclass
class _Round:
    codec: Codec
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
        codec = rnd.codec
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
        self, peer_id: str, module_id: str, round_no: int, tensors: list[Tensor], weight: float, codec: Codec,
        timeout: float,
    ) -> AverageResult:
        if not (math.isfinite(weight) and weight > 0):
            raise ValueError(f"weight must be a finite number > 0, got {weight}")
        c = require_codec(codec)
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
                rnd = self._rounds[key] = _Round(codec=c, numel=flat.numel())
            if rnd.closed:
                return AverageResult(None, None, 0, [], 0, 0, reason=too_late)
            if rnd.codec.name != c.name:
                return AverageResult(None, None, 0, [], 0, 0, reason=f"group uses codec {rnd.codec.name}, not {c.name}")
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
        averaged = c.decode_average(result_bytes, rnd.numel)
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
        self, module_id: str, round_no: int, tensors: list[Tensor], weight: float, codec: Codec, timeout: float,
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
