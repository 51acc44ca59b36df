"""The coordinator refills a driven pipeline's emptied level, with an injected clock: a server of the
running pipeline leaves, the tick moves the idle server (one no trainer's path goes through) to that
level, its next heartbeat carries the new assignment and the reason, and nothing moves again."""

from __future__ import annotations

from coordinator.core import Coordinator
from coordinator.records import MODE_STAGE, MODE_TRAINER, Capabilities
from coordinator.scheduler import fits_path
from coordinator.settings import CoordinatorSettings
from coordinator.store import MemoryStore
from models.presets import tiny_cpu

RUN = tiny_cpu().replace(data={"manifest_hash": "ab" * 8})
SETTINGS = CoordinatorSettings(lease_timeout=30.0, heartbeat_interval=5.0, restart_grace=60.0, min_move_interval=0.0)


class Clock:
    t = 1_000_000.0

    def __call__(self) -> float:
        return self.t


def _small(port: int) -> Capabilities:
    """A small peer's capabilities: 0.6 of a path's memory (a stage module or a trainer fits)."""
    _, need = fits_path(Capabilities("cpu", 8 << 30, 1000.0, 0.0, 0.0, ()), RUN, SETTINGS)
    return Capabilities("cpu", int(need * 0.6), 1000.0, 0.0, 0.0, (f"/ip4/127.0.0.1/tcp/{port}",))


def _pipeline(coord):
    """Four small peers: a pipeline (two servers and a trainer) and a server toward the next; returns
    their join results, the trainer's levels, the idle server and the server of the first level."""
    joins = {}
    for i in range(4):
        pid = f"12D3KooWstage{i:08d}"
        joins[pid] = coord.join(pid, f"k{i}".encode(), _small(5000 + i))
    modes = [j.assignment.mode for j in joins.values()]
    assert modes.count(MODE_TRAINER) == 1 and modes.count(MODE_STAGE) == 3
    trainer = next(j.assignment for j in joins.values() if j.assignment.mode == MODE_TRAINER)
    used = RUN.lattice.path_modules(trainer.path)[1:-1]
    [idle] = [p for p, j in joins.items() if j.assignment.mode == MODE_STAGE and j.assignment.module_id not in used]
    [first] = [p for p, j in joins.items() if j.assignment.mode == MODE_STAGE and j.assignment.module_id == used[0]]
    return joins, used, idle, first


def _rejoin(coord, joins, pid):
    """``pid`` joins again (a restart on its work directory: same key, same memory)."""
    return coord.join(pid, f"k{list(joins).index(pid)}".encode(), _small(6000))


def test_tick_refills_the_level_a_running_pipeline_lost():
    clock = Clock()
    coord = Coordinator(RUN, SETTINGS, MemoryStore(), clock=clock)
    joins, used, idle, leaver = _pipeline(coord)  # two servers and a trainer; the fourth serves toward the next
    assert not [e for e in coord.tick() if "moved" in e], "a running pipeline and an idle server: nothing to move"
    coord.leave(joins[leaver].lease.lease_id, leaver, "preempted")
    events = coord.tick()
    assert len([e for e in events if "moved" in e]) == 1, events
    reply = coord.heartbeat(joins[idle].lease.lease_id, idle, assignment_version=joins[idle].assignment.version)
    assert reply.assignment is not None and reply.assignment.mode == MODE_STAGE
    assert reply.assignment.module_id == used[0] and "has trainers but no server" in reply.assignment.reason
    clock.t += 1.0
    assert not [e for e in coord.tick() if "moved" in e], "the pipeline is whole again"


def test_a_server_that_rejoins_after_its_level_was_refilled_takes_a_new_role():
    """A killed server's level is refilled while its lease runs out; when it comes back its module has
    its one server already, so it is not made a second one (a trainer fewer): it gets a newcomer's role."""
    clock = Clock()
    coord = Coordinator(RUN, SETTINGS, MemoryStore(), clock=clock)
    joins, used, idle, first = _pipeline(coord)
    coord.leave(joins[first].lease.lease_id, first, "preempted")
    coord.tick()  # the idle server refills used[0]
    back = _rejoin(coord, joins, first)
    assert not (back.assignment.mode == MODE_STAGE and back.assignment.module_id == used[0]), back.assignment
    assert not back.assignment.reason.startswith("rejoined"), back.assignment.reason


def test_a_server_that_rejoins_before_its_level_was_refilled_keeps_serving_it():
    clock = Clock()
    coord = Coordinator(RUN, SETTINGS, MemoryStore(), clock=clock)
    joins, used, idle, first = _pipeline(coord)
    coord.leave(joins[first].lease.lease_id, first, "preempted")
    back = _rejoin(coord, joins, first)  # no tick in between: the level is still empty
    assert back.assignment.mode == MODE_STAGE and back.assignment.module_id == used[0]
    assert back.assignment.reason.startswith(f"rejoined: keeps serving {used[0]}"), back.assignment.reason
