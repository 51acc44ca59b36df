"""Pipeline roles (coordinator.pipelines): which small peer serves a stage and which drives a
pipeline, checked by decisions and reasons on views built by hand, and through the Coordinator with
an injected clock (served throughput from heartbeats, never the join figure)."""

from __future__ import annotations

from dataclasses import replace

from coordinator.core import Coordinator
from coordinator.pipelines import pipelines, rebalance_pipelines, trainer_memory
from coordinator.records import MODE_PATH, MODE_STAGE, MODE_TRAINER, Capabilities
from coordinator.scheduler import assign_peer, fits_path
from coordinator.settings import CoordinatorSettings
from coordinator.store import MemoryStore
from coordinator.view import ClusterView
from models.presets import tiny_cpu

RUN = tiny_cpu()
SETTINGS = CoordinatorSettings(min_move_interval=60.0)
"""The default: one server a level."""
STANDBY = SETTINGS.replace(servers_per_level=2)
"""Two servers a driven level before more trainers or another pipeline."""
_, PATH_NEED = fits_path(Capabilities("cpu", 8 << 30, 1000.0), RUN, SETTINGS)
SMALL = Capabilities("cpu", int(PATH_NEED * 0.6), 5000.0)
BIG = Capabilities("cpu", 8 << 30, 1000.0)


def _join(view: ClusterView, pid: str, caps: Capabilities = SMALL, role: str = "", tps: float = 0.0,
          settings: CoordinatorSettings = SETTINGS):
    a, reason = assign_peer(0.0, caps, view, RUN, settings, role=role)
    assert a is not None, reason
    view.add(pid, a, tps if a.mode != MODE_PATH else caps.tokens_per_s)
    return a


def test_small_peers_build_a_pipeline_then_drive_it():
    assert SMALL.memory_bytes * SETTINGS.memory_headroom >= trainer_memory(RUN, RUN.inner.batch_size)
    view = ClusterView()
    _join(view, "path0", BIG)
    _join(view, "path1", BIG)
    first, second, third = (_join(view, f"s{i}") for i in range(3))
    assert (first.mode, second.mode, third.mode) == (MODE_STAGE, MODE_STAGE, MODE_TRAINER)
    assert first.module_id.startswith("L0") and second.module_id.startswith("L1")
    path = (int(first.module_id[-1]), int(second.module_id[-1]))
    assert "waits for servers of" in first.reason and "waits for a trainer" in second.reason
    assert third.path == path and "has a server on every level and no trainer" in third.reason
    assert third.module_ids == (RUN.lattice.embed_id(path), RUN.lattice.head_id(path))
    # path peers hold (0,0) and (0,1): the new level-0 server takes the unheld L0M1; its level-1 module is
    # also held by a path peer, and the two average together
    assert first.module_id == "L0M1" and view.module_members[second.module_id] == 2
    [row] = pipelines(RUN, view)
    assert row["state"] == "running" and [t["peer_id"] for t in row["trainers"]] == ["s2"]


def test_six_small_peers_form_two_pipelines():
    view = ClusterView()
    got = [_join(view, f"s{i}") for i in range(6)]
    assert [a.mode for a in got].count(MODE_TRAINER) == 2
    running = [r for r in pipelines(RUN, view) if r["state"] == "running"]
    assert len(running) == 2 and running[0]["path"] != running[1]["path"]
    assert all(lv["servers"] for r in running for lv in r["levels"])


def test_six_small_peers_give_each_level_a_standby_before_another_pipeline():
    view = ClusterView()
    got = [_join(view, f"s{i}", settings=STANDBY) for i in range(6)]
    assert [a.mode for a in got] == [MODE_STAGE, MODE_STAGE, MODE_TRAINER, MODE_STAGE, MODE_STAGE, MODE_STAGE]
    [running] = [r for r in pipelines(RUN, view) if r["state"] == "running"]
    assert [len(lv["servers"]) for lv in running["levels"]] == [2, 2]
    for a in got[3:5]:
        assert a.module_id in {lv["module"] for lv in running["levels"]}
        assert "1 server on driven pipeline" in a.reason and "retry on it when a server stops" in a.reason
    # the sixth serves toward a second pipeline, off the running one's path
    assert got[5].module_id not in {lv["module"] for lv in running["levels"]}


def test_an_idle_server_becomes_a_standby_before_it_drives():
    view = ClusterView()
    for i in range(4):  # one server a level: a running pipeline, and one server toward the next (idle)
        _join(view, f"s{i}")
    [running] = [r for r in pipelines(RUN, view) if r["state"] == "running"]
    used = {lv["module"] for lv in running["levels"]}
    [idle] = [p for p, a in view.assignments.items() if a.mode == MODE_STAGE and a.module_id not in used]
    for pid, a in list(view.assignments.items()):
        if a.mode == MODE_STAGE and a.module_id in used:
            view.set_tokens_per_s(pid, 300.0, 1000.0)
    caps = {p: SMALL for p in view.assignments}
    move, reason = rebalance_pipelines(0.0, {}, caps, view, RUN, STANDBY)
    assert move is not None and move.peer_id == idle and move.assignment.mode == MODE_STAGE
    assert move.assignment.module_id == min(used) and "instead of pausing" in reason
    _apply(view, move)
    # the other level has one server still; with none idle, no move takes a driven server away
    move, reason = rebalance_pipelines(0.0, {}, caps, view, RUN, STANDBY)
    assert move is None, reason


def test_a_level_with_a_standby_keeps_running_when_a_server_leaves():
    view = ClusterView()
    for i in range(5):
        _join(view, f"s{i}", settings=STANDBY)
    [running] = [r for r in pipelines(RUN, view) if r["state"] == "running"]
    level0 = running["levels"][0]
    view.remove(level0["servers"][0]["peer_id"])
    [after] = pipelines(RUN, view)
    assert after["state"] == "running" and len(after["levels"][0]["servers"]) == 1
    caps = {p: SMALL for p in view.assignments}
    move, reason = rebalance_pipelines(0.0, {}, caps, view, RUN, STANDBY)
    assert move is None, "no idle server: the level runs on its standby until a peer joins"
    a = _join(view, "s9", settings=STANDBY)
    assert a.mode == MODE_STAGE and a.module_id == level0["module"]


def _driven(busy: dict[int, float]) -> ClusterView:
    """One running pipeline whose level servers are ``busy[level]`` of their 1000 tokens/s capacity."""
    view = ClusterView()
    for i in range(3):
        _join(view, f"s{i}")
    for pid, a in list(view.assignments.items()):
        if a.mode == MODE_STAGE:
            level = int(a.module_id[1])
            view.set_tokens_per_s(pid, 1000.0 * busy[level], 1000.0)
    return view


def test_a_busy_stage_gets_the_next_server_and_calm_ones_another_trainer():
    view = _driven({0: 0.95, 1: 0.4})
    a = _join(view, "s9")
    assert a.mode == MODE_STAGE and a.module_id.startswith("L0") and "95% busy, the bottleneck" in a.reason
    view = _driven({0: 0.3, 1: 0.4})
    a = _join(view, "s9")
    assert a.mode == MODE_TRAINER and "at most 40% busy" in a.reason


def test_roles_asked_for_and_stage_mode_off():
    view = _driven({0: 0.3, 1: 0.4})
    assert _join(view, "x", role="stage").mode == MODE_STAGE
    assert _join(view, "y", role="trainer").mode == MODE_TRAINER
    a, reason = assign_peer(0.0, SMALL, view, RUN, SETTINGS, role="path")
    assert a is None and "--role path" in reason and "more memory" in reason
    a, reason = assign_peer(0.0, BIG, ClusterView(), RUN, SETTINGS, role="stage")
    assert a is not None and a.mode == MODE_STAGE
    off = SETTINGS.replace(stage_mode=False)
    a, reason = assign_peer(0.0, SMALL, ClusterView(), RUN, off)
    assert a is None and "stage_mode = false" in reason


def _apply(view: ClusterView, move) -> None:
    view.remove(move.peer_id)
    view.add(move.peer_id, move.assignment, 0.0)


def test_an_emptied_level_is_refilled_from_an_idle_server_and_pinned_peers_stay():
    view = ClusterView()
    for i in range(4):  # a running pipeline, and one server toward the next
        _join(view, f"s{i}")
    [running] = [r for r in pipelines(RUN, view) if r["state"] == "running"]
    used = {lv["module"] for lv in running["levels"]}
    [idle] = [p for p, a in view.assignments.items() if a.mode == MODE_STAGE and a.module_id not in used]
    lost = next(p for p, a in view.assignments.items() if a.mode == MODE_STAGE and p != idle
                and RUN.lattice.module_kind(a.module_id) == "block" and a.module_id[1] == view.assignments[idle].module_id[1])
    lost_module = view.assignments[lost].module_id
    view.remove(lost)
    caps = {p: SMALL for p in view.assignments}
    view.pinned.update(view.assignments)  # peers that asked for their role are never moved
    move, reason = rebalance_pipelines(0.0, {}, caps, view, RUN, SETTINGS)
    assert move is None, reason
    view.pinned.clear()
    move, reason = rebalance_pipelines(0.0, {idle: -1e9}, caps, view, RUN, SETTINGS)
    assert move is not None and move.peer_id == idle and move.assignment.module_id == lost_module
    assert "has trainers but no server" in reason
    recent = {p: 0.0 for p in view.assignments}  # every peer moved just now: none moves again
    assert rebalance_pipelines(1.0, recent, caps, view, RUN, SETTINGS)[0] is None
    _apply(view, move)
    assert [r["state"] for r in pipelines(RUN, view)].count("running") == 1


def test_an_emptied_level_is_refilled_from_a_second_trainer_of_the_pipeline():
    """A server killed, and a newcomer that joined before its lease ran out became a second trainer of
    the pipeline: with no idle server left, that second trainer serves the empty level, and the
    pipeline keeps its first trainer."""
    view = ClusterView()
    for i in range(3):
        _join(view, f"s{i}")
    [first] = [p for p, a in view.assignments.items() if a.mode == MODE_TRAINER]
    path = view.assignments[first].path
    view.trainer_peers[path][first] = 900.0  # tokens/s the first trainer drove
    second = _join(view, "late", role="trainer")
    view.pinned.discard("late")
    assert second.mode == MODE_TRAINER and second.path == path
    lost = next(p for p, a in view.assignments.items() if a.mode == MODE_STAGE and a.module_id.startswith("L1"))
    lost_module = view.assignments[lost].module_id
    view.remove(lost)
    caps = {p: SMALL for p in view.assignments}
    move, reason = rebalance_pipelines(0.0, {}, caps, view, RUN, SETTINGS)
    assert move is not None and move.peer_id == "late", reason  # it drove less than the first
    assert move.assignment.mode == MODE_STAGE and move.assignment.module_id == lost_module
    assert f"moved from trainer of pipeline {','.join(map(str, path))} to {lost_module}" in reason
    _apply(view, move)
    [row] = [r for r in pipelines(RUN, view) if r["path"] == list(path) or r["path"] == path]
    assert row["state"] == "running" and len(row["trainers"]) == 1
    # a pipeline's only trainer is never taken for a server
    view = ClusterView()
    for i in range(3):
        _join(view, f"s{i}")
    lost = next(p for p, a in view.assignments.items() if a.mode == MODE_STAGE)
    view.remove(lost)
    move, reason = rebalance_pipelines(0.0, {}, {p: SMALL for p in view.assignments}, view, RUN, SETTINGS)
    assert move is None, reason


def test_a_trainer_of_a_broken_pipeline_moves_to_a_complete_one_nobody_drives():
    view = ClusterView()
    for i in range(3):
        _join(view, f"s{i}")
    trainer = next(p for p, a in view.assignments.items() if a.mode == MODE_TRAINER)
    path = view.assignments[trainer].path
    other = tuple(1 - i for i in path)
    for level, i in enumerate(other):  # servers of the other path arrive, pinned to their stage
        m = RUN.lattice.block_id(level, i)
        a, _ = assign_peer(0.0, SMALL, ClusterView(), RUN, SETTINGS)
        view.add(f"o{level}", replace(a, module_id=m, module_ids=(m,)), 0.0)
    lost = next(p for p, a in view.assignments.items() if a.mode == MODE_STAGE and not p.startswith("o"))
    view.remove(lost)
    caps = {p: SMALL for p in view.assignments}
    move, reason = rebalance_pipelines(0.0, {}, caps, view, RUN, SETTINGS)
    assert move is not None and move.peer_id != trainer  # refilling the level comes first
    view.pinned.update(p for p in view.assignments if p != trainer)
    move, reason = rebalance_pipelines(0.0, {}, caps, view, RUN, SETTINGS)
    assert move is not None and move.peer_id == trainer and move.assignment.path != path
    assert all(m in view.stage_peers for m in RUN.lattice.path_modules(move.assignment.path)[1:-1])
    assert "complete and not driven" in reason


class Clock:
    t = 1_000_000.0

    def __call__(self) -> float:
        return self.t


def test_coordinator_counts_served_tokens_not_the_join_figure():
    coord = Coordinator(RUN, SETTINGS, MemoryStore(), clock=Clock())
    joins = {}
    for i in range(3):
        pid = f"12D3KooWsmall{i:08d}"
        joins[pid] = coord.join(pid, f"k{i}".encode(), replace(SMALL, multiaddrs=(f"/ip4/127.0.0.1/tcp/{5000 + i}",)))
    server = next(p for p, j in joins.items() if j.assignment.mode == MODE_STAGE)
    assert coord.view.holders[server] == 0.0  # 5000 tokens/s at join, nothing served yet
    j = joins[server]
    coord.heartbeat(j.lease.lease_id, server, assignment_version=j.assignment.version, tokens_per_s=800.0,
                    measured=True, capacity=2000.0)
    assert coord.view.holders[server] == 800.0 and coord.view.capacity[server] == 2000.0
    coord.heartbeat(j.lease.lease_id, server, assignment_version=j.assignment.version, tokens_per_s=0.0,
                    measured=True)
    assert coord.view.holders[server] == 0.0  # idle now: 0, not "unchanged"
    assert coord._peers[server].capabilities.tokens_per_s == 5000.0  # the device's figure is kept apart


def test_an_idle_server_beside_calm_pipelines_becomes_a_trainer():
    view = ClusterView()
    for i in range(4):  # a running pipeline, and one server toward the next (idle)
        _join(view, f"s{i}")
    [running] = [r for r in pipelines(RUN, view) if r["state"] == "running"]
    used = {lv["module"] for lv in running["levels"]}
    [idle] = [p for p, a in view.assignments.items() if a.mode == MODE_STAGE and a.module_id not in used]
    caps = {p: SMALL for p in view.assignments}
    assert rebalance_pipelines(0.0, {}, caps, view, RUN, SETTINGS)[0] is None, "not measured: nothing to judge by"
    for pid, a in list(view.assignments.items()):
        if a.mode == MODE_STAGE and a.module_id in used:
            view.set_tokens_per_s(pid, 300.0, 1000.0)
    move, reason = rebalance_pipelines(0.0, {}, caps, view, RUN, SETTINGS)
    assert move is not None and move.peer_id == idle and move.assignment.mode == MODE_TRAINER
    assert move.assignment.path == tuple(running["path"]) and "at most 30% busy" in reason
    for pid, a in list(view.assignments.items()):  # the pipeline's level 0 is its bottleneck now
        if a.mode == MODE_STAGE and a.module_id in used and a.module_id.startswith("L0"):
            view.set_tokens_per_s(pid, 900.0, 1000.0)
    move, reason = rebalance_pipelines(0.0, {}, caps, view, RUN, SETTINGS)
    assert move is not None and move.peer_id == idle and move.assignment.mode == MODE_STAGE
    assert move.assignment.module_id.startswith("L0") and "90% busy" in reason
