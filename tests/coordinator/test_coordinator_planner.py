"""The exchange planner (coordinator.planner): per module, H and codec within the communication budget,
with hysteresis, and the coordinator's planning passes handing plans to every holder."""

from __future__ import annotations

import pytest

from coordinator.core import Coordinator
from coordinator.planner import HolderLink, ModulePlan, candidates, plan_module
from coordinator.records import Capabilities
from coordinator.settings import CoordinatorSettings
from coordinator.sqlite_store import SQLiteStore
from coordinator.status import snapshot
from models.codec_spec import codec_spec
from models.errors import ConfigError
from models.presets import tiny_cpu

RUN = tiny_cpu().replace(data={"manifest_hash": "ab" * 8})  # H=10, int8, batch 8 x 32 tokens
SETTINGS = CoordinatorSettings(planner_codecs="int4", comm_budget=0.1, plan_hysteresis=0.25, plan_lead_rounds=4)
OVERLAP = SETTINGS.replace(overlap_budget=0.3)
"""The planner allowed to run an exchange behind the next round (off by default)."""
NUMEL = RUN.lattice.module_param_count("L0M0")
TOKENS_PER_S = 10 * 8 * 32 / 100.0  # a round of the run's H computes 100 s


def rate_for(share: float, codec: str = "int8", h: int = 10, modules: int = 1) -> float:
    """Bytes/s each way that make the module's exchange ``share`` of a round of H."""
    compute = h * 8 * 32 / TOKENS_PER_S
    return 2 * modules * codec_spec(codec).encoded_size(NUMEL) / (share * compute)


def holders(*shares: float) -> list[HolderLink]:
    return [HolderLink(f"12D3KooWpeer{i:08d}", rate_for(s), rate_for(s), TOKENS_PER_S) for i, s in enumerate(shares)]


def test_candidates_try_a_lighter_codec_before_a_longer_round_and_every_blocking_one_before_overlap():
    options = candidates(RUN, OVERLAP)
    assert options[:4] == [(10, "int8", False), (10, "int4", False), (20, "int8", False), (20, "int4", False)]
    assert options[7] == (80, "int4", False) and options[8] == (10, "int8", True)
    assert options[-1] == (80, "int4", True) and len(options) == 16
    # a codec larger than the run's is never a candidate, and without planner_codecs only H changes
    assert {c for _, c, _ in candidates(RUN, SETTINGS.replace(planner_codecs="fp16"))} == {"int8"}
    # overlap_budget 0 (the default): the exchange is always waited for
    assert CoordinatorSettings().overlap_budget == 0.0
    assert candidates(RUN, SETTINGS) == options[:8]


def test_fast_links_keep_the_runs_h_and_codec():
    plan, why = plan_module(0.0, "L0M0", NUMEL, holders(0.05, 0.02), None, 7, RUN, SETTINGS)
    assert plan is None and why.startswith("keeps H=10, int8")


def test_a_slow_holder_gets_the_module_a_lighter_codec_from_an_agreed_round():
    # 0.15 of a round in int8 is 0.08 in int4 (half the bytes, plus per-block scales): int4 fits
    plan, why = plan_module(50.0, "L0M0", NUMEL, holders(0.05, 0.15), None, 7, RUN, SETTINGS)
    assert (plan.inner_steps, plan.codec, plan.from_round) == (10, "int4", 7 + 4)
    assert plan.decided_at == 50.0 and "passes the budget 10%" in why and "slowest holder" in why
    assert "slowest holder 00000001" in why


def test_a_much_slower_holder_gets_a_longer_round_too():
    plan, why = plan_module(0.0, "L0M0", NUMEL, holders(0.5), None, 0, RUN, SETTINGS)
    # int4 at H=10 is ~0.27, at H=20 ~0.13, at H=40 ~0.07: the first within budget
    assert (plan.inner_steps, plan.codec) == (40, "int4")


def test_an_unreachable_budget_takes_the_last_candidate_and_says_so():
    plan, why = plan_module(0.0, "L0M0", NUMEL, holders(50.0), None, 0, RUN, SETTINGS)
    assert (plan.inner_steps, plan.codec, plan.overlap) == (80, "int4", False)
    assert "the least the allowed H and codecs reach" in why
    plan, why = plan_module(0.0, "L0M0", NUMEL, holders(50.0), None, 0, RUN, OVERLAP)
    assert (plan.inner_steps, plan.codec, plan.overlap) == (80, "int4", True) and "behind the next round" in why


def test_an_exchange_no_blocking_plan_fits_runs_behind_the_next_round_at_the_shortest_h_within_overlap_budget():
    """The run's H with int8 is 4 rounds' worth of exchange: int4 at H=80 is still 0.25 of a round,
    past comm_budget (0.1); behind the next round, the first candidate whose exchange is within
    overlap_budget (0.3) of a round is H=80 in int4."""
    plan, why = plan_module(0.0, "L0M0", NUMEL, holders(4.0), None, 3, RUN, OVERLAP)
    assert (plan.inner_steps, plan.codec, plan.overlap, plan.from_round) == (80, "int4", True, 3 + 4)
    assert "H=80, int4, behind the next round: exchange 25% of a round" in why
    assert "passes the budget" in why and "least the allowed" not in why
    # a larger overlap budget takes a shorter round (more meetings, each staler)
    plan, _ = plan_module(0.0, "L0M0", NUMEL, holders(4.0), None, 3, RUN, OVERLAP.replace(overlap_budget=0.6))
    assert (plan.inner_steps, plan.codec, plan.overlap) == (40, "int4", True)
    # an exchange a blocking plan can hold within the budget is waited for, however long the round
    plan, _ = plan_module(0.0, "L0M0", NUMEL, holders(1.5), None, 3, RUN, OVERLAP.replace(overlap_budget=0.6))
    assert (plan.inner_steps, plan.codec, plan.overlap) == (80, "int4", False)


def test_an_overlapped_plan_is_kept_within_its_budget_and_left_only_for_a_blocking_plan_well_within_comm_budget():
    current = ModulePlan("L0M0", 80, "int4", 7, "slow", overlap=True)
    # the exchange measured as long as ever (what it would block, not the nothing it did): kept
    plan, why = plan_module(0.0, "L0M0", NUMEL, holders(4.0), current, 20, RUN, OVERLAP)
    assert plan is None and why.startswith("keeps H=80, int4, behind the next round") and "(budget 30%)" in why
    # noise over the budget, within the hysteresis: kept; nothing preferred fits well within its own
    plan, _ = plan_module(0.0, "L0M0", NUMEL, holders(4.8), current, 20, RUN, OVERLAP)
    assert plan is None
    plan, _ = plan_module(0.0, "L0M0", NUMEL, holders(3.0), current, 20, RUN, OVERLAP)
    assert plan is None
    # links got faster: a shorter overlapped round, then back to a blocking exchange
    plan, why = plan_module(0.0, "L0M0", NUMEL, holders(1.5), current, 20, RUN, OVERLAP)
    assert (plan.inner_steps, plan.codec, plan.overlap) == (40, "int4", True) and why.startswith("links allow")
    plan, why = plan_module(0.0, "L0M0", NUMEL, holders(0.2), current, 20, RUN, OVERLAP)
    assert (plan.inner_steps, plan.codec, plan.overlap) == (20, "int4", False) and why.startswith("links allow")
    # past overlap_budget by more than the hysteresis: the longest, lightest overlapped plan
    short = ModulePlan("L0M0", 40, "int4", 7, "slow", overlap=True)
    plan, why = plan_module(0.0, "L0M0", NUMEL, holders(4.0), short, 20, RUN, OVERLAP)
    assert (plan.inner_steps, plan.codec, plan.overlap) == (80, "int4", True) and "passes the budget 30%" in why


def test_hysteresis_keeps_a_plan_near_the_budget_and_relaxes_only_well_below_it():
    current = ModulePlan("L0M0", 10, "int4", 11, "slow")
    # int4's share just above the budget (within 25 %): kept
    int4 = rate_for(0.11, "int4")
    near = [HolderLink("p", int4, int4, TOKENS_PER_S)]
    plan, why = plan_module(0.0, "L0M0", NUMEL, near, current, 20, RUN, OVERLAP)
    assert plan is None and why.startswith("keeps H=10, int4")
    # int8 would fit at 0.09 of a round, but not within (1 - 0.25) of the budget: kept
    plan, _ = plan_module(0.0, "L0M0", NUMEL, holders(0.09), current, 20, RUN, OVERLAP)
    assert plan is None
    # well below: back to the run's codec
    plan, why = plan_module(0.0, "L0M0", NUMEL, holders(0.05), current, 20, RUN, OVERLAP)
    assert (plan.inner_steps, plan.codec, plan.from_round) == (10, "int8", 24) and why.startswith("links allow")


def test_an_exchange_near_the_one_second_exemption_does_not_flip_the_plan():
    """Rounds of 2.1 s at the run's H, and an exchange that blocks its holder about 1 s whatever the
    codec (round trips, matchmaking), measured a little under and a little over
    MIN_SLOW_EXCHANGE_SECONDS in turn. Over it, the run's H is half a round of exchange and the plan
    lengthens H to fit; under it, the exchange is exempt, but the short plan would still spend half
    of each round exchanging, so the long plan stays: one change, not one each pass."""
    tokens_per_s = 10 * 8 * 32 / 2.1
    fast = 1e12  # bytes/s: the exchange is its overhead
    current, module_round, changes = None, 0, []
    for overhead in [1.05, 0.95] * 6:
        link = [HolderLink("a", fast, fast, tokens_per_s, overhead_s=overhead)]
        plan, why = plan_module(0.0, "L0M0", NUMEL, link, current, module_round, RUN, OVERLAP)
        if plan is not None:
            changes.append((plan.inner_steps, plan.codec, why))
            current = plan
        module_round = (current.from_round if current else module_round) + 1
    assert [(h, c) for h, c, _ in changes] == [(80, "int8")], changes
    assert "passes the budget" in changes[0][2]
    # a module whose exchange is truly small at the shorter H still moves back to it
    quick = [HolderLink("a", fast, fast, tokens_per_s, overhead_s=0.05)]
    plan, why = plan_module(0.0, "L0M0", NUMEL, quick, current, module_round, RUN, OVERLAP)
    assert plan is not None and (plan.inner_steps, plan.codec) == (10, "int8") and why.startswith("links allow")


def test_a_plan_not_yet_in_effect_is_never_changed():
    current = ModulePlan("L0M0", 10, "int4", 11, "slow")
    plan, why = plan_module(0.0, "L0M0", NUMEL, holders(5.0), current, 10, RUN, SETTINGS)
    assert plan is None and "from round 11 (module at round 10)" in why


def test_a_holder_exchanging_several_modules_counts_its_whole_payload():
    one = HolderLink("p", rate_for(0.06), rate_for(0.06), TOKENS_PER_S, modules=1)
    assert plan_module(0.0, "L0M0", NUMEL, [one], None, 0, RUN, SETTINGS)[0] is None
    four = HolderLink("p", rate_for(0.06), rate_for(0.06), TOKENS_PER_S, modules=4)  # 0.24 of a round
    assert plan_module(0.0, "L0M0", NUMEL, [four], None, 0, RUN, SETTINGS)[0] is not None


def test_short_rounds_put_the_switch_further_ahead():
    from coordinator.planner import lead_rounds

    # rounds of 100 s: plan_lead_rounds; rounds of 1 s: three heartbeat intervals (15 s) of them
    assert lead_rounds(10, holders(0.5), RUN, SETTINGS) == 4
    fast = [HolderLink("p", 1e3, 1e3, TOKENS_PER_S * 100)]
    assert lead_rounds(10, fast, RUN, SETTINGS) == 15
    assert lead_rounds(10, [], RUN, SETTINGS) == 4


def test_planner_settings_are_checked():
    with pytest.raises(ConfigError, match="planner_codecs"):
        CoordinatorSettings(planner_codecs="int3")
    with pytest.raises(ConfigError, match="plan_hysteresis"):
        CoordinatorSettings(plan_hysteresis=1.0)
    with pytest.raises(ConfigError, match="plan_lead_rounds"):
        CoordinatorSettings(plan_lead_rounds=0)
    with pytest.raises(ConfigError, match="overlap_budget"):
        CoordinatorSettings(overlap_budget=1.5)


def _caps(up: float) -> Capabilities:
    return Capabilities("cpu", 8 << 30, TOKENS_PER_S, up, up, ("/ip4/127.0.0.1/tcp/4000",))


def test_planning_passes_hand_every_holder_the_plan_and_survive_a_restart(tmp_path):
    now = [1_000_000.0]
    settings = SETTINGS.replace(plan_interval=10.0, min_move_interval=1e9)
    coord = Coordinator(RUN, settings, SQLiteStore(tmp_path / "state.db"), clock=lambda: now[0])
    joined = [coord.join(f"12D3KooWpeer{i:08d}", b"k%d" % i, _caps(1e9)) for i in range(4)]  # the 4 paths
    from coordinator.results import ProgressReport

    coord.heartbeat(joined[0].lease.lease_id, "12D3KooWpeer00000000", [ProgressReport("L0M0", 6, 100, 1.0)])
    coord.tick()
    assert coord.plans == {}  # fast links everywhere: nothing planned
    slow = rate_for(0.15, modules=4)  # a path peer exchanges its 4 modules at once
    coord.heartbeat(joined[0].lease.lease_id, "12D3KooWpeer00000000", link_bps=(slow, slow))
    now[0] += 5
    coord.tick()
    assert coord.plans == {}  # within plan_interval of the last pass
    now[0] += 6
    events = coord.tick()
    path = joined[0].assignment.module_ids
    # the path's blocks pass the budget; the embedding (smaller) stays within the hysteresis, the
    # head's exchange is under a second
    assert set(coord.plans) == {"L0M0", "L1M0"} == {m for m in path if m.startswith("L")}
    assert any("int4" in e for e in events)
    assert coord.plans["L0M0"][-1].from_round == 6 + 4
    # every holder of a planned module hears of it, and only of its own modules' plans
    for i, j in enumerate(joined):
        reply = coord.heartbeat(j.lease.lease_id, f"12D3KooWpeer{i:08d}")
        assert {p.module_id for p in reply.plans} == set(coord.plans) & set(j.assignment.module_ids)
    snap = snapshot(coord)
    row = next(m for m in snap["modules"] if m["module_id"] == "L0M0")
    assert row["plan"]["codec"] == "int8" and row["plan"]["next"]["codec"] == "int4"
    assert row["plan"]["next"]["from_round"] == 10 and "passes the budget" in row["plan_reason"]
    assert [p["link_measured"] for p in snap["peers"]] == [True, False, False, False]
    from coordinator.web import render_page

    page = render_page(snap, {}, 5.0)
    assert "<h2>Exchange plans</h2>" in page and "H=10, int4 from round 10" in page and "passes the budget" in page
    coord.store.apply(coord.take_dirty())
    again = Coordinator(RUN, settings, SQLiteStore(tmp_path / "state.db"), clock=lambda: now[0])
    assert again.plans == coord.plans


def test_a_module_that_needs_a_longer_round_gives_every_module_its_h(tmp_path):
    """One path peer's exchange overhead needs H=40 for its modules; the other modules' links would
    keep the run's H=10, but a peer's modules end a round together: every module gets H=40, the
    others with the run's codec."""
    from coordinator.store import MemoryStore

    now = [1_000_000.0]
    settings = SETTINGS.replace(plan_interval=1.0, min_move_interval=1e9)
    coord = Coordinator(RUN, settings, MemoryStore(), clock=lambda: now[0])
    joined = [coord.join(f"12D3KooWpeer{i:08d}", b"k%d" % i, _caps(1e9)) for i in range(4)]
    compute = 10 * 8 * 32 / TOKENS_PER_S
    coord.heartbeat(joined[0].lease.lease_id, "12D3KooWpeer00000000", link_bps=(1e9, 1e9),
                    exchange_overhead_s=0.3 * compute)
    now[0] += 2
    events = coord.tick()
    assert {m: (p[-1].inner_steps, p[-1].codec) for m, p in coord.plans.items()} == {
        m: (40, RUN.outer.codec) for m in RUN.lattice.module_ids()}, events
    slow_path = set(joined[0].assignment.module_ids)
    other = next(m for m in RUN.lattice.module_ids() if m not in slow_path)
    assert "need H=40" in coord.plans[other][-1].reason and "overhead" in coord.plans[next(iter(slow_path))][-1].reason


from hypothesis import given, settings as hsettings, strategies as st  # noqa: E402

_rates = st.one_of(st.just(0.0), st.floats(1e2, 1e9))


@hsettings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(_rates, _rates, st.floats(1.0, 1e5), st.integers(1, 6),
                          st.one_of(st.just(0.0), st.floats(0.01, 30.0))), max_size=12),
       st.sampled_from([(10, "int8"), (10, "int4"), (40, "int4")]))
def test_the_slowest_holder_found_among_the_undominated_is_the_one_a_full_scan_finds(links, candidate):
    from coordinator.links import MIN_SLOW_EXCHANGE_SECONDS
    from coordinator.planner import _costs, _share

    hs = [HolderLink(f"p{i}", up, down, tps, k, overhead_s=o) for i, (up, down, tps, k, o) in enumerate(links)]
    h, codec = candidate
    size = codec_spec(codec).encoded_size(NUMEL)
    compute_tokens = h * 8 * 32
    full = 0.0
    for link in hs:
        seconds = link.overhead_s + link.modules * size * ((1 / link.upload_bps if link.upload_bps else 0)
                                                           + (1 / link.download_bps if link.download_bps else 0))
        if seconds >= MIN_SLOW_EXCHANGE_SECONDS:
            full = max(full, seconds / (compute_tokens / link.tokens_per_s))
    assert _share(NUMEL, h, codec, _costs(hs), RUN, SETTINGS)[0] == pytest.approx(full, rel=1e-9)


def test_an_exchange_overhead_is_amortised_by_a_longer_round_not_by_a_smaller_codec():
    """Fast links, but each round's exchange blocks one holder 0.3 of a round at the run's H for what
    no codec shrinks (round trips, matchmaking): the plan quadruples H (0.075 of a round, within the
    0.1 budget; a smaller codec at H or 2H stays over it) and keeps the run's codec."""
    compute = 10 * 8 * 32 / TOKENS_PER_S  # seconds of a round at the run's H
    fast = rate_for(0.001)
    slow_round = [HolderLink("a", fast, fast, TOKENS_PER_S, overhead_s=0.3 * compute),
                  HolderLink("b", fast, fast, TOKENS_PER_S)]
    plan, why = plan_module(0.0, "L0M0", NUMEL, slow_round, None, 3, RUN, SETTINGS)
    assert plan is not None and (plan.inner_steps, plan.codec) == (40, RUN.outer.codec), why
    assert "overhead" in why
    # without the overhead the same links need nothing
    plan, why = plan_module(0.0, "L0M0", NUMEL, [HolderLink("a", fast, fast, TOKENS_PER_S)], None, 3, RUN, SETTINGS)
    assert plan is None, why


def test_a_module_is_held_back_by_one_holder_only_when_the_rest_would_fit():
    from coordinator.planner import held_back_by

    run_share = lambda s: rate_for(s)  # noqa: E731
    fast, slow = run_share(0.02), run_share(0.5)
    links = [HolderLink("a", fast, fast, TOKENS_PER_S), HolderLink("b", slow, slow, TOKENS_PER_S)]
    assert held_back_by(NUMEL, links, RUN, SETTINGS).peer_id == "b"
    assert held_back_by(NUMEL, links[:1], RUN, SETTINGS) is None  # fits
    two_slow = links + [HolderLink("c", slow, slow, TOKENS_PER_S)]
    assert held_back_by(NUMEL, two_slow, RUN, SETTINGS) is None  # the plan's job, not a move's


def test_a_path_peer_whose_link_alone_holds_its_modules_back_moves_to_where_it_holds_back_fewest(tmp_path):
    from coordinator.store import MemoryStore

    now = [1_000_000.0]
    settings = SETTINGS.replace(plan_interval=1.0, min_move_interval=300.0)
    coord = Coordinator(RUN, settings, MemoryStore(), clock=lambda: now[0])
    fast = 1e9
    tps = [100.0, 200.0, 200.0, 200.0, 10.0, 10.0]  # the last two join the path of least throughput, (0, 0)
    joined = [coord.join(f"12D3KooWpeer{i:08d}", b"k%d" % i, Capabilities("cpu", 8 << 30, t, fast, fast))
              for i, t in enumerate(tps)]
    assert [j.assignment.path for j in joined] == [(0, 0), (0, 1), (1, 0), (1, 1), (0, 0), (0, 0)]
    slow = rate_for(2.0, modules=4) * 10.0 / TOKENS_PER_S  # at 10 tok/s its exchange is twice a round
    coord.heartbeat(joined[4].lease.lease_id, "12D3KooWpeer00000004", link_bps=(slow, slow))
    now[0] += 2
    events = coord.tick()
    moved = coord.peer("12D3KooWpeer00000004")
    # on (1, 1) its modules have 14 other members, against 16 on (0, 0) and 15 on (0, 1) and (1, 0)
    assert moved.assignment.path == (1, 1) and moved.last_moved == now[0], events
    assert "its link alone held back a module's rounds" in moved.assignment.reason
    assert moved.assignment.version == joined[4].assignment.version + 1
    reply = coord.heartbeat(joined[4].lease.lease_id, "12D3KooWpeer00000004", assignment_version=1)
    assert reply.assignment is not None and reply.assignment.path == (1, 1)
    now[0] += 2
    coord.tick()  # still the slowest, but moved less than min_move_interval ago
    assert coord.peer("12D3KooWpeer00000004").assignment.path == (1, 1)
    assert "moved less than 300s ago" in snapshot(coord)["slow_links"]


def test_a_holder_that_ignores_plans_keeps_the_modules_codec_the_runs():
    old = [*holders(0.05), HolderLink("12D3KooWold", rate_for(0.15), rate_for(0.15), TOKENS_PER_S,
                                      follows_plans=False)]
    plan, why = plan_module(0.0, "L0M0", NUMEL, old, None, 7, RUN, SETTINGS)
    assert (plan.inner_steps, plan.codec) == (20, "int8")  # int4 would do at H=10, but not for that peer
    current = ModulePlan("L0M0", 10, "int4", 3, "slow")  # planned before the old peer joined: back to int8
    plan, why = plan_module(0.0, "L0M0", NUMEL, old, current, 7, RUN, SETTINGS)
    assert plan.codec == "int8" and "ignore plans, so the codec is the run's" in why


def test_whether_a_peer_follows_plans_comes_from_the_protocol_it_states():
    from coordinator.versions import follows_plans

    assert follows_plans({"coordinator": "1.2"}) and follows_plans({"coordinator": "1.7"})
    assert not follows_plans({"coordinator": "1.1"}) and not follows_plans({})
    assert not follows_plans({"coordinator": "x"})
