"""The coordinator's exchange plans on the peer side: a PlanBook says each module round's H and codec,
and holders that switch at the agreed round stay bit-identical (threads sharing a LocalAverager)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from models.config import OuterConfig  # noqa: E402
from peer.compression import get_codec  # noqa: E402
from peer.coordinator_client import ExchangePlan  # noqa: E402
from peer.diloco import PlanBook  # noqa: E402
from peer.averaging import LocalAverager  # noqa: E402
from test_diloco import DENSE, LATTICE, PATHS, assert_replicas_identical, make_worker, run_threads  # noqa: E402

import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_a_plan_applies_from_its_round_and_a_later_one_takes_over():
    book = PlanBook()
    assert book.at("L0M0", 10) is None
    changed = book.update([ExchangePlan("L0M0", 8, "int4", 5, "slow link"), ExchangePlan("L0M0", 4, "int8", 9, "fast")])
    assert len(changed) == 2 and book.version == 1
    assert book.at("L0M0", 4) is None
    assert book.at("L0M0", 5) == (8, "int4") and book.at("L0M0", 8) == (8, "int4")
    assert book.at("L0M0", 9) == (4, "int8") and book.at("embed", 9) is None
    assert book.update([ExchangePlan("L0M0", 8, "int4", 5, "again")]) == [] and book.version == 1  # known: no change


def _plans(book: PlanBook, modules, h: int, codec: str, from_round: int) -> None:
    book.update([ExchangePlan(m, h, codec, from_round, "test plan") for m in modules])


def test_holders_switch_codec_and_h_at_the_agreed_round_and_stay_bit_identical():
    outer = OuterConfig(inner_steps=2, codec="int8", entropy="none", round_timeout=60.0)
    hub = LocalAverager()
    workers = []
    for k, (name, path) in enumerate(PATHS.items()):
        w = make_worker(name, path, LATTICE, outer, hub.member(name, LATTICE.path_modules(path)), seed=k)
        w.opt.plans = PlanBook()  # each peer its own book, filled from its own heartbeat replies
        _plans(w.opt.plans, LATTICE.module_ids(), 4, "int4", 3)
        workers.append(w)
    # rounds 0-2 of H=2 (6 steps), then rounds 3-5 of H=4 (12 steps)
    run_threads([lambda w=w: [w.train_step() for _ in range(6 + 12)] for w in workers])
    assert_replicas_identical(workers, check_local=True)
    for w in workers:
        assert [r.round for r in w.reports] == list(range(6))
        assert [r.inner_steps for r in w.reports] == [2, 2, 2, 4, 4, 4]
        for r in w.reports:
            for mid, m in r.modules.items():
                assert m.applied, (w.name, r.round, mid, m.reason)
                numel = sum(p.numel() for p in w.mods[mid].parameters())
                codec = "int8" if r.round < 3 else "int4"
                if m.group_size > 1:
                    assert m.bytes_sent == get_codec(codec).encoded_size(numel), (w.name, r.round, mid)


def test_a_holder_without_the_plan_cannot_average_the_switched_round():
    """Why the round must be agreed: a holder on the old codec is refused by the group's reducer."""
    outer = OuterConfig(inner_steps=2, codec="int8", entropy="none", round_timeout=3.0)
    hub = LocalAverager()
    planned = make_worker("a", (0,), DENSE, outer, hub.member("a", DENSE.path_modules((0,))), seed=0)
    stale = make_worker("b", (0,), DENSE, outer, hub.member("b", DENSE.path_modules((0,))), seed=1)
    planned.opt.plans = PlanBook()
    _plans(planned.opt.plans, DENSE.module_ids(), 2, "int4", 1)
    run_threads([lambda w=w: [w.train_step() for _ in range(4)] for w in (planned, stale)])
    for w in (planned, stale):
        assert all(m.applied and m.group_size == 2 for m in w.reports[0].modules.values())
    # round 1: the holders' parts are in two codecs, so no group of two averages it
    reasons = [m.reason for w in (planned, stale) for m in w.reports[1].modules.values()]
    assert any("codec" in why for why in reasons), reasons
    assert all(m.group_size < 2 for w in (planned, stale) for m in w.reports[1].modules.values())


@pytest.mark.parametrize("overlap", [False, True])
def test_round_length_is_the_largest_planned_h_among_the_modules(overlap):
    outer = OuterConfig(inner_steps=2, codec="int8", round_timeout=10.0, overlap=overlap)
    w = make_worker("solo", (0,), DENSE, outer, None, seed=0)
    assert w.opt.round_steps() == 2
    w.opt.plans = PlanBook()
    w.opt.plans.update([ExchangePlan("L0M0", 6, "int8", 0, "one module's plan")])
    assert w.opt.round_steps() == 6  # the modules without a plan keep 2; the round lasts the longest


def test_a_path_peer_exchanges_behind_its_next_round_where_a_plan_says_so_and_replicas_stay_identical():
    """Worker a's plans run every module of its path behind the next round from round 2 (no H and
    codec kept its exchanges within the budget); the others have no such plan. a's rounds 0 and 1
    are waited for, its later ones run behind the next round's steps; every holder of a module ends
    with the same global copy and momentum, overlapped member or not."""
    outer = OuterConfig(inner_steps=2, codec="int8", entropy="none", round_timeout=60.0)
    hub = LocalAverager()
    workers = []
    for k, (name, path) in enumerate(PATHS.items()):
        w = make_worker(name, path, LATTICE, outer, hub.member(name, LATTICE.path_modules(path)), seed=k)
        w.opt.overlap_beside_sparse = True  # a path peer (peer.node.trainer)
        w.opt.plans = PlanBook()
        workers.append(w)
    a = workers[0]
    a.opt.plans.update([ExchangePlan(m, 2, "int8", 2, "test plan", overlap=True) for m in a.opt.module_ids])
    assert not a.opt.plans.overlap_at(a.opt.module_ids[0], 1) and a.opt.plans.overlap_at(a.opt.module_ids[0], 2)

    def train(w):
        while w.opt.round < 6:  # an overlapped round may take more than H steps (it trains through waits)
            w.train_step()
        report = w.opt.flush()
        if report is not None:
            w.reports.append(report)

    run_threads([lambda w=w: train(w) for w in workers])
    assert [r.overlap for r in a.reports] == [False, False, True, True, True, True]
    assert [r.round for r in a.reports] == list(range(6)) and all(r.applied for r in a.reports)
    for w in workers[1:]:
        assert not any(r.overlap for r in w.reports) and [r.round for r in w.reports] == list(range(6))
    assert_replicas_identical(workers, check_local=False)
    # an overlapped round says what its exchanges would have blocked: the planner's measure of it
    assert all(r.blocking_seconds == max(m.exchange_seconds for m in r.modules.values()) > 0 for r in a.reports[2:])
    for w in workers:
        w.opt.close()
