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


def test_tick_refills_the_level_a_running_pipeline_lost():
    clock = Clock()
    coord = Coordinator(RUN, SETTINGS, MemoryStore(), clock=clock)
    _, need = fits_path(Capabilities("cpu", 8 << 30, 1000.0, 0.0, 0.0, ()), RUN, SETTINGS)
    small = int(need * 0.6)
    joins = {}
    for i in range(4):  # two servers and a trainer make a pipeline; the fourth serves toward the next
        pid = f"12D3KooWstage{i:08d}"
        joins[pid] = coord.join(pid, f"k{i}".encode(), Capabilities("cpu", small, 1000.0, 0.0, 0.0,
                                                                     (f"/ip4/127.0.0.1/tcp/{5000 + i}",)))
    modes = [j.assignment.mode for j in joins.values()]
    assert modes.count(MODE_TRAINER) == 1 and modes.count(MODE_STAGE) == 3
    trainer = next(j.assignment for j in joins.values() if j.assignment.mode == MODE_TRAINER)
    used = RUN.lattice.path_modules(trainer.path)[1:-1]
    [idle] = [p for p, j in joins.items() if j.assignment.mode == MODE_STAGE and j.assignment.module_id not in used]
    [leaver] = [p for p, j in joins.items() if j.assignment.mode == MODE_STAGE and j.assignment.module_id == used[0]]
    assert not [e for e in coord.tick() if "moved" in e], "a running pipeline and an idle server: nothing to move"
    coord.leave(joins[leaver].lease.lease_id, leaver, "preempted")
    events = coord.tick()
    assert len([e for e in events if "moved" in e]) == 1, events
    reply = coord.heartbeat(joins[idle].lease.lease_id, idle, assignment_version=joins[idle].assignment.version)
    assert reply.assignment is not None and reply.assignment.mode == MODE_STAGE
    assert reply.assignment.module_id == used[0] and "has trainers but no server" in reply.assignment.reason
    clock.t += 1.0
    assert not [e for e in coord.tick() if "moved" in e], "the pipeline is whole again"
