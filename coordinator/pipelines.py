"""Pipelines (SWARM, Ryabinin et al. 2023) inside the lattice: which peer too small for a path serves
which stage or drives which path, and when one changes role. Pure functions of (now, state, config)
that return a decision and its reason, as :mod:`coordinator.scheduler`'s are.

A **pipeline** is a path whose block modules live on stage servers, driven by **pipeline trainers**
(each holds the path's embedding, head and data). It runs only while every level of its path has a
live server; the servers of a module serve every pipeline through it. Throughput is what peers
served (their heartbeats' measurements), never the figure measured at join: a server that nobody
drives counts 0.

A small peer's role at join, in this order (a rejoining one first keeps its role: a trainer its
pipeline, a server its module unless that has ``servers_per_level`` servers again, refilled while it
was away):

1. **trainer** of a complete pipeline that nobody drives;
2. **server** of the busiest module of a driven pipeline once its servers are busier than
   ``server_busy_share`` of what they can serve (the pipeline's bottleneck);
3. **server**, a second one (up to ``servers_per_level``), of a driven pipeline's level that has
   fewer: a server that stops then costs its trainers a retry on the other, not a pause;
4. **trainer**, a second one, of a driven pipeline whose servers are all measured and less busy;
5. **server** of the next missing level of the pipeline closest to complete (the most levels served;
   among equals, the path with the least path-mode throughput): it waits, idle, until the pipeline
   is whole and driven.

Rebalancing (one move a tick, a peer at most once per ``min_move_interval``, peers that asked for a
role never): a driven pipeline's empty level is refilled from an idle server (one on no driven
trainer's path), a module with two or more servers, or a pipeline with two or more trainers; a
trainer whose pipeline lost a level moves to a complete pipeline nobody drives; an idle server moves
to a driven pipeline's bottleneck, else to a driven level with fewer than ``servers_per_level``
servers, or, when every level of a driven pipeline has room, drives it as another trainer.
"""

from __future__ import annotations

import itertools
from typing import Mapping, Optional

from coordinator.links import link_overrides
from coordinator.records import MODE_STAGE, MODE_TRAINER, Assignment, Capabilities, Move
from coordinator.settings import CoordinatorSettings
from coordinator.view import ClusterView
from models.config import RunConfig, format_path

__all__ = ["assign_small", "rebalance_pipelines", "pipelines", "busy_share", "trainer_memory", "stage_assignment",
           "trainer_assignment", "ROLES"]

Path_ = tuple[int, ...]

ROLES = ("path", "stage", "trainer")
"""Roles a peer may ask for at join (``peer join --role``); empty: the coordinator decides."""

_CANDIDATES = 64
"""Complete pipelines looked at per decision (bounds the cost on a large lattice)."""


def _blocks(run: RunConfig, path: Path_) -> list[str]:
    return run.lattice.path_modules(path)[1:-1]


def trainer_memory(run: RunConfig, batch: int) -> int:
    """Bytes a pipeline trainer needs: a path's embedding and head, trained on ``batch`` sequences."""
    lattice = run.lattice
    path = lattice.paths()[0]
    return lattice.training_memory_bytes([lattice.embed_id(path), lattice.head_id(path)], batch)


def _served(run: RunConfig, view: ClusterView) -> list[list[int]]:
    """Per level, the module indices that have at least one stage server."""
    lattice = run.lattice
    return [[i for i in range(lattice.modules_per_level) if lattice.block_id(level, i) in view.stage_peers]
            for level in range(lattice.levels)]


def _complete(run: RunConfig, view: ClusterView) -> list[Path_]:
    """Paths whose every level has a server (at most :data:`_CANDIDATES`), driven ones first."""
    driven = [p for p in view.trainer_peers if view.complete(_blocks(run, p))]
    rest = itertools.islice((p for p in itertools.product(*_served(run, view)) if p not in view.trainer_peers),
                            _CANDIDATES)
    return driven + list(rest)


def busy_share(view: ClusterView, module_id: str) -> Optional[float]:
    """Served tokens/s of a module's servers over what they can serve; None until every one is measured."""
    servers = view.stage_peers.get(module_id, {})
    caps = [view.capacity.get(p, 0.0) for p in servers]
    if not servers or any(c <= 0 for c in caps):
        return None
    return view.stage_tps.get(module_id, 0.0) / sum(caps)


def _driven(run: RunConfig, view: ClusterView) -> list[Path_]:
    """Complete pipelines with at least one trainer."""
    return sorted(p for p in view.trainer_peers if view.complete(_blocks(run, p)))


def _driven_levels(run: RunConfig, view: ClusterView) -> list[tuple[str, Path_]]:
    """(module, path) for each level of each driven pipeline, paths in order."""
    return [(m, path) for path in _driven(run, view) for m in _blocks(run, path)]


def _bottleneck(run: RunConfig, view: ClusterView, share: float) -> Optional[tuple[str, float, Path_]]:
    """The busiest module of a driven pipeline whose servers are busier than ``share``."""
    busy = [(b, m, path) for m, path in _driven_levels(run, view)
            if (b := busy_share(view, m)) is not None and b >= share]
    best = min(busy, key=lambda x: (-x[0], x[1]), default=None)
    return None if best is None else (best[1], best[0], best[2])


def _thin(run: RunConfig, view: ClusterView, wanted: int) -> Optional[tuple[str, int, Path_]]:
    """The module of a driven pipeline's served level with the fewest servers, when fewer than
    ``wanted``: (module, its servers, the pipeline); None when every driven level has enough. (A level
    with no server is a missing one, refilled by the rules for those.)"""
    few = [(m, n, path) for m, path in _driven_levels(run, view)
           if 0 < (n := len(view.stage_peers.get(m, {}))) < wanted]
    return min(few, key=lambda x: (x[1], x[0]), default=None)


def _standby_reason(thin: tuple[str, int, Path_]) -> str:
    module, n, path = thin
    return (f"{module} has {n} server{'s' if n != 1 else ''} on driven pipeline {format_path(path)}: one more lets its "
            f"trainers retry on it when a server stops, instead of pausing")


def _closest(run: RunConfig, view: ClusterView) -> Path_:
    """The path with the most levels served (each level independently), its missing levels taking
    the module with the fewest members; among equals the least path-mode throughput."""
    lattice = run.lattice
    served = _served(run, view)
    choices = []
    for level, indices in enumerate(served):
        if indices:
            choices.append(indices)
        else:
            choices.append([min(range(lattice.modules_per_level),
                                key=lambda i: (view.module_members.get(lattice.block_id(level, i), 0), i))])
    candidates = itertools.islice(itertools.product(*choices), _CANDIDATES)
    return min(candidates, key=lambda p: (view.path_tps.get(p, 0.0), p))


def stage_assignment(module: str, caps: Capabilities, run: RunConfig, settings: CoordinatorSettings, reason: str,
                     version: int) -> Assignment:
    """Serve ``module`` as a stage, with the peer's slow-link overrides."""
    h, codec, link = link_overrides(caps, [module], run, settings)
    return Assignment(mode=MODE_STAGE, module_id=module, module_ids=(module,), inner_steps=h, codec=codec,
                      reason=f"{reason}; {link}", version=version)


def trainer_assignment(path: Path_, caps: Capabilities, run: RunConfig, settings: CoordinatorSettings, reason: str,
                       version: int) -> Assignment:
    """Drive ``path`` through its stage servers, holding its embedding and head."""
    lattice = run.lattice
    modules = (lattice.embed_id(path), lattice.head_id(path))
    h, codec, link = link_overrides(caps, modules, run, settings)
    return Assignment(mode=MODE_TRAINER, path=tuple(path), module_ids=modules, inner_steps=h, codec=codec,
                      reason=f"{reason}; {link}", version=version)


def assign_small(caps: Capabilities, view: ClusterView, run: RunConfig, settings: CoordinatorSettings, usable: float,
                 path_need: int, previous: Optional[Assignment] = None, version: int = 1,
                 role: str = "") -> tuple[Optional[Assignment], str]:
    """A role for a peer too small for a path (or one that asked for ``role`` "stage" or "trainer"):
    (assignment, reason), or (None, reason) when none fits or stage mode is off (module docstring)."""
    lattice = run.lattice
    batch = settings.batch_size or run.inner.batch_size
    blocks = [m for m in lattice.module_ids() if lattice.module_kind(m) == "block"]
    fitting = {m for m in blocks if lattice.training_memory_bytes([m], batch) <= usable}
    t_need = trainer_memory(run, batch)
    can_train = usable >= t_need and role != "stage"
    can_serve = bool(fitting) and role != "trainer"
    small = f"a path needs {path_need} bytes, more than {usable:.0f} usable"
    if not settings.stage_mode:
        return None, (f"{small}, and stage mode is off in this run ([coordinator] stage_mode = false); join with "
                      f"more memory (--max-memory) or a smaller batch")
    if not can_train and not can_serve:
        smallest = min(lattice.training_memory_bytes([m], batch) for m in blocks)
        wanted = {"stage": f"a stage needs {smallest}", "trainer": f"a trainer needs {t_need}"}.get(
            role, f"the smallest module {smallest} and a trainer {t_need}")
        return None, (f"no work fits {caps.memory_bytes} bytes ({settings.memory_headroom:.0%} usable): a path needs "
                      f"{path_need}, {wanted}; join with more memory or a smaller batch")
    if previous is not None:
        if previous.mode == MODE_TRAINER and can_train:
            a = trainer_assignment(previous.path, caps, run, settings,
                                   f"rejoined: keeps driving pipeline {format_path(previous.path)}", version)
            return a, a.reason
        # its module refilled meanwhile (a trainer moved there while its lease ran out): a server more than
        # servers_per_level there is a trainer fewer, so it takes whatever role a newcomer would
        if (previous.mode == MODE_STAGE and can_serve and previous.module_id in fitting
                and len(view.stage_peers.get(previous.module_id, {})) < settings.servers_per_level):
            a = stage_assignment(previous.module_id, caps, run, settings,
                                 f"rejoined: keeps serving {previous.module_id}", version)
            return a, a.reason
    complete = _complete(run, view)
    if can_train:
        undriven = [p for p in complete if p not in view.trainer_peers]
        if undriven:
            path = min(undriven, key=lambda p: (view.path_tps.get(p, 0.0), p))
            a = trainer_assignment(path, caps, run, settings,
                                   f"{small}: pipeline {format_path(path)} has a server on every level and no "
                                   f"trainer", version)
            return a, a.reason
    if can_serve:
        neck = _bottleneck(run, view, settings.server_busy_share)
        if neck is not None and neck[0] in fitting:
            a = stage_assignment(neck[0], caps, run, settings,
                                 f"{small}: the servers of {neck[0]} are {neck[1]:.0%} busy, the bottleneck of "
                                 f"pipeline {format_path(neck[2])}", version)
            return a, a.reason
    if can_serve:
        thin = _thin(run, view, settings.servers_per_level)
        if thin is not None and thin[0] in fitting:
            a = stage_assignment(thin[0], caps, run, settings, f"{small}: {_standby_reason(thin)}", version)
            return a, a.reason
    if can_train:
        calm = _calm(run, view, settings.server_busy_share)
        if calm is not None:
            most, path = calm
            a = trainer_assignment(path, caps, run, settings,
                                   f"{small}: the servers of pipeline {format_path(path)} are at most {most:.0%} busy, "
                                   f"so another trainer drives more tokens through them", version)
            return a, a.reason
    target = _closest(run, view)
    missing = [m for m in _blocks(run, target) if m not in view.stage_peers]
    if can_serve:
        module = next((m for m in missing if m in fitting), None)
        if module is None:  # the pipeline lacks only modules too big for this peer: add to the least served
            module = min(fitting, key=lambda m: (len(view.stage_peers.get(m, {})), m))
        waits = [m for m in missing if m != module]
        tail = (f"; it waits for servers of {', '.join(waits)} and a trainer" if waits
                else "" if not missing else "; it waits for a trainer")
        a = stage_assignment(module, caps, run, settings,
                             f"{small}: serves {module} toward pipeline {format_path(target)}{tail}", version)
        return a, a.reason
    a = trainer_assignment(target, caps, run, settings,
                           f"{small}: drives pipeline {format_path(target)}, which waits for servers of "
                           f"{', '.join(missing) or 'no level'}", version)
    return a, a.reason


def rebalance_pipelines(now: float, last_moved: Mapping[str, float], caps: Mapping[str, Capabilities],
                        view: ClusterView, run: RunConfig, settings: CoordinatorSettings) -> tuple[Optional[Move], str]:
    """At most one role move that lets more tokens through the pipelines: (move, reason) or (None,
    reason). See the module docstring for the moves, tried in that order."""
    if not view.stage_peers and not view.trainer_peers:
        return None, "no pipelines"
    lattice = run.lattice
    batch = settings.batch_size or run.inner.batch_size

    def movable(peer_id: str) -> bool:
        return peer_id not in view.pinned and now - last_moved.get(peer_id, float("-inf")) >= settings.min_move_interval

    def fits(peer_id: str, module: str) -> bool:
        return caps[peer_id].memory_bytes * settings.memory_headroom >= lattice.training_memory_bytes([module], batch)

    # a server is idle when no trainer's path goes through its module (a paused pipeline keeps its servers)
    wanted = {m for p in view.trainer_peers for m in _blocks(run, p)}
    idle = sorted(p for m, servers in view.stage_peers.items() if m not in wanted for p in servers)

    def moved(peer_id: str, assignment: Assignment) -> tuple[Move, str]:
        return Move(peer_id, assignment, assignment.reason), assignment.reason

    # a driven pipeline that lost a level: refill it
    for path in sorted(view.trainer_peers):
        for module in _blocks(run, path):
            if module in view.stage_peers:
                continue
            spare = [p for p in idle if movable(p) and fits(p, module)]
            spare += sorted(p for m, servers in view.stage_peers.items() if len(servers) >= 2
                            for p in servers if p not in spare and movable(p) and fits(p, module))
            # then a second trainer of a pipeline (this one first, the one that drove least first): it
            # drives nothing while a level is empty, and the pipeline keeps a trainer (a newcomer that
            # joined as a trainer before the lost server's lease ran out is such a one)
            extra = min(((other != path, tps, p) for other, trainers in view.trainer_peers.items()
                         if len(trainers) >= 2 for p, tps in trainers.items() if movable(p) and fits(p, module)),
                        default=None)
            spare += [extra[-1]] if extra is not None else []
            if spare:
                peer_id = spare[0]
                old = view.assignments[peer_id]
                was = (f"trainer of pipeline {format_path(old.path)}" if old.mode == MODE_TRAINER
                       else f"stage {old.module_id}")
                why = (f"moved from {was} to {module}: pipeline {format_path(path)} has trainers but no "
                       f"server of {module}")
                return moved(peer_id, stage_assignment(module, caps[peer_id], run, settings, why, old.version + 1))
    # a trainer whose pipeline lacks a level, while a complete one has no trainer
    undriven = [p for p in _complete(run, view) if p not in view.trainer_peers]
    if undriven:
        for path in sorted(view.trainer_peers):
            if view.complete(_blocks(run, path)):
                continue
            for peer_id in sorted(view.trainer_peers[path]):
                if movable(peer_id):
                    target = min(undriven, key=lambda p: (view.path_tps.get(p, 0.0), p))
                    old = view.assignments[peer_id]
                    why = (f"moved from pipeline {format_path(path)}, which lacks a server, to "
                           f"{format_path(target)}, complete and not driven")
                    return moved(peer_id, trainer_assignment(target, caps[peer_id], run, settings, why,
                                                             old.version + 1))
    def idle_to(module: str, because: str) -> Optional[tuple[Move, str]]:
        """The first movable idle server that fits ``module``, moved to serve it."""
        for peer_id in idle:
            if movable(peer_id) and fits(peer_id, module):
                old = view.assignments[peer_id]
                why = f"moved from stage {old.module_id}, which no trainer drives, to {module}: {because}"
                return moved(peer_id, stage_assignment(module, caps[peer_id], run, settings, why, old.version + 1))
        return None

    # an idle server to a driven pipeline's bottleneck, else to a driven level with too few servers
    neck = _bottleneck(run, view, settings.server_busy_share)
    if neck is not None and (move := idle_to(neck[0], f"its servers are {neck[1]:.0%} busy, the bottleneck of "
                                                      f"pipeline {format_path(neck[2])}")) is not None:
        return move
    thin = _thin(run, view, settings.servers_per_level)
    if thin is not None and (move := idle_to(thin[0], _standby_reason(thin))) is not None:
        return move
    # an idle server beside driven pipelines whose servers all have room: it drives one as a trainer
    calm = _calm(run, view, settings.server_busy_share)
    if calm is not None:
        most, path = calm
        t_need = trainer_memory(run, batch)
        for peer_id in idle:
            if movable(peer_id) and caps[peer_id].memory_bytes * settings.memory_headroom >= t_need:
                old = view.assignments[peer_id]
                why = (f"moved from stage {old.module_id}, which no trainer drives, to drive pipeline "
                       f"{format_path(path)}: its servers are at most {most:.0%} busy")
                return moved(peer_id, trainer_assignment(path, caps[peer_id], run, settings, why, old.version + 1))
    return None, "pipelines: no move lets more tokens through"


def _calm(run: RunConfig, view: ClusterView, share: float) -> Optional[tuple[float, Path_]]:
    """The driven pipeline whose busiest level is least busy, when every level is measured and below
    ``share``: (that busy share, path); None otherwise."""
    calm = []
    for path in _driven(run, view):
        busy = [busy_share(view, m) for m in _blocks(run, path)]
        if all(b is not None for b in busy) and max(busy) < share:
            calm.append((max(busy), path))
    return min(calm) if calm else None


def pipelines(run: RunConfig, view: ClusterView) -> list[dict]:
    """The pipelines for the status page: every path with a trainer or a server on each of its levels,
    with its trainers, each level's servers (tokens/s served, capacity) and whether it runs."""
    paths = set(view.trainer_peers) | set(_complete(run, view))
    out = []
    for path in sorted(paths):
        levels = []
        for m in _blocks(run, path):
            servers = view.stage_peers.get(m, {})
            levels.append({"module": m, "servers": [{"peer_id": p, "tokens_per_s": tps,
                                                     "capacity_tokens_per_s": view.capacity.get(p, 0.0)}
                                                    for p, tps in sorted(servers.items())],
                           "tokens_per_s": view.stage_tps.get(m, 0.0), "busy": busy_share(view, m)})
        trainers = view.trainer_peers.get(path, {})
        missing = [lv["module"] for lv in levels if not lv["servers"]]
        state = "running" if trainers and not missing else ("paused: no server of " + ", ".join(missing) if missing
                                                            else "waiting for a trainer")
        out.append({"path": list(path), "name": format_path(path), "state": state,
                    "trainers": [{"peer_id": p, "tokens_per_s": tps} for p, tps in sorted(trainers.items())],
                    "tokens_per_s": sum(trainers.values()), "levels": levels})
    return out

