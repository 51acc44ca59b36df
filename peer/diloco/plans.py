"""The exchange plans a peer follows: per module, the H and codec of each of its rounds, as the
coordinator's planner decided them (``coordinator/planner.py``).

A plan says "from round r on, every holder of module m uses H and this codec". Rounds are the
module's group rounds, which every holder counts alike, so all holders switch in the same round and
a group never mixes codecs: replicas stay bit-identical through a switch. The book keeps, per
module, the plans it was told, oldest first; :meth:`PlanBook.at` answers for a round with the latest
plan that applies there, or None where none does (the assignment's H and the run's codec hold).

A plan may also say that the module's exchanges run behind the next round (:meth:`PlanBook.overlap_at`):
a path peer then trains on while they run. That is each member's own affair (a group's mean and
every replica are the same whether a member waited for it or not), so a peer that does not follow
it, or follows it a round late, changes nothing for the others.
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
    overlap: bool


class PlanBook:
    """Every module's plans, updated from heartbeat replies (any thread), read by the optimizer."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # module -> (from_round, H, codec, overlap, reason), oldest first
        self._plans: dict[str, list[tuple[int, int, str, bool, str]]] = {}
        self.version = 0
        """Increases whenever a plan is added: readers may cache what they derived from the book."""

    def update(self, plans: Iterable[Plan]) -> list[str]:
        """Add the plans not known yet (a plan for a round that has one replaces it); returns what
        changed, in words."""
        changed = []
        with self._lock:
            for p in plans:
                entry = (int(p.from_round), int(p.inner_steps), p.codec, bool(p.overlap), p.reason)
                known = self._plans.setdefault(p.module_id, [])
                if entry[:4] in [k[:4] for k in known]:
                    continue
                known[:] = sorted([k for k in known if k[0] != entry[0]] + [entry])[-MAX_PLANS_PER_MODULE:]
                behind = ", behind the next round" if entry[3] else ""
                changed.append(f"module {p.module_id}: H={entry[1]}, {entry[2]}{behind} from round {entry[0]} "
                               f"({p.reason})")
            if changed:
                self.version += 1
        return changed

    def _latest(self, module_id: str, round_no: int) -> Optional[tuple[int, int, str, bool, str]]:
        """The latest plan of ``module_id`` that applies to round ``round_no`` (None: none does)."""
        with self._lock:
            return next((e for e in reversed(self._plans.get(module_id, ())) if e[0] <= round_no), None)

    def at(self, module_id: str, round_no: int) -> Optional[tuple[int, str]]:
        """(H, codec) for ``module_id``'s round ``round_no``, or None where no plan applies."""
        found = self._latest(module_id, round_no)
        return None if found is None else (found[1], found[2])

    def overlap_at(self, module_id: str, round_no: int) -> bool:
        """Whether ``module_id``'s plan for round ``round_no`` runs its exchange behind the next round."""
        found = self._latest(module_id, round_no)
        return found is not None and found[3]
