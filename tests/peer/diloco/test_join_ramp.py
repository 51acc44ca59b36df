"""A newcomer's weight in its groups ramps up over its first rounds (peer.diloco.ramp_factor), the same
rule for every role: a member that began later than its group weighs less, members that began together
weigh as their tokens, and every replica applies the same bytes."""

from __future__ import annotations

import pytest
import torch

from models.config import OuterConfig
from models.errors import ConfigError
from peer.averaging import LocalAverager
from peer.diloco import JOIN_RAMP_ROUNDS, DiLoCoOptimizer, ramp_factor
from test_diloco import BATCH, DENSE, SEQ, assert_replicas_identical, make_worker, run_threads

TOKENS = 2.0 * BATCH * SEQ
"""A round's tokens: 2 inner steps of one batch."""


def test_ramp_factor_rises_by_equal_steps_to_one():
    assert [ramp_factor(r, 4) for r in range(7)] == [0.2, 0.4, 0.6, 0.8, 1.0, 1.0, 1.0]
    assert ramp_factor(0, 0) == 1.0 and ramp_factor(-3, 2) == pytest.approx(1 / 3)
    assert JOIN_RAMP_ROUNDS > 0


def _worker(name: str, hub: LocalAverager, outer: OuterConfig, ramp: int, seed: int):
    w = make_worker(name, (0,), DENSE, outer, hub.member(name), seed=seed)
    w.opt.join_ramp_rounds = ramp
    return w


def test_a_newcomer_weighs_less_than_the_veteran_until_its_ramp_is_done():
    outer = OuterConfig(inner_steps=2, codec="int8", round_timeout=60.0)
    hub = LocalAverager()
    veteran = _worker("v", hub, outer, ramp=3, seed=1)
    for _ in range(4 * outer.inner_steps):  # alone: 4 rounds, its ramp done
        veteran.train_step()
    assert veteran.opt.rounds_here == 4 and hub.round_weights("L0M0", 0) == {"v": TOKENS * 0.25}
    newcomer = _worker("n", hub, outer, ramp=3, seed=2)
    for mid in newcomer.opt.module_ids:  # joins mid-run: loads the group's state
        st = veteran.opt.module_state(mid)
        newcomer.opt.load_module_state(mid, st.global_params, st.momentum, st.round_no)
    rounds = 5
    run_threads([lambda w=w: [w.train_step() for _ in range(rounds * outer.inner_steps)] for w in (veteran, newcomer)])
    for k in range(rounds):
        assert hub.round_weights("L0M0", 4 + k) == {"v": TOKENS, "n": TOKENS * ramp_factor(k, 3)}, k
        assert all(m.tokens == TOKENS for m in newcomer.reports[k].modules.values())  # reports keep real tokens
    assert_replicas_identical([veteran, newcomer], check_local=True)


def test_members_that_began_together_weigh_as_their_tokens_relative_to_each_other():
    outer = OuterConfig(inner_steps=2, codec="int8", round_timeout=60.0)
    hub = LocalAverager()
    a, b = _worker("a", hub, outer, ramp=4, seed=1), _worker("b", hub, outer, ramp=4, seed=2)
    run_threads([lambda w=w: [w.train_step() for _ in range(2 * outer.inner_steps)] for w in (a, b)])
    assert hub.round_weights("L0M0", 0) == {"a": TOKENS * 0.2, "b": TOKENS * 0.2}
    assert hub.round_weights("L0M0", 1) == {"a": TOKENS * 0.4, "b": TOKENS * 0.4}
    assert_replicas_identical([a, b], check_local=True)


def test_a_ramp_of_zero_weighs_every_round_by_its_tokens_and_a_bad_ramp_is_refused():
    outer = OuterConfig(inner_steps=2, codec="int8", round_timeout=60.0)
    hub = LocalAverager()
    a = _worker("a", hub, outer, ramp=0, seed=1)
    a.train_step(), a.train_step()
    assert hub.round_weights("L0M0", 0) == {"a": TOKENS}
    params = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(ConfigError, match="join_ramp_rounds"):
        DiLoCoOptimizer({"L0M0": params}, torch.optim.SGD(params, lr=0.1), outer, join_ramp_rounds=-1)
