"""The exchange plans a peer follows: per module, the H and codec of each of its rounds, as the
coordinator's planner decided them (``coordinator/planner.py``).

A plan says "from round r on, every holder of module m uses H and this codec". Rounds are the
module's group rounds, which every holder counts alike, so all holders switch in the same round and
a group never mixes codecs: replicas stay bit-identical through a switch. The book keeps, per
module, the plans it was told, oldest first; :meth:`PlanBook.at` answers for a round with the latest
plan that applies there, or None where none does (the assignment's H and the run's codec hold).
"""

from __future__ import annotations

import threading
from typing import Iterable, Optional, Protocol

__all__ = ["PlanBook", "Plan", "MAX_PLANS_PER_MODULE"]

MAX_PLANS_PER_MODULE = 4
"""Plans kept per module: the coordinator sends two (the latest and the one before); older ones
apply to rounds no holder can still be at."""


class Plan(Protocol):
    """A plan as the coordinator client hands it (:class:`peer.coordinator_client.ExchangePlan`)."""

    module_id: str
    inner_steps: int
    codec: str
    from_round: int
    reason: str


class PlanBook:
    """Every module's plans, updated from heartbeat replies (any thread), read by the optimizer."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._plans: dict[str, list[tuple[int, int, str, str]]] = {}  # module -> (from_round, H, codec, reason)
        self.version = 0
        """Increases whenever a plan is added: readers may cache what they derived from the book."""

    def update(self, plans: Iterable[Plan]) -> list[str]:
        """Add the plans not known yet (a plan for a round that has one replaces it); returns what
        changed, in words."""
        changed = []
        with self._lock:
            for p in plans:
                entry = (int(p.from_round), int(p.inner_steps), p.codec, p.reason)
                known = self._plans.setdefault(p.module_id, [])
                if entry[:3] in [k[:3] for k in known]:
                    continue
                known[:] = sorted([k for k in known if k[0] != entry[0]] + [entry])[-MAX_PLANS_PER_MODULE:]
                changed.append(f"module {p.module_id}: H={entry[1]}, {entry[2]} from round {entry[0]} ({p.reason})")
            if changed:
                self.version += 1
        return changed

    def at(self, module_id: str, round_no: int) -> Optional[tuple[int, str]]:
        """(H, codec) for ``module_id``'s round ``round_no``, or None where no plan applies."""
        with self._lock:
            found = None
            for from_round, h, codec, _ in self._plans.get(module_id, ()):
                if from_round <= round_no:
                    found = (h, codec)
            return found
