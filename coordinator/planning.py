"""Planning passes: how :class:`coordinator.core.Coordinator` keeps each module's exchange plan
(:mod:`coordinator.planner` decides; this gathers its inputs, keeps the plans and hands them out).

Every ``plan_interval`` seconds (from :meth:`Coordinator.tick`) each module's live holders are read
from the cluster view with their links (their capabilities' rates: the join probe's, replaced by what
their heartbeats measured) and tokens/s, and :func:`coordinator.planner.plan_module` is asked whether
the module's plan changes. Per module the latest plan and the one before it are kept (the planner
changes a plan only once the previous one took effect, so those two say every round's H and codec a
holder can still be at); both go to every holder of the module in each heartbeat reply. Plans are
kept in the store's meta (:data:`PLANS_META_KEY`), so a restart neither forgets them nor plans anew
from nothing.

A path peer whose link alone holds one of its modules back (:func:`coordinator.planner.held_back_by`)
is moved, at most one a pass and within ``max_moves_per_tick``, to the path where it holds back fewest
others (:func:`coordinator.scheduler.relieve_link`); the status page shows the latest finding.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from typing import Callable, Optional

from coordinator.planner import HolderLink, ModulePlan, held_back_by, lattice_h, plan_module
from coordinator.records import MODE_ARCHIVE, Assignment, Move, PeerRecord
from coordinator.scheduler import relieve_link
from coordinator.settings import CoordinatorSettings
from coordinator.store import WriteBatch
from coordinator.view import ClusterView
from models import strict_json
from models.config import RunConfig

__all__ = ["Planning", "PLANS_META_KEY", "load_plans"]

log = logging.getLogger(__name__)

PLANS_META_KEY = "plans"
"""Meta key of every module's plans (JSON: module id -> its plans, oldest first)."""


def load_plans(meta: dict[str, str]) -> dict[str, list[ModulePlan]]:
    """The plans a store's meta holds (empty for a new store)."""
    return {m: [ModulePlan.from_dict(p) for p in plans]
            for m, plans in json.loads(meta.get(PLANS_META_KEY, "{}")).items()}


class Planning:
    """``plan_pass`` and ``plans_for``; owns the plans, and what the latest pass said about them.
    Not thread-safe: the coordinator holds its lock around every call.

    Given the run and the coordinator's settings, its peer table and cluster view (read), each
    module's highest round (read), the event counters, and ``apply_move``, which gives a moved peer
    its new work and returns the event in words."""

    def __init__(
        self,
        *,
        meta: dict[str, str],
        run: RunConfig,
        settings: CoordinatorSettings,
        peers: dict[str, PeerRecord],
        view: ClusterView,
        module_rounds: dict[str, int],
        counters: Counter[str],
        apply_move: Callable[[Move, float, WriteBatch], str],
    ):
        """``meta``: the store's meta table, which holds the plans of a run that restarts."""
        self._run = run
        self._settings = settings
        self._peers = peers
        self._view = view
        self._module_rounds = module_rounds
        self._counters = counters
        self._apply_move = apply_move
        self.plans: dict[str, list[ModulePlan]] = load_plans(meta)
        self.plan_reasons: dict[str, str] = {}
        """module id -> what the latest pass said about it (kept or changed, and why)."""
        self._planned_at = float("-inf")
        self.link_reason = "not run yet"
        """What the latest pass found about links that alone hold a module back, and did."""

    def _holder_links(self) -> dict[str, list[HolderLink]]:
        """module id -> its live holders' links (under the lock)."""
        out: dict[str, list[HolderLink]] = {}
        for peer_id, a in self._view.assignments.items():
            if a.mode == MODE_ARCHIVE or not a.module_ids:
                continue
            peer = self._peers[peer_id]
            caps = peer.capabilities
            link = HolderLink(peer_id, caps.upload_bps, caps.download_bps,
                              peer.counted_tokens_per_s() or caps.tokens_per_s, len(a.module_ids), peer.follows_plans,
                              peer.exchange_overhead_s)
            for m in a.module_ids:
                out.setdefault(m, []).append(link)
        return out

    def plan_pass(self, now: float, batch: WriteBatch, may_move: bool = True) -> list[str]:
        """One planning pass when ``plan_interval`` has passed since the last (under the lock);
        returns the changes, in words, and adds the plans to ``batch`` when any changed. With
        ``may_move``, one path peer whose link alone holds a module back may be moved
        (:func:`coordinator.scheduler.relieve_link`)."""
        if not self._settings.planner or now - self._planned_at < self._settings.plan_interval:
            return []
        self._planned_at = now
        lattice = self._run.lattice
        links = self._holder_links()
        events = []
        laggards: dict[str, str] = {}
        wanted = {}  # module -> the H its own plan would have
        for m in lattice.module_ids():
            history = self.plans.get(m, [])
            current = history[-1] if history else None
            plan, _ = plan_module(now, m, lattice.module_param_count(m), links.get(m, []), current,
                                  self._module_rounds.get(m, 0), self._run, self._settings)
            wanted[m] = (plan or current).inner_steps if (plan or current) else self._run.outer.inner_steps
        h_floor = lattice_h(wanted)
        for m in lattice.module_ids():
            slow = held_back_by(lattice.module_param_count(m), links.get(m, []), self._run, self._settings)
            if slow is not None:
                laggards.setdefault(slow.peer_id, f"{m} at the run's H and codec")
            history = self.plans.get(m, [])
            plan, why = plan_module(now, m, lattice.module_param_count(m), links.get(m, []),
                                    history[-1] if history else None, self._module_rounds.get(m, 0), self._run,
                                    self._settings, h_floor=h_floor)
            self.plan_reasons[m] = why
            if plan is not None:
                self.plans[m] = [*history[-1:], plan]
                self._counters["plan_changes"] += 1
                events.append(f"module {m}: {plan.label} from round {plan.from_round}: {why}")
        self.link_reason = "no holder's link alone holds a module back"
        for peer_id in sorted(laggards) if may_move else ():
            peer = self._peers[peer_id]
            move, self.link_reason = relieve_link(now, peer_id, laggards[peer_id], {peer_id: peer.last_moved},
                                                  {peer_id: peer.capabilities}, self._view, self._run, self._settings)
            if move is not None:
                events.append(self._apply_move(move, now, batch))
                break
        if any(e.startswith("module ") for e in events):
            batch.meta[PLANS_META_KEY] = strict_json.dumps(
                {m: [p.to_dict() for p in plans] for m, plans in sorted(self.plans.items())}, sort_keys=True)
        return events

    def plans_for(self, assignment: Optional[Assignment]) -> tuple[ModulePlan, ...]:
        """The plans of the modules ``assignment`` trains, oldest first per module (under the lock)."""
        if assignment is None or not self._settings.planner:
            return ()
        return tuple(p for m in assignment.module_ids for p in self.plans.get(m, ()))
