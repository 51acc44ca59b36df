"""The coordinator moves stage servers toward the pipeline's bottleneck (issue 7), with an injected
clock: servers report their measured throughput in heartbeats, the tick moves one server from the
most to the least served module, the moved server's next heartbeat carries its new assignment, and
nothing moves again while the spread is within the threshold."""

from __future__ import annotations

from coordinator.core import Coordinator
from coordinator.records import MODE_STAGE, Capabilities
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


def test_tick_moves_a_stage_server_to_the_bottleneck_module():
    clock = Clock()
    coord = Coordinator(RUN, SETTINGS, MemoryStore(), clock=clock)
    _, need = fits_path(Capabilities("cpu", 8 << 30, 1000.0, 0.0, 0.0, ()), RUN, SETTINGS)
    small = int(need * 0.6)
    joins = {}
    for i in range(8):  # two servers per block module (assignment fills the least served module)
        pid = f"12D3KooWstage{i:08d}"
        joins[pid] = coord.join(pid, f"k{i}".encode(), Capabilities("cpu", small, 1000.0, 0.0, 0.0,
                                                                     (f"/ip4/127.0.0.1/tcp/{5000 + i}",)))
        assert joins[pid].assignment.mode == MODE_STAGE
    by_module: dict[str, list[str]] = {}
    for pid, j in joins.items():
        by_module.setdefault(j.assignment.module_id, []).append(pid)
    assert sorted(len(v) for v in by_module.values()) == [2, 2, 2, 2]
    slow_module = sorted(by_module)[-1]
    for pid, j in joins.items():  # the servers of one module turn out slow
        tps = 150.0 if pid in by_module[slow_module] else 1000.0
        coord.heartbeat(j.lease.lease_id, pid, assignment_version=j.assignment.version, tokens_per_s=tps)
    events = coord.tick()
    moved = [e for e in events if f"to {slow_module}" in e]
    assert len(moved) == 1, events
    mover = moved[0].split(":")[0]
    assert mover not in by_module[slow_module]
    reply = coord.heartbeat(joins[mover].lease.lease_id, mover, assignment_version=joins[mover].assignment.version)
    assert reply.assignment is not None and reply.assignment.module_id == slow_module
    assert reply.assignment.mode == MODE_STAGE and "stage throughput spread" in reply.assignment.reason
    clock.t += 1.0
    assert not [e for e in coord.tick() if "moved from stage" in e], "one move was enough"
