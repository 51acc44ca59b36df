"""Re-syncing a member that missed a round (peer/diloco/resync.py): in overlap mode the re-sync runs between
the completed exchange and the next launch, so the member's next exchange declares the group's state;
a state behind the member's next round is never taken."""

from __future__ import annotations

import torch
from torch import nn

from models.config import InnerConfig, OuterConfig
from peer.averaging import AverageResult
from peer.diloco import DiLoCoOptimizer
from peer.outer import ModuleState
from peer.outer import state_digest
from peer.diloco import install_resync


class Scripted:
    """Round 0 fails as a lost fork; later rounds return our own delta as the mean."""

    def __init__(self):
        self.calls: list[tuple[int, str]] = []

    def average(self, module_id, round_no, tensors, weight, codec, timeout, digest=""):
        self.calls.append((round_no, digest))
        if round_no == 0:
            return AverageResult(None, None, 0, [], 0, 0, reason="forked: 2 of 3 hold another state", adopt="ab" * 8)
        own = [t.clone() for t in tensors]
        return AverageResult(own, [t.clone() for t in tensors], 1, ["me"], 0, 0)


def _opt(averager, overlap: bool = True):
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    outer = OuterConfig(inner_steps=2, overlap=overlap, codec="none", round_timeout=5.0)
    return model, DiLoCoOptimizer({"L0M0": model}, InnerConfig(lr=1e-2, warmup_steps=0), outer, averager=averager,
                                  train_through_waits=False)  # rounds end at their step count exactly


def _steps(model, opt, n):
    for _ in range(n):
        loss = model(torch.randn(4, 3)).pow(2).sum()
        loss.backward()
        opt.step(tokens=4)
        opt.zero_grad()


def test_overlap_member_re_syncs_before_its_next_exchange():
    averager = Scripted()
    model, opt = _opt(averager)
    group = ModuleState([torch.full((2, 3), 0.5), torch.full((2,), -0.25)], [torch.zeros(2, 3), torch.zeros(2)], 1)
    asked = []

    def fetch(mid, like, accept=None, min_round=-1):
        asked.append(mid)
        return group if group.round_no >= min_round and (accept is None or not accept(group)) else None

    install_resync(opt, fetch)
    _steps(model, opt, 4)  # round 0 launched, then completed (failed) and round 1 launched
    assert asked == ["L0M0"]
    served = opt.module_state("L0M0")  # round 1 in flight: the state served is the group's
    assert served.round_no == 1 and served.digest == group.digest
    opt.flush()
    assert [r for r, _ in averager.calls] == [0, 1]
    assert averager.calls[1][1] == group.digest == state_digest(group.global_params, group.momentum)


def test_a_state_behind_our_next_round_is_not_taken():
    averager = Scripted()
    model, opt = _opt(averager)
    old = ModuleState([torch.zeros(2, 3), torch.zeros(2)], [torch.zeros(2, 3), torch.zeros(2)], 0)

    def fetch(mid, like, accept=None, min_round=-1):
        return old if old.round_no >= min_round and (accept is None or not accept(old)) else None

    install_resync(opt, fetch)
    before = [p.detach().clone() for p in model.parameters()]
    _steps(model, opt, 4)
    opt.flush()
    assert averager.calls[1][1] != old.digest  # launched with its own state, not the stale one
    assert not all(torch.equal(a, b) for a, b in zip(model.parameters(), before))


def test_a_resync_without_a_wait_tries_once_where_the_default_polls_the_group():
    """A stage server installs the re-sync with ``wait=0`` (its step runs inside a request it
    serves): after a failed round it asks the holders once and goes on, where the default polls
    them for up to ``0.2 * round_timeout`` (1 s here) for the group's state."""
    asked = {}
    for wait in (None, 0.0):
        averager = Scripted()
        model, opt = _opt(averager)
        calls = asked[wait] = []

        def fetch(mid, like, accept=None, min_round=-1, calls=calls):
            calls.append(mid)
            return None  # no holder has the group's state (the group is gone)

        install_resync(opt, fetch, wait=wait)
        _steps(model, opt, 4)  # round 0 launched, then completed (failed) and launched again
        opt.flush()
        assert [r for r, _ in averager.calls] == [0, 0]  # nobody went past it: round 0 again, either way
    assert asked[0.0] == ["L0M0"]
    assert len(asked[None]) >= 2, asked  # polled every 0.5 s for about 1 s


def test_after_a_round_each_module_is_announced_in_the_background_with_its_digest():
    """``resync_after_round`` announces each module's next round and state digest without making the
    training loop wait on a DHT store (one per module and round, each slow on a busy host: a large share
    of the compute, as ``bench.utilization`` measures)."""
    from peer.diloco import resync_after_round

    class Announcing(Scripted):
        def __init__(self):
            super().__init__()
            self.held: list[tuple[str, int, bool, str]] = []

        def average(self, module_id, round_no, tensors, weight, codec, timeout, digest=""):
            own = [t.clone() for t in tensors]
            return AverageResult(own, [t.clone() for t in tensors], 1, ["me"], 0, 0)

        def hold(self, module_id, round_no, wait=True, digest=""):
            self.held.append((module_id, round_no, wait, digest))

    averager = Announcing()
    model, opt = _opt(averager)
    report = None
    while report is None:
        model(torch.ones(1, 3)).sum().backward()
        report = opt.step()
        opt.zero_grad()
    resync_after_round(opt, report, averager, None)
    assert averager.held == [("L0M0", opt.module_round("L0M0"), False, opt.module_digest("L0M0"))]
    assert opt.module_digest("L0M0")


class Behind:
    """Every round fails behind holders at round 7 (``left``: holders that left; else live ones)."""

    def __init__(self, left: bool):
        self.left = left
        self.calls: list[int] = []

    def average(self, module_id, round_no, tensors, weight, codec, timeout, digest=""):
        self.calls.append(round_no)
        if round_no >= 8:  # past the holders that left: alone, our own delta is the mean
            return AverageResult([t.clone() for t in tensors], [t.clone() for t in tensors], 1, ["me"], 0, 0)
        return AverageResult(None, None, 0, [], 0, 0, reason="behind: holders at round 7", ahead=7,
                             ahead_left=self.left)


def test_an_overlap_member_behind_the_group_keeps_its_round_number_until_it_re_syncs():
    """A failed round leaves our state at that round in overlap mode too: its number stays, or our
    un-averaged state would be labelled (snapshots, state served) with rounds the group applied."""
    averager = Behind(left=False)
    model, opt = _opt(averager)
    install_resync(opt, lambda mid, like, accept=None, min_round=-1: None)  # nobody sends a state (yet)
    _steps(model, opt, 8)  # four rounds ended: each behind, each re-launched at round 0
    assert opt.module_state("L0M0").round_no == 0
    opt.flush()
    assert averager.calls == [0, 0, 0, 0], averager.calls
    assert opt.module_state("L0M0").round_no == 0


def test_holders_that_left_ahead_of_us_with_no_state_to_send_leave_us_numbered_after_them():
    """The holders at round 7 left and no live holder or archive sends their state: our state goes on
    as the module's from round 8 (never under a round number they applied), unchanged, local progress
    kept, instead of stalling until their withdrawals expire."""
    averager = Behind(left=True)
    model, opt = _opt(averager)
    install_resync(opt, lambda mid, like, accept=None, min_round=-1: None)
    _steps(model, opt, 2)  # round 0 launched
    global_before = [g.clone() for g in opt.module_state("L0M0").global_params]
    _steps(model, opt, 2)  # round 0 failed behind the holders that left: renumbered, round 8 launched
    state = opt.module_state("L0M0")  # round 8 in flight: the state it averages
    assert state.round_no == 8 and all(torch.equal(a, b) for a, b in zip(state.global_params, global_before))
    opt.flush()
    assert averager.calls == [0, 8], averager.calls
    assert opt.module_state("L0M0").round_no == 9  # round 8 applied alone


def test_without_overlap_holders_that_left_ahead_renumber_after_the_failed_round():
    from peer.diloco import resync_after_round

    averager = Behind(left=True)
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    outer = OuterConfig(inner_steps=2, overlap=False, codec="none", round_timeout=5.0)
    opt = DiLoCoOptimizer({"L0M0": model}, InnerConfig(lr=1e-2, warmup_steps=0), outer, averager=averager)
    report = None
    for _ in range(2):
        model(torch.randn(4, 3)).pow(2).sum().backward()
        report = opt.step(tokens=4) or report
        opt.zero_grad()
    assert report is not None and report.modules["L0M0"].ahead == 7 and report.modules["L0M0"].ahead_left
    assert opt.module_round("L0M0") == 0  # not applied: still ready for round 0
    resync_after_round(opt, report, averager, lambda mid, like, accept=None, min_round=-1: None)
    assert opt.module_round("L0M0") == 8


def test_an_overlap_round_the_whole_group_failed_is_launched_again_without_waiting():
    """Every member failed round 0 (its number went back on each): a holder at round 0 with our state
    ends the re-sync's poll at once, and round 0 is launched again, by all alike."""
    averager = Scripted()
    model, opt = _opt(averager)
    asked = []

    def fetch(mid, like, accept=None, min_round=-1):
        asked.append(mid)
        same = opt.module_state(mid)  # another member's copy: identical, at our round
        assert accept is not None and accept(same)  # not taken (nothing to take), but seen
        return None

    install_resync(opt, fetch, wait=60.0)
    _steps(model, opt, 4)
    opt.flush()
    assert asked == ["L0M0"]  # one ask, not a minute of polling
    assert [r for r, _ in averager.calls] == [0, 0]


class LateGroup:
    """Round 0's group began without us (we are behind it, ``ahead`` 1), and its members gather round 1
    while we re-sync (``gathering``): the round we now hold. ``late_fails``: that group began too
    before our late declaration reached it."""

    def __init__(self, gathering: bool, late_fails: bool = False):
        self.gathering_now = gathering
        self.late_fails = late_fails
        self.calls: list[tuple[int, str, float]] = []
        self.asked: list[tuple[str, int, str]] = []
        self.group = ModuleState([torch.full((2, 3), 0.5), torch.full((2,), -0.25)],
                                 [torch.zeros(2, 3), torch.zeros(2)], 1)

    def average(self, module_id, round_no, tensors, weight, codec, timeout, digest=""):
        self.calls.append((round_no, digest, weight))
        if round_no == 0 or (round_no == 1 and self.late_fails):
            return AverageResult(None, None, 0, [], 0, 0, reason="behind: leader began this round's group without us",
                                 ahead=round_no + 1)
        own = [t.clone() for t in tensors]
        return AverageResult(own, [t.clone() for t in tensors], 2, ["me", "them"], 0, 0)

    def gathering(self, module_id, round_no, digest):
        self.asked.append((module_id, round_no, digest))
        return self.gathering_now

    def hold(self, module_id, round_no, wait=True, digest=""):
        pass

    def fetch(self, mid, like, accept=None, min_round=-1):
        return self.group if self.group.round_no >= min_round else None


def _one_round(model, opt):
    report = None
    while report is None:
        model(torch.randn(4, 3)).pow(2).sum().backward()
        report = opt.step(tokens=4)
        opt.zero_grad()
    return report


def test_a_member_behind_its_group_joins_the_round_the_group_still_gathers_at_once():
    """Our round 0 failed behind the group, which gathers round 1 as we re-sync to it: we average
    round 1 with it now, our failed round's local progress and tokens as our part, from the group's
    state; our next round is round 2, the group's next, instead of round 1 late again."""
    from peer.diloco import resync_after_round

    group = LateGroup(gathering=True)
    model, opt = _opt(group, overlap=False)
    report = _one_round(model, opt)
    resync_after_round(opt, report, group, group.fetch)
    assert group.asked == [("L0M0", 1, group.group.digest)]
    assert [r for r, _, _ in group.calls] == [0, 1]  # round 1 averaged between our rounds
    assert group.calls[1][1] == group.group.digest  # from the group's state
    assert group.calls[1][2] == report.modules["L0M0"].tokens  # weighted by the failed round's tokens
    assert opt.module_round("L0M0") == 2
    _one_round(model, opt)
    assert [r for r, _, _ in group.calls] == [0, 1, 2]


def test_a_member_behind_a_group_that_does_not_gather_waits_for_its_next_round():
    """The group does not gather the round we re-synced to (its members still compute it): nothing
    is averaged between rounds, and our next round declares it in time, as before."""
    from peer.diloco import resync_after_round

    group = LateGroup(gathering=False)
    model, opt = _opt(group, overlap=False)
    resync_after_round(opt, _one_round(model, opt), group, group.fetch)
    assert [r for r, _, _ in group.calls] == [0]
    assert opt.module_round("L0M0") == 1
    _one_round(model, opt)
    assert [r for r, _, _ in group.calls] == [0, 1]


def test_a_late_join_that_finds_the_group_begun_re_syncs_again_and_a_stage_server_never_joins_late():
    from peer.diloco import resync_after_round

    group = LateGroup(gathering=True, late_fails=True)
    model, opt = _opt(group, overlap=False)
    asked = []

    def fetch(mid, like, accept=None, min_round=-1):
        asked.append(min_round)
        return group.fetch(mid, like, accept, min_round)

    resync_after_round(opt, _one_round(model, opt), group, fetch)
    assert [r for r, _, _ in group.calls] == [0, 1] and asked == [1, 2]  # late join failed: re-synced again
    assert opt.module_round("L0M0") == 1  # nobody sent round 2: our round number stays where it failed

    server = LateGroup(gathering=True)
    model, opt = _opt(server, overlap=False)
    resync_after_round(opt, _one_round(model, opt), server, server.fetch, join_late=False)
    assert server.asked == [] and [r for r, _, _ in server.calls] == [0]
