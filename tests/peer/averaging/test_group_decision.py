"""The matchmaking decision as pure functions of what the holders declared (``peer.averaging.group_decision``):
examples of each outcome with its reason, and properties every peer relies on to agree without
talking: the decision does not depend on the order declarations were read in, every holder of a
round reaches the same kept state and the same leader, and a group holds only members of our state."""

from __future__ import annotations

from hypothesis import given, settings as hsettings, strategies as st

from peer.averaging.group_decision import (LONE, Decision, Gathered, Match, behind_a_formed_group, complete, decide,
                                           decide_top, fresh_source, gathered, in_bucket, leader_of, missed,
                                           past_the_archive, resolve_fork, sticky, still_waiting, survey, vanished)
from peer.averaging.matchmaking import LONE as MATCHMAKING_LONE, Match as MatchmakingMatch
from peer.network import GroupDeclaration

ME = "peer-M"
ROUND = 7
OURS = "d-ours"
FUZZ = hsettings(max_examples=80, deadline=None, derandomize=True)


def decl(digest: str = OURS, bandwidth: float = 1.0, formed: bool = False,
         expecting: tuple[str, ...] = ()) -> GroupDeclaration:
    return GroupDeclaration("cfg", "data", bandwidth, digest=digest, expecting=expecting, formed=formed)


def read(everyone=None, ahead=-1, same_round=(), behind=None, live=(), gone=None) -> Gathered:
    everyone = dict(everyone or {})
    return Gathered(everyone, ahead, set(same_round) | set(everyone), dict(behind or {}),
                    set(live) | set(everyone), dict(gone or {}))


def run(gathered_: Gathered, *, digest: str = OURS, me: str = ME, bandwidth: float = 1.0, **kw) -> Decision:
    kw.setdefault("vanished", {})
    kw.setdefault("missed", {})
    kw.setdefault("now", 1000.0)
    kw.setdefault("patience", 60.0)
    return decide(me, bandwidth, ROUND, digest, gathered_, **kw)


def test_the_matchmaker_reexports_the_decisions_result_types():
    assert MatchmakingMatch is Match and MATCHMAKING_LONE == LONE == "lone"


# -- examples: one per outcome, each with its reason ------------------------------------------------

def test_a_live_holder_ahead_sends_us_to_re_sync():
    d = run(read({"peer-A": decl()}, ahead=ROUND + 1))
    assert d.match == Match(None, f"behind: other holders are at round {ROUND + 1}; re-sync from them first",
                            ahead=ROUND + 1)


def test_holders_that_left_ahead_send_us_to_re_sync_to_their_round():
    d = run(read(gone={"peer-X": ROUND + 2, "peer-Y": ROUND - 1}))
    assert d.match == Match(None, f"behind: holders that left were at round {ROUND + 2}; re-sync to it first",
                            ahead=ROUND + 2, ahead_left=True)


def test_a_fork_lost_to_the_majority_adopts_its_state():
    d = run(read({"peer-A": decl("d-other"), "peer-B": decl("d-other"), "peer-D": decl("d-other"), "peer-C": decl()}))
    assert d.match == Match(None, "forked: 3 of 5 holders at this round hold state d-other, ours is d-ours; "
                                  "re-syncing to theirs", adopt="d-other")
    assert d.fork is None  # nothing to report as kept


def test_a_fork_won_by_our_state_is_reported_and_the_group_forms_without_the_others():
    d = run(read({"peer-A": decl("d-other"), "peer-B": decl(), "peer-C": decl()}))
    assert d.match is None and d.leader == "peer-B" and d.members == {"peer-B", "peer-C"}
    assert d.fork is not None
    assert (d.fork.kept, d.fork.holding, d.fork.total, d.fork.others) == (OURS, 3, 4, ("peer-A",))


def test_a_fork_tie_keeps_the_larger_digest():
    assert resolve_fork("d-a", {"peer-A": decl("d-b")}).kept == "d-b"
    assert resolve_fork("d-b", {"peer-A": decl("d-a")}).kept == "d-b"
    assert resolve_fork("d-b", {"peer-A": decl("d-b")}) is None


def test_a_holder_our_read_missed_keeps_us_from_grouping():
    d = run(read({"peer-A": decl()}), missed={"peer-Z1234567": 12.4})
    assert d.match == Match(None, "holders Z1234567 are missing from our read of the DHT while their records are "
                                  "valid for up to 12s more: not averaging without them (they may be at this round)")


def test_a_group_of_this_round_that_began_without_us_sends_us_behind_it():
    d = run(read({"peer-A": decl(formed=True), "peer-B": decl()}))
    assert d.match == behind_a_formed_group(["peer-A"], ROUND)
    assert d.match.ahead == ROUND + 1 and "began this round's group without us" in d.match.reason
    assert d.match.reason.endswith("re-sync to the round it applies")


def test_a_formed_statement_does_not_count_in_a_split_round():
    d = run(read({"peer-A": decl(formed=True)}), bucket=(0, 2))
    assert d.match is None and d.leader == "peer-A"


def test_a_holder_at_our_round_that_did_not_declare_fails_the_round():
    d = run(read(same_round={"peer-S"}))
    assert d.match == Match(None, "holders peer-S at this round did not declare in time")


def test_alone_in_a_bucket_is_a_lone_group():
    d = run(read(), bucket=(3, 4))
    assert d.match == Match(d.match.group, "alone in group 3") and d.match.group.group_id == LONE
    assert not d.check_archive


def test_alone_with_holders_behind_waits_for_them_until_patience_runs_out():
    behind = {"peer-B1234567": ROUND - 1}
    d = run(read(behind=behind), now=1000.0)
    assert d.match == Match(None, f"waiting for holders behind us to catch up (B1234567 at round {ROUND - 1})")
    assert d.waited.since == {"peer-B1234567": (ROUND - 1, 1000.0, False)}
    later = run(read(behind=behind), now=1060.0, waited=d.waited.since)
    assert later.match.group.group_id == LONE and later.check_archive
    assert later.match.reason == "holders behind us did not catch up (B1234567)"
    assert later.waited.given_up == ["peer-B1234567"]


def test_overlap_mode_steps_alone_past_holders_behind():
    d = run(read(behind={"peer-B": ROUND - 1}), wait_for_behind=False)
    assert d.match.group.group_id == LONE and d.waited is None


def test_holders_that_vanished_while_we_were_out_of_touch_keep_us_from_stepping_alone():
    d = run(read(), vanished={"peer-V1234567": 990.0}, in_touch_since=None)
    assert d.match == Match(None, "holders V1234567 vanished without leaving while we were out of touch with the "
                                  "coordinator (cut off?): not stepping alone for 60s after they were last seen")
    assert run(read(), vanished={"peer-V": 990.0}, in_touch_since=995.0).match.group is None


def test_in_touch_with_the_coordinator_since_before_they_vanished_we_step_alone():
    d = run(read(), vanished={"peer-V": 990.0}, in_touch_since=980.0)
    assert d.match == Match(d.match.group, "") and d.match.group.group_id == LONE and d.check_archive
    assert d.match.group.members == (ME,)


def test_the_archive_ahead_overrides_a_lone_step():
    assert past_the_archive(ROUND + 3, ROUND) == Match(None, f"behind: the archive keeps round {ROUND + 3}; re-sync "
                                                             "from it first", ahead=ROUND + 3)
    assert past_the_archive(ROUND, ROUND) is None and past_the_archive(-1, ROUND) is None


def test_the_smallest_declared_id_that_accepts_connections_leads():
    d = run(read({"peer-A": decl(bandwidth=0.0), "peer-C": decl(), "peer-D": decl("d-minority")}))
    assert d.leader == "peer-C" and d.members == {"peer-A", "peer-C"}
    assert run(read({"peer-Z": decl()})).leader == ME


def test_no_member_accepting_connections_is_no_group():
    d = run(read({"peer-A": decl(bandwidth=0.0)}), bandwidth=0.0)
    assert d.match == Match(None, "no member of the group accepts connections (all in client mode)")


def test_the_top_group_needs_its_majority_of_buckets():
    assert decide_top(ME, 1.0, {"peer-A": decl()}, 4, 3).match == Match(
        None, "top group: 2 of 4 groups' delegates declared (a mean of fewer than 3 could fork the replicas)")
    lone = decide_top(ME, 1.0, {}, 2, 1).match
    assert lone.group.group_id == LONE and lone.reason == "alone at this level"
    assert decide_top(ME, 0.0, {"peer-A": decl(bandwidth=0.0)}, 2, 2).match == Match(
        None, "top group: no delegate accepts connections (all in client mode)")
    assert decide_top(ME, 1.0, {"peer-A": decl(), "peer-B": decl()}, 4, 3) == Decision(
        leader="peer-A", members=frozenset({"peer-A", "peer-B"}))


# -- the gather -----------------------------------------------------------------------------------

def test_the_survey_waits_for_holders_at_our_round_our_last_group_and_the_joiners():
    rounds = {"peer-A": ROUND, "peer-L": ROUND - 1, "peer-B": ROUND - 1, "peer-N": ROUND + 1, "peer-F": ROUND + 2}
    declared = {"peer-F": decl(), "peer-X": decl(expecting=("peer-J2", ME))}
    s = survey("L0M0", ROUND, OURS, ME, declared, rounds, frozenset({"peer-J1"}), frozenset({"peer-L"}))
    assert s.expected == {"peer-A", "peer-L", "peer-J1", "peer-J2"}
    assert s.behind == {"peer-B": ROUND - 1}
    assert s.next_round == {"peer-N"}
    assert s.ahead == ROUND + 2  # declared, but its record is two rounds on: an old declaration


def test_a_declared_holder_one_round_on_is_not_ahead():
    s = survey("L0M0", ROUND, OURS, ME, {"peer-N": decl()}, {"peer-N": ROUND + 1})
    assert s.ahead == -1 and s.next_round == set() and s.expected == set()


def test_a_joiner_whose_record_is_past_our_round_is_not_waited_for():
    s = survey("L0M0", ROUND, OURS, ME, {}, {"peer-J": ROUND + 1}, frozenset({"peer-J"}))
    assert "peer-J" not in s.expected


def test_a_joiner_that_announces_the_module_idle_is_not_waited_for():
    """A stage server that fetched our state but is not driven yet declares no round: neither our own
    joiner nor one another holder's declaration names is expected once its record says idle."""
    declared = {"peer-X": decl(expecting=("peer-J2",))}
    joiners = frozenset({"peer-J1"})
    busy = survey("L0M0", ROUND, OURS, ME, declared, {}, joiners)
    assert {"peer-J1", "peer-J2"} <= busy.expected
    s = survey("L0M0", ROUND, OURS, ME, declared, {}, joiners, idle=frozenset({"peer-J1", "peer-J2"}))
    assert not s.expected & {"peer-J1", "peer-J2"}


def test_a_split_round_waits_only_for_its_bucket():
    peers = [f"peer-{i}" for i in range(16)]
    bucket = (0, 2)
    rounds = {p: ROUND for p in peers}
    s = survey("L0M0", ROUND, OURS, ME, {}, rounds, bucket=bucket)
    assert s.expected == {p for p in peers if in_bucket("L0M0", ROUND, p, bucket)}
    assert set() < s.expected < set(peers)


def test_the_gather_stops_when_everyone_expected_declared_or_at_the_deadline():
    s = survey("L0M0", ROUND, OURS, ME, {"peer-A": decl()}, {"peer-A": ROUND, "peer-B": ROUND})
    assert not gathered("L0M0", ROUND, s, {"peer-A": decl()}, None, now=1.0, deadline=2.0)
    assert gathered("L0M0", ROUND, s, {"peer-A": decl()}, None, now=2.0, deadline=2.0)
    both = {"peer-A": decl(), "peer-B": decl()}
    s = survey("L0M0", ROUND, OURS, ME, both, {"peer-A": ROUND, "peer-B": ROUND})
    assert gathered("L0M0", ROUND, s, both, None, now=1.0, deadline=2.0)
    # in overlap mode a holder one round behind that is still waited for holds the gather open
    assert not gathered("L0M0", ROUND, s, both, {"peer-C": ROUND - 1}, now=1.0, deadline=2.0)
    assert gathered("L0M0", ROUND, s, both, {"peer-C": ROUND - 2}, now=1.0, deadline=2.0)


def test_the_gather_stops_at_once_when_a_holder_is_two_rounds_on():
    s = survey("L0M0", ROUND, OURS, ME, {}, {"peer-A": ROUND, "peer-F": ROUND + 2})
    assert gathered("L0M0", ROUND, s, {}, None, now=1.0, deadline=2.0)


# -- what the matchmaker keeps between reads ------------------------------------------------------

def test_still_waiting_restarts_its_patience_when_the_record_moves_and_reports_a_give_up_once():
    w = still_waiting({"peer-B": 3}, {}, 0.0, 10.0)
    assert w.waiting == {"peer-B": 3} and w.given_up == []
    w = still_waiting({"peer-B": 3}, w.since, 10.0, 10.0)
    assert w.waiting == {} and w.given_up == ["peer-B"]
    w = still_waiting({"peer-B": 3}, w.since, 11.0, 10.0)
    assert w.waiting == {} and w.given_up == []  # reported once
    w = still_waiting({"peer-B": 4}, w.since, 12.0, 10.0)
    assert w.waiting == {"peer-B": 4} and w.since == {"peer-B": (4, 12.0, False)}
    assert still_waiting({}, w.since, 13.0, 10.0).since == {}  # no longer behind: forgotten


def test_vanished_holders_are_those_read_recently_that_neither_left_nor_stayed_silent_too_long():
    out, seen = vanished({}, {"peer-A", "peer-B", "peer-C"}, {}, 100.0, 30.0)
    assert out == {} and seen == {"peer-A": 100.0, "peer-B": 100.0, "peer-C": 100.0}
    out, seen = vanished(seen, {"peer-A"}, {"peer-C": 5}, 110.0, 30.0)
    assert out == {"peer-B": 100.0} and set(seen) == {"peer-A", "peer-B"}
    out, seen = vanished(seen, {"peer-A"}, {}, 130.0, 30.0)
    assert out == {} and set(seen) == {"peer-A"}


def test_a_missed_holder_has_a_valid_record_our_read_did_not_return():
    vanished_ = {"peer-A": 1.0, "peer-B": 1.0, "peer-C": 1.0, "peer-D": 1.0}
    until = {"peer-A": 150.0, "peer-B": 150.0, "peer-C": 90.0, "peer-D": 150.0}
    out, kept = missed(vanished_, {"peer-D": 3}, frozenset({"peer-B"}), until, 100.0)
    assert out == {"peer-A": 50.0}
    assert kept == {"peer-A": 150.0, "peer-B": 150.0}


def test_the_fresh_source_is_a_live_holder_we_fetched_this_round_from_lately():
    assert fresh_source(("peer-S", ROUND, 100.0), ROUND, {"peer-S"}, 120.0, 60.0) == "peer-S"
    assert fresh_source(("peer-S", ROUND, 100.0), ROUND, {"peer-S"}, 160.0, 60.0) == ""
    assert fresh_source(("peer-S", ROUND - 1, 100.0), ROUND, {"peer-S"}, 120.0, 60.0) == ""
    assert fresh_source(("peer-S", ROUND, 100.0), ROUND, set(), 120.0, 60.0) == ""
    assert fresh_source(None, ROUND, {"peer-S"}, 120.0, 60.0) == ""


# -- properties -----------------------------------------------------------------------------------

PEERS = st.sampled_from([f"peer-{c}" for c in "ABCDEFGHJK"])
DIGESTS = st.sampled_from(["d-1", "d-2", "d-3", OURS])
DECLARATIONS = st.dictionaries(PEERS, st.builds(decl, DIGESTS, st.sampled_from([0.0, 1.0, 5.0]),
                                                 st.sampled_from([False, False, False, True])), max_size=8)


@FUZZ
@given(everyone=DECLARATIONS, same_round=st.sets(PEERS, max_size=3), behind=st.dictionaries(PEERS, st.integers(0, 8)),
       vanished_=st.dictionaries(PEERS, st.floats(900.0, 1000.0)), bucket=st.sampled_from([None, (0, 2), (1, 2)]),
       wait_for_behind=st.booleans(), bandwidth=st.sampled_from([0.0, 1.0]), order=st.randoms(use_true_random=False))
def test_the_decision_does_not_depend_on_the_order_declarations_were_read_in(
        everyone, same_round, behind, vanished_, bucket, wait_for_behind, bandwidth, order):
    def shuffled(mapping):
        items = list(mapping.items())
        order.shuffle(items)
        return dict(items)

    kw = dict(now=1000.0, patience=60.0, wait_for_behind=wait_for_behind, in_touch_since=950.0, bucket=bucket,
              bandwidth=bandwidth)
    first = run(read(everyone, same_round=same_round, behind=behind), vanished=vanished_, missed={}, **kw)
    again = run(read(shuffled(everyone), same_round=same_round, behind=shuffled(behind)), vanished=shuffled(vanished_),
                missed={}, **kw)
    assert first == again


@FUZZ
@given(digests=st.dictionaries(PEERS, DIGESTS, min_size=2, max_size=10))
def test_every_holder_of_a_round_keeps_the_same_state_the_one_most_of_them_hold(digests):
    kept = set()
    for me, mine in digests.items():
        fork = resolve_fork(mine, {p: decl(d) for p, d in digests.items() if p != me})
        kept.add(mine if fork is None else fork.kept)
    assert len(kept) == 1
    counts = {d: list(digests.values()).count(d) for d in set(digests.values())}
    # the most held, ties to the larger digest
    assert kept == {max(counts, key=lambda d: (counts[d], d))}


@FUZZ
@given(everyone=DECLARATIONS, bandwidth=st.sampled_from([0.0, 1.0]))
def test_a_group_holds_only_members_of_our_state_and_the_leader_accepts_connections(everyone, bandwidth):
    everyone = {p: decl(d.digest, d.bandwidth) for p, d in everyone.items()}  # none states a formed group
    d = run(read(everyone), bandwidth=bandwidth, in_touch_since=0.0)
    if d.match is None:
        assert d.members and all(everyone[p].digest == OURS for p in d.members)
        assert d.leader in d.members | {ME}
        accepting = {p for p in d.members if everyone[p].bandwidth > 0} | ({ME} if bandwidth > 0 else set())
        assert d.leader == min(accepting)
    elif d.match.group is not None:  # alone: nobody else declared our state
        assert d.match.group.members == (ME,) and not any(x.digest == OURS for x in everyone.values())


@FUZZ
@given(members=st.dictionaries(PEERS, st.sampled_from([0.0, 1.0]), min_size=2, max_size=8))
def test_every_member_of_one_state_picks_the_same_leader(members):
    leaders = set()
    for me, bw in members.items():
        others = {p: decl(bandwidth=b) for p, b in members.items() if p != me}
        d = run(read(others), me=me, bandwidth=bw)
        leaders.add(d.leader if d.match is None else None)
        assert leader_of(me, bw, others) == (d.leader if d.match is None else "")
    assert len(leaders) == 1


def test_a_gather_goes_on_from_the_last_read_only_among_the_last_groups_pushing_members():
    """The sticky group: the last round's group, every live holder the last read returned, each pushing
    us its declarations, and a read younger than the bound; anything else reads the DHT first."""
    group = (ROUND - 1, frozenset({"peer-A", "peer-B"}))
    pushers = {"peer-A", "peer-B", "peer-C"}
    assert sticky(ROUND, group, {"peer-A", "peer-B"}, pushers, 3.0, 10.0)
    assert sticky(ROUND, group, {"peer-A"}, pushers, 3.0, 10.0)  # B's record missed: B is still expected
    assert not sticky(ROUND, group, {"peer-A", "peer-B", "peer-C"}, pushers, 3.0, 10.0)  # another live holder
    assert not sticky(ROUND, group, {"peer-A", "peer-B"}, {"peer-A"}, 3.0, 10.0)  # B does not push to us
    assert not sticky(ROUND, group, {"peer-A", "peer-B"}, pushers, 10.0, 10.0)  # the read is too old
    assert not sticky(ROUND, (ROUND - 2, group[1]), {"peer-A", "peer-B"}, pushers, 3.0, 10.0)  # an older group
    assert not sticky(ROUND, (ROUND - 1, frozenset()), set(), pushers, 3.0, 10.0)  # we were alone
    assert not sticky(ROUND, group, {"peer-A", "peer-B"}, pushers, 3.0, 10.0, bucket=(0, 2))  # a split round


def test_a_sticky_gather_ends_on_pushes_only_when_every_member_declared_our_state():
    rounds = {"peer-A": ROUND - 1, "peer-B": ROUND}
    members = frozenset({"peer-A", "peer-B"})
    everyone = {"peer-A": decl(), "peer-B": decl()}
    seen = survey("L0M0", ROUND, OURS, ME, everyone, rounds, last_group=members)
    assert complete("L0M0", ROUND, seen, everyone, None, OURS)
    one = {"peer-A": decl()}
    assert not complete("L0M0", ROUND, survey("L0M0", ROUND, OURS, ME, one, rounds, last_group=members), one, None,
                        OURS)
    forked = {"peer-A": decl(), "peer-B": decl("d-other")}
    assert not complete("L0M0", ROUND, survey("L0M0", ROUND, OURS, ME, forked, rounds, last_group=members), forked,
                        None, OURS)
    told = {"peer-A": decl(expecting=("peer-N",)), "peer-B": decl()}  # a newcomer that fetched A's state
    assert not complete("L0M0", ROUND, survey("L0M0", ROUND, OURS, ME, told, rounds, last_group=members), told, None,
                        OURS)
    far = {**rounds, "peer-B": ROUND + 2}  # B's declaration is an old one: it is two rounds on
    assert not complete("L0M0", ROUND, survey("L0M0", ROUND, OURS, ME, everyone, far, last_group=members), everyone,
                        None, OURS)
