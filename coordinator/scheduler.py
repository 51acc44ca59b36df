"""Work assignment: pure functions of (now, state, config) that return a decision and its reason.

A peer whose memory fits a whole path trains a path (DiPaCo, Douillard et al. 2024, path mode); a
smaller one serves a single module as a pipeline stage or drives a pipeline through such stages
(SWARM, Ryabinin et al. 2023): :mod:`coordinator.pipelines` decides which.
Paths are kept covered first and then balanced by throughput (tokens/s), not by head count. A peer
on a slow link gets the work that needs least bandwidth: among equally good choices the module group
with fewer members, and a larger H so its exchange stays a small part of a round. The codec is the
run's for every peer (a module's group must share one); its exact size per module comes from
:mod:`models.codec_spec`.

Rebalancing moves one peer at a time, only when the spread of path throughput passes a threshold,
never the same peer twice within ``min_move_interval``, and only moves that strictly lower the sum of
squared path throughputs. That sum can only fall, so rebalancing converges and never oscillates.
"""

from __future__ import annotations

import itertools
import math
from typing import Callable, Iterator, Mapping, Optional, Sequence

from coordinator.links import exchange_bytes, link_overrides
from coordinator.pipelines import assign_small
from coordinator.records import MODE_PATH, Assignment, Capabilities, Move
from coordinator.settings import CoordinatorSettings
from coordinator.view import ClusterView
from models.config import RunConfig, format_path

__all__ = ["Move", "assign_peer", "rebalance", "relieve_link", "link_overrides", "path_assignment", "fits_path",
           "exchange_bytes"]

Path_ = tuple[int, ...]


def _batch_size(run: RunConfig, settings: CoordinatorSettings) -> int:
    return settings.batch_size or run.inner.batch_size


def _usable(caps: Capabilities, settings: CoordinatorSettings) -> float:
    return caps.memory_bytes * settings.memory_headroom


def fits_path(caps: Capabilities, run: RunConfig, settings: CoordinatorSettings) -> tuple[bool, int]:
    """Whether a whole path fits the peer's memory, and the bytes a path needs."""
    lattice = run.lattice
    need = lattice.training_memory_bytes(lattice.path_modules(lattice.paths()[0]), _batch_size(run, settings))
    return _usable(caps, settings) >= need, need


def path_assignment(
    path: Path_, caps: Capabilities, run: RunConfig, settings: CoordinatorSettings, reason: str, version: int
) -> Assignment:
    """A path-mode assignment for ``caps`` with its slow-link overrides; ``reason`` is extended."""
    lattice = run.lattice
    modules = tuple(lattice.path_modules(path))
    h, codec, why = link_overrides(caps, modules, run, settings)
    return Assignment(
        mode=MODE_PATH, path=tuple(path), module_ids=modules, inner_steps=h, codec=codec,
        reason=f"{reason}; {why}", version=version,
    )


def _is_slow(caps: Capabilities, module_ids: Sequence[str], run: RunConfig, settings: CoordinatorSettings) -> bool:
    h, codec, _ = link_overrides(caps, module_ids, run, settings)
    return (h, codec) != (run.outer.inner_steps, run.outer.codec)


def _uncovered(run: RunConfig, view: ClusterView) -> Iterator[Path_]:
    """Paths without a path-mode peer, in lexicographic order, lazily (cost grows with covered paths)."""
    for path in itertools.product(range(run.lattice.modules_per_level), repeat=run.lattice.levels):
        if path not in view.path_tps:
            yield path


def _members(run: RunConfig, view: ClusterView, path: Path_) -> int:
    return sum(view.module_members.get(m, 0) for m in run.lattice.path_modules(path))


def assign_peer(
    now: float,
    caps: Capabilities,
    view: ClusterView,
    run: RunConfig,
    settings: CoordinatorSettings,
    previous: Optional[Assignment] = None,
    version: int = 1,
    role: str = "",
) -> tuple[Optional[Assignment], str]:
    """Work for a joining peer that holds nothing in ``view``: (assignment, reason), or (None, reason)
    when nothing fits its memory. ``previous`` is its last work before a leave, expiry or restart.
    ``role``: what the peer asked for (:data:`coordinator.pipelines.ROLES`; '' lets us decide): a
    path when it fits, else a stage server or a pipeline trainer (:mod:`coordinator.pipelines`)."""
    del now  # decisions at join do not depend on time; the argument keeps every decision's signature
    lattice = run.lattice
    fits, path_need = fits_path(caps, run, settings)
    if role == "path" and not fits:
        return None, (f"--role path: a path needs {path_need} bytes, more than {_usable(caps, settings):.0f} usable "
                      f"({settings.memory_headroom:.0%} of {caps.memory_bytes}); join with more memory or without --role")
    if fits and role in ("", "path"):
        slow = _is_slow(caps, lattice.path_modules(lattice.paths()[0]), run, settings)
        uncovered = next(_uncovered(run, view), None)
        if uncovered is not None:
            if previous is not None and previous.mode == MODE_PATH and previous.path not in view.path_tps:
                a = path_assignment(
                    previous.path, caps, run, settings,
                    f"rejoined: keeps path {format_path(previous.path)}, which had no peer", version,
                )
                return a, a.reason
            if slow:
                candidates = itertools.islice(_uncovered(run, view), 64)
                uncovered = min(candidates, key=lambda p: (_members(run, view, p), p))
                why = f"path {format_path(uncovered)} had no peer (fewest module members, for a slow link)"
            else:
                why = f"path {format_path(uncovered)} had no peer"
            a = path_assignment(uncovered, caps, run, settings, why, version)
            return a, a.reason
        lo = min(view.path_tps.values())
        hi = max(view.path_tps.values())
        tolerance = settings.rebalance_threshold * max(hi, caps.tokens_per_s)
        if previous is not None and previous.mode == MODE_PATH and previous.path in view.path_tps:
            if view.path_tps[previous.path] - lo <= tolerance:
                a = path_assignment(
                    previous.path, caps, run, settings,
                    f"rejoined: keeps path {format_path(previous.path)} (within the balance threshold)", version,
                )
                return a, a.reason
        if slow:
            near = [p for p, t in view.path_tps.items() if t - lo <= tolerance]
            best = min(near, key=lambda p: (_members(run, view, p), view.path_tps[p], p))
            why = (f"path {format_path(best)} is within {settings.rebalance_threshold:.0%} of the least "
                   f"throughput ({lo:.0f} tok/s) with the fewest module members, for a slow link")
        else:
            best = min(view.path_tps, key=lambda p: (view.path_tps[p], p))
            why = f"path {format_path(best)} had the least throughput ({lo:.0f} tok/s)"
        a = path_assignment(best, caps, run, settings, why, version)
        return a, a.reason

    return assign_small(caps, view, run, settings, _usable(caps, settings), path_need, previous, version, role)


def _mover(members: Mapping[str, float], gap: float, margin: float, now: float, last_moved: Mapping[str, float],
           settings: CoordinatorSettings, fits: Callable[[str], bool]) -> tuple[Optional[str], int]:
    """The member whose move best halves ``gap`` (the source's tokens/s minus the target's): only
    ``0 < tps < gap`` (the sum of squares falls) and shrinking the gap by ``margin`` (hysteresis),
    not moved within ``min_move_interval``. Returns (peer id or None, members held back by the interval)."""
    best: Optional[tuple[float, str]] = None
    waiting = 0
    for peer_id, tps in members.items():
        if not 0 < tps < gap or abs(gap - 2 * tps) > gap - margin or not fits(peer_id):
            continue
        if now - last_moved.get(peer_id, -math.inf) < settings.min_move_interval:
            waiting += 1
            continue
        score = abs(tps - gap / 2)
        if best is None or (score, peer_id) < best:
            best = (score, peer_id)
    return (best[1] if best else None), waiting


def rebalance(
    now: float,
    last_moved: Mapping[str, float],
    caps: Mapping[str, Capabilities],
    view: ClusterView,
    run: RunConfig,
    settings: CoordinatorSettings,
) -> tuple[Optional[Move], str]:
    """At most one path-mode move that lowers the throughput spread: (move, reason) or (None, reason).

    ``last_moved`` maps peer ids to when they were last moved (absent: never); ``caps`` gives the
    moved peer's capabilities for its new assignment's link overrides. Stage servers are not moved.
    """
    if not view.path_tps:
        return None, "no path-mode peers"
    target = next(_uncovered(run, view), None)
    margin = 0.0
    if target is not None:
        target_tps = 0.0
        trigger = f"path {format_path(target)} has no peer"
    else:
        target = min(view.path_tps, key=lambda p: (view.path_tps[p], p))
        target_tps = view.path_tps[target]
        hi = max(view.path_tps.values())
        spread = (hi - target_tps) / hi if hi > 0 else 0.0
        if spread <= settings.rebalance_threshold:
            return None, f"balanced: throughput spread {spread:.0%} is within {settings.rebalance_threshold:.0%}"
        trigger = f"throughput spread {spread:.0%} passes {settings.rebalance_threshold:.0%}"
        # hysteresis: a move must shrink the gap by the threshold too, or two paths with a peer
        # more or less would swap peers back and forth on measurement noise
        margin = settings.rebalance_threshold * hi
    sources = sorted(
        (p for p, members in view.path_peers.items() if len(members) >= 2 and p != target),
        key=lambda p: (-view.path_tps[p], p),
    )
    waiting = 0
    for source in sources:
        peer_id, blocked = _mover(view.path_peers[source], view.path_tps[source] - target_tps, margin, now,
                                  last_moved, settings, lambda p: True)
        waiting += blocked
        if peer_id is not None:
            old = view.assignments[peer_id]
            why = (f"rebalanced from path {format_path(source)} ({view.path_tps[source]:.0f} tok/s) to "
                   f"{format_path(target)} ({target_tps:.0f} tok/s): {trigger}")
            a = path_assignment(target, caps[peer_id], run, settings, why, old.version + 1)
            return Move(peer_id, a, a.reason), a.reason
    if waiting:
        return None, f"{trigger}, but the peers that could move were moved less than {settings.min_move_interval:.0f}s ago"
    return None, f"{trigger}, but no single move lowers the spread"


def relieve_link(
    now: float,
    peer_id: str,
    why: str,
    last_moved: Mapping[str, float],
    caps: Mapping[str, Capabilities],
    view: ClusterView,
    run: RunConfig,
    settings: CoordinatorSettings,
) -> tuple[Optional[Move], str]:
    """Move a path peer whose link alone holds its modules' rounds back (``why``, the planner's
    finding: :func:`coordinator.planner.held_back_by`) to the path where its exchange holds back
    fewest others: the one whose modules have the fewest other members (an uncovered path first),
    only when that is strictly fewer than where it is, and not within ``min_move_interval`` of its
    last move. (move, reason) or (None, reason)."""
    a = view.assignments.get(peer_id)
    if a is None or a.mode != MODE_PATH:
        return None, f"{peer_id[-8:]} holds back a module ({why}) but trains no path"
    if peer_id in view.pinned:
        return None, f"{peer_id[-8:]} holds back a module ({why}) but asked for its role"
    if now - last_moved.get(peer_id, -math.inf) < settings.min_move_interval:
        return None, (f"{peer_id[-8:]} holds back a module ({why}) but moved less than "
                      f"{settings.min_move_interval:.0f}s ago")
    mine = set(a.module_ids)

    def others(path: Path_) -> int:  # members of the path's modules but this peer
        modules = run.lattice.path_modules(path)
        return _members(run, view, path) - sum(1 for m in modules if m in mine)

    here = others(a.path)
    candidates = itertools.chain(itertools.islice(_uncovered(run, view), 64), view.path_tps)
    best = min(((others(p), p) for p in candidates if p != a.path), default=None)
    if best is None or best[0] >= here:
        return None, (f"{peer_id[-8:]} holds back a module ({why}); no path has fewer other members than its "
                      f"{format_path(a.path)} ({here})")
    target = best[1]
    reason = (f"moved from path {format_path(a.path)} ({here} other module members) to {format_path(target)} "
              f"({best[0]}): its link alone held back a module's rounds ({why})")
    moved = path_assignment(target, caps[peer_id], run, settings, reason, a.version + 1)
    return Move(peer_id, moved, moved.reason), moved.reason
