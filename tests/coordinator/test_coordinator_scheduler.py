"""The assignment policy: pure functions with an injected clock, checked by their decisions and
their reasons, and by hypothesis properties (coverage, one assignment per peer, a reason for every
decision, convergence of rebalancing without oscillation)."""

from __future__ import annotations

import math

from hypothesis import HealthCheck, given, settings as hsettings, strategies as st

from coordinator.records import MODE_PATH, MODE_STAGE, Capabilities
from coordinator.scheduler import assign_peer, exchange_bytes, fits_path, link_overrides, rebalance
from coordinator.settings import CoordinatorSettings
from coordinator.view import ClusterView
from models.config import LatticeConfig, RunConfig
from models.presets import tiny_cpu

RUN = tiny_cpu()
SETTINGS = CoordinatorSettings(min_move_interval=60.0)
BIG = 8 << 30


def caps(tps: float = 1000.0, memory: int = BIG, up: float = 0.0, down: float = 0.0) -> Capabilities:
    return Capabilities("cpu", memory, tps, up, down, ())


def join_all(tps_list, run=RUN, settings=SETTINGS, view=None):
    view = view or ClusterView()
    out = {}
    for i, tps in enumerate(tps_list):
        a, reason = assign_peer(0.0, caps(tps), view, run, settings)
        assert a is not None and reason
        view.add(f"p{i}", a, tps)
        out[f"p{i}"] = a
    return view, out


def test_first_peers_cover_every_path_in_order():
    view, got = join_all([1000.0] * 4)
    assert [a.path for a in got.values()] == RUN.lattice.paths()
    assert all(a.mode == MODE_PATH and "had no peer" in a.reason for a in got.values())
    assert got["p0"].module_ids == tuple(RUN.lattice.path_modules((0, 0)))


def test_balances_by_throughput_not_head_count():
    view, _ = join_all([4000.0, 1000.0, 1000.0, 1000.0])
    a, reason = assign_peer(0.0, caps(500.0), view, RUN, SETTINGS)
    # paths (0,1), (1,0), (1,1) tie at 1000 tok/s; the lexicographically first wins, never (0,0)
    assert a.path == (0, 1)
    assert "least throughput (1000 tok/s)" in reason


def test_small_memory_gets_a_stage_module_with_reason():
    fits, need = fits_path(caps(), RUN, SETTINGS)
    assert fits
    small = caps(memory=int(need * 0.5))
    a, reason = assign_peer(0.0, small, ClusterView(), RUN, SETTINGS)
    assert a.mode == MODE_STAGE and a.module_ids == (a.module_id,)
    assert f"a path needs {need} bytes" in reason


def test_nothing_fits_returns_none_and_says_why():
    a, reason = assign_peer(0.0, caps(memory=1000), ClusterView(), RUN, SETTINGS)
    assert a is None
    assert "no work fits 1000 bytes" in reason and "smallest module" in reason


def test_slow_link_gets_a_larger_h_and_keeps_the_groups_codec():
    modules = RUN.lattice.path_modules(RUN.lattice.paths()[0])
    fast_h, fast_codec, why = link_overrides(caps(up=1e9, down=1e9), modules, RUN, SETTINGS)
    assert (fast_h, fast_codec) == (RUN.outer.inner_steps, RUN.outer.codec) and "of a round" in why
    # a bandwidth at which the exchange takes 3x the budget at the run's H: H grows 4x, the codec stays
    compute = RUN.outer.inner_steps * RUN.inner.batch_size * RUN.lattice.seq_len / 10.0  # a slow peer: 10 tok/s
    bw = 2 * exchange_bytes(RUN, modules) / (SETTINGS.comm_budget * compute) / 3
    h, codec, why = link_overrides(caps(10.0, up=bw, down=bw), modules, RUN, SETTINGS)
    assert codec == RUN.outer.codec and h == 4 * RUN.outer.inner_steps and "slow link" in why
    # an exchange under a second is never slow, whatever its share of a tiny round
    h, codec, why = link_overrides(caps(1e9, up=1e8, down=1e8), modules, RUN, SETTINGS)
    assert h == RUN.outer.inner_steps and "of a round" in why
    h, codec, _ = link_overrides(caps(up=1.0, down=1.0), modules, RUN, SETTINGS)
    assert codec == RUN.outer.codec and h == RUN.outer.inner_steps * SETTINGS.max_inner_steps_factor


def test_exchange_bytes_are_the_codecs_exact_size_per_module():
    # tiny 2x2, d=32, one block per module: embed 256*32 + 32*32 = 9216 values, a block 12*32*32 + 2*32 = 12352,
    # the tied head 32. int8 sends one byte per value and a 4-byte scale per block of 1024 values (not 256).
    modules = RUN.lattice.path_modules((0, 1))
    assert [RUN.lattice.module_param_count(m) for m in modules] == [9216, 12352, 12352, 32]
    assert RUN.outer.codec == "int8"
    assert exchange_bytes(RUN, modules) == (9216 + 4 * 9) + 2 * (12352 + 4 * 13) + (32 + 4) == 34096
    assert exchange_bytes(RUN.replace(outer={"codec": "int4"}), modules) == (
        (4608 + 4 * 9) + 2 * (6176 + 4 * 13) + (16 + 4))
    assert exchange_bytes(RUN.replace(outer={"codec": "fp16"}), modules) == 2 * 33952
    assert exchange_bytes(RUN.replace(outer={"codec": "none"}), ["head"]) == 4 * 32


def test_slow_peer_prefers_path_with_fewer_module_members():
    run = RunConfig(run_id="wide", lattice=LatticeConfig(d_model=32, n_heads=2, blocks_per_module=1, seq_len=32,
                                                          levels=1, modules_per_level=3))
    view, _ = join_all([1000.0, 1000.0, 1000.0, 1000.0, 1000.0], run=run)  # paths 0,1,2,0,1 -> 2 has 1 member
    view.remove("p4")
    view.add("p4", assign_peer(0.0, caps(1000.0), ClusterView(), run, SETTINGS)[0], 1000.0)  # (0,) again
    # throughputs: (0,)=3000, (1,)=1000, (2,)=1000; members: L0M1=1, L0M2=1 -> tie broken by fewer members
    slow = caps(1000.0, up=10.0, down=10.0)
    a, reason = assign_peer(0.0, slow, view, run, SETTINGS)
    assert a.path in [(1,), (2,)] and "fewest module members" in reason and a.codec == run.outer.codec and a.inner_steps > run.outer.inner_steps


def test_rejoin_keeps_previous_path_when_balanced():
    view, got = join_all([1000.0] * 6)
    prev = got["p5"]
    view.remove("p5")
    a, reason = assign_peer(0.0, caps(1000.0), view, RUN, SETTINGS, previous=prev)
    assert a.path == prev.path and reason.startswith("rejoined")


def test_rebalance_fills_uncovered_path_then_respects_move_interval():
    view, got = join_all([1000.0] * 8)
    for pid in ("p3", "p7"):  # path (1,1) loses both peers
        view.remove(pid)
    last_moved: dict[str, float] = {}
    cap_map = {p: caps(1000.0) for p in got}
    move, reason = rebalance(100.0, last_moved, cap_map, view, RUN, SETTINGS)
    assert move is not None and move.assignment.path == (1, 1)
    assert "path 1,1 has no peer" in reason
    assert move.assignment.version == got[move.peer_id].version + 1
    # every source peer moved recently: nothing moves, and the reason says so
    recent = {p: 90.0 for p in got}
    move, reason = rebalance(100.0, recent, cap_map, view, RUN, SETTINGS)
    assert move is None and "moved less than 60s ago" in reason


def test_balanced_lattice_does_not_move():
    view, got = join_all([1000.0, 1000.0, 1000.0, 1000.0, 900.0, 900.0, 900.0, 900.0])
    move, reason = rebalance(1000.0, {}, {p: caps() for p in got}, view, RUN, SETTINGS)
    assert move is None and reason.startswith("balanced")


def test_no_swap_of_peers_between_paths_on_noise():
    """Two paths, three near-equal peers: the path with one peer has about half the throughput, but
    moving a peer over would only mirror the imbalance; no move, whatever the noise, and the reason says why."""
    run = RunConfig(run_id="two", lattice=LatticeConfig(d_model=32, n_heads=2, blocks_per_module=1, seq_len=32,
                                                         levels=1, modules_per_level=2))
    for a, b, c in [(1000.0, 1000.0, 1000.0), (1040.0, 980.0, 1000.0), (960.0, 1010.0, 1050.0)]:
        view, got = join_all([a, b, c], run=run)
        assert sorted(len(m) for m in view.path_peers.values()) == [1, 2]
        move, reason = rebalance(1000.0, {}, {p: caps() for p in got}, view, run, SETTINGS)
        assert move is None and "no single move lowers the spread" in reason, reason


# -- properties ---------------------------------------------------------------------------------

tps_st = st.floats(min_value=10.0, max_value=1e5, allow_nan=False)
lattices = st.sampled_from([(1, 1), (1, 3), (2, 2), (3, 2), (2, 3)])


def run_for(shape) -> RunConfig:
    levels, mpl = shape
    return RunConfig(run_id="prop", lattice=LatticeConfig(d_model=32, n_heads=2, blocks_per_module=1, seq_len=32,
                                                           levels=levels, modules_per_level=mpl))


def potential(view: ClusterView) -> float:
    return sum(t * t for t in view.path_tps.values())


def settle(run, view, cap_map, last_moved, settings, start=0.0, max_ticks=500):
    """Apply rebalance moves (clock advancing past the move interval) until none; check each move."""
    now = start
    moves = 0
    for _ in range(max_ticks):
        now += settings.min_move_interval + 1
        move, reason = rebalance(now, last_moved, cap_map, view, run, settings)
        assert reason
        if move is None:
            return moves, now
        before = potential(view)
        view.remove(move.peer_id)
        view.add(move.peer_id, move.assignment, cap_map[move.peer_id].tokens_per_s)
        last_moved[move.peer_id] = now
        assert potential(view) < before - 1e-9, "every move must lower the sum of squared path throughputs"
        moves += 1
    raise AssertionError(f"rebalancing did not converge in {max_ticks} ticks")


@hsettings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(shape=lattices, tps=st.lists(tps_st, min_size=0, max_size=30), leave=st.lists(st.integers(0, 29), max_size=10),
       mem_small=st.lists(st.booleans(), min_size=30, max_size=30))
def test_property_one_assignment_per_peer_and_reasons(shape, tps, leave, mem_small):
    run = run_for(shape)
    _, need = fits_path(caps(), run, SETTINGS)
    view = ClusterView()
    for i, t in enumerate(tps):
        c = caps(t, memory=int(need * 0.7) if mem_small[i] else BIG)
        a, reason = assign_peer(0.0, c, view, run, SETTINGS)
        assert reason, "every decision has a reason"
        if a is not None:
            view.add(f"p{i}", a, t)
            assert a.reason and a.module_ids
            if a.mode == MODE_PATH:
                assert list(a.module_ids) == run.lattice.path_modules(a.path)
    for i in leave:
        view.remove(f"p{i}")
    holders = [pid for members in view.path_peers.values() for pid in members]
    assert len(holders) == len(set(holders)), "no peer holds two paths"
    assert set(view.assignments) == set(view.holders)
    total = sum(view.holders[p] for p in holders)
    assert math.isclose(sum(view.path_tps.values()), total, rel_tol=1e-9, abs_tol=1e-6)


@hsettings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(shape=lattices, tps=st.lists(tps_st, min_size=1, max_size=40), leave=st.sets(st.integers(0, 39), max_size=20))
def test_property_coverage_and_convergence(shape, tps, leave):
    """With at least as many path-capable peers as paths, every path ends up covered; rebalancing
    converges (each move strictly lowers a potential, so it cannot oscillate) and then stays put."""
    run = run_for(shape)
    view = ClusterView()
    cap_map = {}
    for i, t in enumerate(tps):
        a, _ = assign_peer(0.0, caps(t), view, run, SETTINGS)
        view.add(f"p{i}", a, t)
        cap_map[f"p{i}"] = caps(t)
    for i in leave:
        view.remove(f"p{i}")
    last_moved: dict[str, float] = {}
    _, now = settle(run, view, cap_map, last_moved, SETTINGS)
    if len(view.holders) >= run.lattice.num_paths:
        assert set(view.path_tps) == set(run.lattice.paths()), "every path is covered"
    # converged means converged: later passes at any time make no move
    for later in (now + 1, now + 10 * SETTINGS.min_move_interval):
        move, reason = rebalance(later, last_moved, cap_map, view, run, SETTINGS)
        assert move is None and reason


@hsettings(max_examples=40, deadline=None, derandomize=True)
@given(tps=st.lists(tps_st, min_size=2, max_size=20))
def test_property_no_peer_moves_twice_within_interval(tps):
    run = run_for((2, 2))
    view = ClusterView()
    cap_map = {}
    for i, t in enumerate(tps):
        a, _ = assign_peer(0.0, caps(t), view, run, SETTINGS)
        view.add(f"p{i}", a, t)
        cap_map[f"p{i}"] = caps(t)
    # one peer suddenly gets much faster: imbalance
    view.set_tokens_per_s("p0", 1e6)
    cap_map["p0"] = caps(1e6)
    last_moved: dict[str, float] = {}
    now = 0.0
    for _ in range(50):
        now += 1.0  # much less than min_move_interval
        move, _ = rebalance(now, last_moved, cap_map, view, run, SETTINGS)
        if move is None:
            continue
        assert now - last_moved.get(move.peer_id, -math.inf) >= SETTINGS.min_move_interval
        view.remove(move.peer_id)
        view.add(move.peer_id, move.assignment, cap_map[move.peer_id].tokens_per_s)
        last_moved[move.peer_id] = now
