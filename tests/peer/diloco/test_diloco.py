"""The DiLoCo wrapper with in-process averaging: workers are threads sharing a LocalAverager.

Tiny toy modules stand in for the lattice (an embedding, one residual block per lattice module, a
head); every path learns its own modular-arithmetic map, so modules shared by several paths see
different data, as in DiPaCo.
"""

from __future__ import annotations

import copy
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import pytest
import torch
from torch import nn

from peer.localnet import wait_for
from models.config import InnerConfig, LatticeConfig, OuterConfig
from models.errors import ConfigError
from peer.averaging import LocalAverager
from peer.compression import get_codec
from peer.diloco import DiLoCoOptimizer, RoundReport
from peer.diloco.optimizer import PACED_MIN_SHARE

VOCAB, DIM, BATCH, SEQ = 16, 16, 8, 8
LATTICE = LatticeConfig(levels=2, modules_per_level=2)
DENSE = LatticeConfig(levels=1, modules_per_level=1)


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.lin(h))  # (B, T, D)


def build_module(cfg: LatticeConfig, mid: str) -> nn.Module:
    """The same weights for the same module id on every worker (seeded by its lattice index)."""
    kind = cfg.module_kind(mid)
    mod = nn.Embedding(VOCAB, DIM) if kind == "embed" else nn.Linear(DIM, VOCAB) if kind == "head" else Block()
    g = torch.Generator().manual_seed(1000 + cfg.module_ids().index(mid))
    with torch.no_grad():
        for p in mod.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return mod


@dataclass
class Worker:
    """One simulated peer: its path's modules, its optimizer, its data stream."""

    name: str
    path: tuple[int, ...]
    mods: dict[str, nn.Module]
    opt: DiLoCoOptimizer
    gen: torch.Generator
    now: list[float] = field(default_factory=lambda: [0.0])
    losses: list[float] = field(default_factory=list)
    reports: list[RoundReport] = field(default_factory=list)

    def forward_loss(self) -> torch.Tensor:
        x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=self.gen)  # (B, T)
        shift = 1 + sum((i + 1) * (level + 2) for level, i in enumerate(self.path))
        y = (x * 3 + shift) % VOCAB  # each path its own map
        ids = list(self.mods)
        h = self.mods[ids[0]](x)  # (B, T, D)
        for mid in ids[1:-1]:
            h = self.mods[mid](h)
        logits = self.mods[ids[-1]](h)  # (B, T, V)
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))

    def train_step(self, tick: float = 0.0, fault: Optional[Callable[[], None]] = None) -> Optional[RoundReport]:
        loss = self.forward_loss()
        loss.backward()
        if fault is not None:
            fault()
        self.now[0] += tick
        report = self.opt.step(tokens=BATCH * SEQ)
        self.opt.zero_grad()
        self.losses.append(loss.item())
        if report is not None:
            self.reports.append(report)
        return report


def make_worker(name, path, cfg, outer, averager, seed, lr=1e-2, module_ids=None, clocked=False,
                train_through_waits=True) -> Worker:
    mids = module_ids or cfg.path_modules(path)
    mods = {mid: build_module(cfg, mid) for mid in mids}
    params = [p for m in mods.values() for p in m.parameters()]
    now = [0.0]
    clock: Callable[[], float] = (lambda: now[0]) if clocked else time.monotonic
    opt = DiLoCoOptimizer(
        modules=mods, inner=torch.optim.AdamW(params, lr=lr), outer=outer,
        lattice=cfg if module_ids is None else None, averager=averager, clock=clock,
        train_through_waits=train_through_waits,
    )
    return Worker(name, path, mods, opt, torch.Generator().manual_seed(seed), now)


def run_threads(fns: list[Callable[[], None]], join_timeout: float = 120.0) -> None:
    errors: list[BaseException] = []

    def wrap(fn):
        def target():
            try:
                fn()
            except BaseException as e:  # re-raised in the test thread
                errors.append(e)

        return target

    threads = [threading.Thread(target=wrap(fn)) for fn in fns]
    for t in threads:
        t.start()
    for t in threads:
        t.join(join_timeout)
        assert not t.is_alive(), "a worker thread hung"
    if errors:
        raise errors[0]


def holders(workers: list[Worker]) -> dict[str, list[Worker]]:
    out: dict[str, list[Worker]] = {}
    for w in workers:
        for mid in w.opt.module_ids:
            out.setdefault(mid, []).append(w)
    return out


def assert_replicas_identical(workers: list[Worker], check_local: bool) -> None:
    for mid, ws in holders(workers).items():
        ref = ws[0].opt.module_state(mid)
        assert any(float(b.abs().max()) > 0 for b in ref.momentum), f"{mid}: no outer step happened"
        for w in ws:
            st = w.opt.module_state(mid)
            assert st.round_no == ref.round_no
            assert all(torch.equal(a, b) for a, b in zip(st.global_params, ref.global_params)), (mid, w.name)
            assert all(torch.equal(a, b) for a, b in zip(st.momentum, ref.momentum)), (mid, w.name)
            if check_local:
                assert all(torch.equal(p.detach(), g) for p, g in zip(w.mods[mid].parameters(), st.global_params))


# 3 workers on a 2x2 lattice: embed/head shared by all, L0M0 by w0+w1, L1M1 by w1+w2, L0M1 and L1M0 alone
PATHS = {"w0": (0, 0), "w1": (0, 1), "w2": (1, 1)}


def lattice_workers(outer: OuterConfig, **kw) -> tuple[LocalAverager, list[Worker]]:
    hub = LocalAverager()
    workers = [
        make_worker(name, path, LATTICE, outer, hub.member(name, LATTICE.path_modules(path)), seed=k, **kw)
        for k, (name, path) in enumerate(PATHS.items())
    ]
    return hub, workers


def test_three_workers_on_a_2x2_lattice_stay_bit_identical_with_int8():
    outer = OuterConfig(inner_steps=5, codec="int8", round_timeout=60.0)
    hub, workers = lattice_workers(outer)
    rounds = 6
    run_threads([lambda w=w: [w.train_step() for _ in range(rounds * outer.inner_steps)] for w in workers])
    assert_replicas_identical(workers, check_local=True)
    expected_group = {mid: len(ws) for mid, ws in holders(workers).items()}
    assert expected_group == {"embed": 3, "head": 3, "L0M0": 2, "L1M1": 2, "L0M1": 1, "L1M0": 1}
    for w in workers:
        assert [r.round for r in w.reports] == list(range(rounds))
        for r in w.reports:
            assert list(r.modules) == LATTICE.path_modules(w.path)  # the fixed averaging order
            for mid, m in r.modules.items():
                assert m.applied and m.group_size == expected_group[mid] and m.tokens == 5 * BATCH * SEQ
                # what we sent and the average we got back: int8 with the zstd stage, whose sizes vary by value
                bound = get_codec("int8").encoded_size(sum(p.numel() for p in w.mods[mid].parameters())) + 1
                assert 0 < m.bytes_sent <= bound and 0 < m.bytes_received <= bound
        assert sum(w.losses[-5:]) < sum(w.losses[:5]) * 0.8
    assert hub.round_weights("L1M1", rounds - 1) == {"w1": 5.0 * BATCH * SEQ, "w2": 5.0 * BATCH * SEQ}


def test_overlap_mode_stays_bit_identical_and_loss_falls():
    outer = OuterConfig(inner_steps=5, codec="int8", round_timeout=60.0, overlap=True)
    hub, workers = lattice_workers(outer, train_through_waits=False)  # rounds of exactly 5 steps
    rounds = 6
    # two steps past the last boundary: progress made while round 5's exchange is in flight
    run_threads([lambda w=w: [w.train_step() for _ in range(rounds * outer.inner_steps + 2)] for w in workers])
    flushed = [w.opt.flush() for w in workers]
    for w, f in zip(workers, flushed):
        # round 0's boundary only launches an exchange; each round's report comes once its exchange is
        # applied (a step after it returned, or at the next boundary), the last one's maybe at the flush
        reports = w.reports + ([f] if f is not None else [])
        assert [r.round for r in reports] == list(range(rounds))
        assert all(m.applied for r in reports for m in r.modules.values())
        assert [r.inner_steps for r in reports] == [outer.inner_steps] * rounds
    assert_replicas_identical(workers, check_local=False)
    for w in workers:
        assert sum(w.losses[-5:]) < sum(w.losses[:5]) * 0.8
        # the progress made during the last exchange is kept on top of the new global copy
        block = w.opt.module_ids[1]
        local, global_ = w.mods[block].parameters(), w.opt.module_state(block).global_params
        assert any(not torch.equal(p.detach(), g) for p, g in zip(local, global_))
        w.opt.close()


def test_nan_delta_is_never_sent_and_local_progress_is_kept():
    outer = OuterConfig(inner_steps=2, codec="int8", round_timeout=1.0)
    hub = LocalAverager()
    a = make_worker("a", (0,), DENSE, outer, hub.member("a"), seed=1)
    b = make_worker("b", (0,), DENSE, outer, hub.member("b"), seed=2)
    init = [p.detach().clone() for p in b.mods["L0M0"].parameters()]

    def poison() -> None:
        with torch.no_grad():
            next(b.mods["L0M0"].parameters())[0, 0] = float("nan")

    def run_b():
        b.train_step()
        b.train_step(fault=poison)  # the fault fires at the round's last inner step

    run_threads([lambda: [a.train_step() for _ in range(2)], run_b])
    rb, ra = b.reports[0].modules, a.reports[0].modules
    assert not rb["L0M0"].applied and "NaN" in rb["L0M0"].reason and rb["L0M0"].bytes_sent == 0
    assert hub.round_weights("L0M0", 0) == {"a": 2.0 * BATCH * SEQ}  # b never contributed
    assert ra["L0M0"].applied and ra["L0M0"].group_size == 1 and "dropped absent b" in ra["L0M0"].reason
    assert rb["embed"].applied and rb["head"].applied and ra["embed"].group_size == 2
    assert all(torch.equal(g, i) for g, i in zip(b.opt.module_state("L0M0").global_params, init))
    assert math.isnan(next(b.mods["L0M0"].parameters())[0, 0].item())  # local state untouched
    # its global copy is still round 0's, and so is its round number: the group is ahead, so b
    # re-syncs from it before averaging again (never labelling a stale copy with a round it missed)
    assert b.opt.module_round("L0M0") == 0
    for mid in ("embed", "head"):
        sa, sb = a.opt.module_state(mid), b.opt.module_state(mid)
        assert all(torch.equal(x, y) for x, y in zip(sa.global_params, sb.global_params))


def test_time_bounded_rounds_give_the_slow_worker_a_smaller_weight():
    outer = OuterConfig(inner_steps=10**6, round_seconds=1.0, codec="int8", round_timeout=60.0)
    hub = LocalAverager()
    fast = make_worker("fast", (0,), DENSE, outer, hub.member("fast"), seed=1, clocked=True)
    slow = make_worker("slow", (0,), DENSE, outer, hub.member("slow"), seed=2, clocked=True)

    def run(w: Worker, tick: float) -> None:
        while len(w.reports) < 3:
            w.train_step(tick)

    run_threads([lambda: run(fast, 0.125), lambda: run(slow, 0.5)])
    assert [r.inner_steps for r in fast.reports] == [8, 8, 8] and [r.inner_steps for r in slow.reports] == [2, 2, 2]
    for r in range(3):
        assert hub.round_weights("L0M0", r) == {"fast": 8.0 * BATCH * SEQ, "slow": 2.0 * BATCH * SEQ}
    assert slow.reports[0].modules["L0M0"].tokens == 2 * BATCH * SEQ
    assert_replicas_identical([fast, slow], check_local=True)


class _Paced:
    """A member averager that reports another holder waiting for ``waiting_round`` (as
    ``NetAverager.others_waiting`` does from the DHT)."""

    def __init__(self, member, waiting_round: int) -> None:
        self.member, self.waiting_round, self.asked = member, waiting_round, []

    def average(self, *args, **kw):
        return self.member.average(*args, **kw)

    def others_waiting(self, rounds) -> bool:
        self.asked.append(dict(rounds))
        return self.waiting_round in rounds.values()


class _Gated:
    """A member averager whose exchanges of round ``round_no`` return only once ``release`` is set."""

    def __init__(self, member, round_no: int) -> None:
        self.member, self.round_no, self.release = member, round_no, threading.Event()

    def average(self, module_id, round_no, *args, **kw):
        if round_no == self.round_no:
            assert self.release.wait(60), "never released"
        return self.member.average(module_id, round_no, *args, **kw)


def _in_flight(w: Worker) -> bool:
    return any(st.pending is not None and st.pending.future is not None and not st.pending.future.done()
               for st in w.opt._modules.values())


def test_overlap_trains_through_a_wait_for_the_last_exchange_and_ends_the_round_once_it_is_done():
    """Round 0's exchange is held back: round 1 does not end after its 3 steps but goes on stepping
    (nothing blocks the training loop), and ends at the first step after the exchange returns, with
    those extra steps' tokens as its weight."""
    outer = OuterConfig(inner_steps=3, codec="int8", round_timeout=60.0, overlap=True)
    hub = LocalAverager()
    gated = _Gated(hub.member("a"), round_no=0)
    w = make_worker("a", (0,), DENSE, outer, gated, seed=1)
    for _ in range(3 + 3 + 1):  # round 0, round 1's steps, one more
        assert w.train_step() is None
    assert w.opt.round == 1 and _in_flight(w)
    gated.release.set()
    wait_for(lambda: not _in_flight(w), 30, "round 0's exchange to return")
    report = w.train_step()  # the first step after it: round 1 ends, round 0's average is applied
    assert report is not None and report.round == 0 and report.applied
    assert w.opt.round == 2
    w.opt.flush()
    assert hub.round_weights("L0M0", 1) == {"a": 5.0 * BATCH * SEQ}  # 3 steps + 2 while waiting
    w.opt.close()


def test_overlap_applies_a_round_at_the_first_step_after_its_exchange_returned():
    """Round 0's exchange is held back past round 1's first step; once it returned, the next step
    applies it (its report, of round 0's 5 steps, comes then, mid-round 1) and keeps the local
    progress made meanwhile on top of the new global copy; round 1 goes on to its own end."""
    outer = OuterConfig(inner_steps=5, codec="int8", round_timeout=60.0, overlap=True)
    hub = LocalAverager()
    gated = _Gated(hub.member("a"), round_no=0)
    w = make_worker("a", (0,), DENSE, outer, gated, seed=1)
    for _ in range(5 + 1):  # round 0, then round 1's first step with round 0 in flight
        assert w.train_step() is None
    assert w.opt.round == 1 and _in_flight(w)
    gated.release.set()
    wait_for(lambda: not _in_flight(w), 30, "round 0's exchange to return")
    report = w.train_step()
    assert report is not None and report.round == 0 and report.applied and report.inner_steps == 5
    assert w.opt.round == 1 and w.opt._steps_in_round == 2 and w.opt.module_round("L0M0") == 1
    state = w.opt.module_state("L0M0")
    assert any(not torch.equal(p.detach(), g) for p, g in zip(w.mods["L0M0"].parameters(), state.global_params)), \
        "the two steps of round 1 were not kept on top of the new global copy"
    assert w.opt.flush() is None  # nothing left in flight
    for _ in range(3):  # round 1's end launches its exchange, whose report comes later
        assert w.train_step() is None
    report = w.opt.flush()
    assert report is not None and report.round == 1 and report.applied and report.inner_steps == 5
    w.opt.close()


@pytest.mark.parametrize("fill", [True, False], ids=["through", "wait"])
def test_a_round_trained_through_a_wait_has_at_most_twice_its_steps(fill):
    """The exchange stays in flight: round 1 ends (and waits for it) after 6 steps, twice its 3,
    or after its 3 without ``train_through_waits``."""
    outer = OuterConfig(inner_steps=3, codec="int8", round_timeout=60.0, overlap=True)
    hub = LocalAverager()
    gated = _Gated(hub.member("a"), round_no=0)
    w = make_worker("a", (0,), DENSE, outer, gated, seed=1, train_through_waits=fill)
    for _ in range(3):
        w.train_step()
    steps = 6 if fill else 3
    for _ in range(steps - 1):
        assert w.train_step() is None
    worker = threading.Thread(target=w.train_step)  # the round's last step waits for the exchange
    worker.start()
    wait_for(lambda: w.opt._steps_in_round == steps, 30, "round 1's last step")
    assert w.reports == []
    gated.release.set()
    worker.join(30)
    assert [r.round for r in w.reports] == [0] and w.reports[0].applied
    w.opt.flush()
    assert hub.round_weights("L0M0", 1) == {"a": steps * BATCH * SEQ}
    w.opt.close()


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("h", [5, 8])
def test_a_member_others_wait_for_ends_its_round_early_in_both_modes_once_half_its_round_is_done(overlap, h):
    """The fastest member paces the round: a member told that another holder already declared its
    current round ends it with the tokens it has (a smaller weight), once it has trained half its
    round's steps (rounded up): a member whose exchanges end late would otherwise train a step a round.
    In overlap mode too: the others' exchange of that round cannot begin before it declares."""
    outer = OuterConfig(inner_steps=h, codec="int8", round_timeout=5.0, overlap=overlap)
    hub = LocalAverager()
    paced = _Paced(hub.member("a"), waiting_round=1)
    w = make_worker("a", (0,), DENSE, outer, paced, seed=1, train_through_waits=False)  # exact step counts
    half = math.ceil(h * PACED_MIN_SHARE)
    for _ in range(h + half + h):
        w.train_step()
    assert hub.round_weights("L0M0", 0) == {"a": h * BATCH * SEQ}
    assert hub.round_weights("L0M0", 1) == {"a": half * BATCH * SEQ}
    assert w.opt.module_round("L0M0") == 3  # h steps, half of them, h steps
    assert {"L0M0": 1, "embed": 1, "head": 1} in paced.asked
    w.opt.close()


def test_a_round_ended_early_by_a_waiting_holder_is_announced_before_its_exchange():
    """``on_round_end`` (what makes a peer's status read "averaging") comes when a round ends, early
    because another holder waits as well as on its budget, and before any of the round's exchanges."""
    outer = OuterConfig(inner_steps=8, codec="int8", round_timeout=5.0)
    hub = LocalAverager()
    paced = _Paced(hub.member("a"), waiting_round=1)
    w = make_worker("a", (0,), DENSE, outer, paced, seed=1, train_through_waits=False)
    events, lock = [], threading.Lock()
    w.opt.on_round_end = lambda: events.append(("ends", w.opt.round))
    member_average = paced.average

    def average(module_id, round_no, *args, **kw):
        with lock:
            events.append(("exchange", round_no))
        return member_average(module_id, round_no, *args, **kw)

    paced.average = average
    half = math.ceil(8 * PACED_MIN_SHARE)
    for _ in range(8 + half):
        w.train_step()
    assert w.opt.module_round("L0M0") == 2 and hub.round_weights("L0M0", 1) == {"a": half * BATCH * SEQ}
    modules = len(w.opt._modules)
    assert events == [("ends", 0), *[("exchange", 0)] * modules, ("ends", 1), *[("exchange", 1)] * modules]
    w.opt.close()


def test_absent_member_is_dropped_after_the_timeout_and_the_rest_stay_identical():
    outer = OuterConfig(inner_steps=3, codec="int4", round_timeout=2.0)
    hub = LocalAverager()
    ws = [make_worker(n, (0,), DENSE, outer, hub.member(n), seed=k, module_ids=["L0M0"]) for k, n in enumerate("abc")]
    ws = [_single_module(w) for w in ws]
    a, b, c = ws
    run_threads([lambda: [a.train_step() for _ in range(6)], lambda: [b.train_step() for _ in range(6)],
                 lambda: [c.train_step() for _ in range(3)]])  # c dies after round 0
    late = a.reports[1].modules["L0M0"]
    assert late.applied and late.peers == ["a", "b"] and "dropped absent c" in late.reason
    assert hub.round_weights("L0M0", 1) == {"a": 3.0 * BATCH * SEQ, "b": 3.0 * BATCH * SEQ}
    assert_replicas_identical([a, b], check_local=True)


def test_late_joiner_is_identical_after_its_first_round():
    outer = OuterConfig(inner_steps=3, codec="int8", round_timeout=60.0)
    hub = LocalAverager()
    a, b = (_single_module(make_worker(n, (0,), DENSE, outer, hub.member(n), seed=k, module_ids=["L0M0"]))
            for k, n in enumerate("ab"))
    run_threads([lambda: [a.train_step() for _ in range(6)], lambda: [b.train_step() for _ in range(6)]])
    c = _single_module(make_worker("c", (0,), DENSE, outer, hub.member("c"), seed=9, module_ids=["L0M0"]))
    served = a.opt.module_state("L0M0")
    c.opt.load_module_state("L0M0", served.global_params, served.momentum, served.round_no)
    assert c.opt.module_round("L0M0") == 2
    run_threads([lambda w=w: [w.train_step() for _ in range(3)] for w in (a, b, c)])
    assert c.reports[0].round == 0 and c.reports[0].modules["L0M0"].group_size == 3
    assert_replicas_identical([a, b, c], check_local=True)


def _single_module(w: Worker) -> Worker:
    """A worker whose whole model is one block: embed/head fixed and local to it."""
    block = w.mods["L0M0"]
    g = torch.Generator().manual_seed(5)
    emb, head = nn.Embedding(VOCAB, DIM), nn.Linear(DIM, VOCAB)
    with torch.no_grad():
        for p in list(emb.parameters()) + list(head.parameters()):
            p.copy_(torch.randn(p.shape, generator=g))
    emb.requires_grad_(False)
    head.requires_grad_(False)
    w.mods = {"embed*": emb, "L0M0": block, "head*": head}
    return w


def test_state_dict_resumes_exactly():
    outer = OuterConfig(inner_steps=3, codec="int8")
    w1 = make_worker("solo", (0,), DENSE, outer, None, seed=3)
    for _ in range(6):
        w1.train_step()
    state = copy.deepcopy(w1.opt.state_dict())
    assert any(float(m["residual"].abs().max()) > 0 for m in state["modules"].values())
    w2 = make_worker("solo", (0,), DENSE, outer, None, seed=3)
    w2.opt.load_state_dict(state)
    w2.gen = copy.deepcopy(w1.gen)
    for _ in range(6):
        w1.train_step()
        w2.train_step()
    for mid in w1.mods:
        assert all(torch.equal(p, q) for p, q in zip(w1.mods[mid].parameters(), w2.mods[mid].parameters()))
        s1, s2 = w1.opt.state_dict()["modules"][mid], w2.opt.state_dict()["modules"][mid]
        assert torch.equal(s1["residual"], s2["residual"]) and s1["round_no"] == s2["round_no"] == 4


def test_sqrt_sharing_scales_the_averaged_delta():
    base = OuterConfig(inner_steps=2, codec="none", momentum=0.0)
    moved = {}
    for sqrt in (False, True):
        w = make_worker("solo", (0, 1), LATTICE, OuterConfig(**{**base.__dict__, "sqrt_sharing": sqrt}), None, seed=4)
        init = {mid: [p.detach().clone() for p in m.parameters()] for mid, m in w.mods.items()}
        w.train_step()
        w.train_step()
        moved[sqrt] = {
            mid: torch.cat([(i - g).reshape(-1) for i, g in zip(init[mid], w.opt.module_state(mid).global_params)])
            for mid in w.mods
        }
    for mid in moved[True]:
        factor = math.sqrt(len(LATTICE.paths_through(mid)))
        assert torch.allclose(moved[True][mid], moved[False][mid] * factor, rtol=1e-4, atol=1e-6), mid
    assert len(LATTICE.paths_through("embed")) == 4 and len(LATTICE.paths_through("L0M0")) == 2


def test_inner_config_builds_adamw_with_warmup_and_bad_setups_are_refused():
    mods = {"L0M0": build_module(DENSE, "L0M0")}
    opt = DiLoCoOptimizer(mods, InnerConfig(lr=1e-2, warmup_steps=4), OuterConfig(inner_steps=100))
    for p in mods["L0M0"].parameters():
        p.grad = torch.ones_like(p)
    assert opt.step() is None
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2 / 4)
    with pytest.raises(ConfigError, match="sqrt_sharing"):
        DiLoCoOptimizer(mods, InnerConfig(), OuterConfig(sqrt_sharing=True))
    with pytest.raises(ConfigError, match="not held"):
        opt.module_round("L1M1")
    shared = nn.Linear(2, 2)
    with pytest.raises(ConfigError, match="another module"):
        DiLoCoOptimizer({"a": shared, "b": shared}, InnerConfig(), OuterConfig())


def test_inner_lr_schedule_warms_up_then_decays_by_cosine_to_its_floor():
    from models.training import warmup_lr

    flat = InnerConfig(lr=1.0, warmup_steps=10)
    assert [warmup_lr(flat, s) for s in (0, 4, 9, 10, 10**6)] == pytest.approx([0.1, 0.5, 1.0, 1.0, 1.0])
    cos = InnerConfig(lr=1.0, warmup_steps=10, decay_steps=110, min_lr_ratio=0.2)
    lrs = [warmup_lr(cos, s) for s in range(200)]
    assert lrs[:11] == pytest.approx([(s + 1) / 10 for s in range(10)] + [1.0])
    assert lrs[60] == pytest.approx(0.6)  # halfway through the decay: floor + half the span
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:])) and lrs[110:] == pytest.approx([0.2] * 90)
    mods = {"L0M0": build_module(DENSE, "L0M0")}
    opt = DiLoCoOptimizer(mods, InnerConfig(lr=1e-2, warmup_steps=1, decay_steps=3, min_lr_ratio=0.0),
                          OuterConfig(inner_steps=100))
    seen = []
    for _ in range(4):
        for p in mods["L0M0"].parameters():
            p.grad = torch.ones_like(p)
        opt.step()
        seen.append(opt.param_groups[0]["lr"])
    assert seen == pytest.approx([1e-2, 1e-2, 5e-3, 0.0], abs=1e-12)
    for bad, field in (({"decay_steps": 5, "warmup_steps": 5}, "decay_steps"), ({"min_lr_ratio": 1.5}, "min_lr_ratio"),
                       ({"decay_steps": -1}, "decay_steps")):
        with pytest.raises(ConfigError, match=field):
            InnerConfig(**bad)


def test_modular_lm_paths_with_inner_config_stay_bit_identical():
    """The same wrapper on engineer A's real lattice model (tiny preset), AdamW built from InnerConfig."""
    from models.presets import tiny_cpu
    from models.lattice import ModularLM

    cfg = tiny_cpu()
    outer = OuterConfig(inner_steps=3, codec="int8", round_timeout=60.0)
    hub = LocalAverager()
    runs = []
    for k, path in enumerate([(0, 0), (0, 1), (1, 1)]):
        mids = cfg.lattice.path_modules(path)
        pm = ModularLM(cfg.lattice, seed=0, module_ids=mids).path_model(path)
        opt = DiLoCoOptimizer(pm.modules_by_id(), cfg.inner, outer, cfg.lattice, hub.member(f"p{k}", mids))
        runs.append((pm, opt, torch.Generator().manual_seed(k)))

    def train(pm, opt, gen) -> None:
        for _ in range(3 * outer.inner_steps):
            x = torch.randint(0, 64, (2, cfg.lattice.seq_len + 1), generator=gen)  # (B, T+1)
            pm(x[:, :-1], x[:, 1:])[1].backward()
            opt.step(tokens=float(x[:, 1:].numel()))
            opt.zero_grad()

    run_threads([lambda r=r: train(*r) for r in runs])
    by_module: dict[str, list] = {}
    for pm, opt, _ in runs:
        for mid in opt.module_ids:
            by_module.setdefault(mid, []).append((pm, opt))
    assert len(by_module["embed"]) == 3 and len(by_module["L0M0"]) == 2
    for mid, members in by_module.items():
        states = [opt.module_state(mid) for _, opt in members]
        assert all(s.round_no == 3 for s in states)
        for s in states[1:]:
            assert all(torch.equal(a, b) for a, b in zip(s.global_params, states[0].global_params)), mid
            assert all(torch.equal(a, b) for a, b in zip(s.momentum, states[0].momentum)), mid
        for pm, _ in members:
            local = list(pm.modules_by_id()[mid].parameters())
            assert all(torch.equal(p.detach(), g) for p, g in zip(local, states[0].global_params)), mid


def test_failed_round_keeps_local_progress_and_the_delta_carries_into_the_next():
    # outer lr 1 and no momentum: a successful outer step moves the global copy onto the local params
    outer = OuterConfig(inner_steps=2, codec="none", lr=1.0, momentum=0.0, round_timeout=0.2)
    hub = LocalAverager()
    solo = make_worker("solo", (0,), DENSE, outer, hub.member("solo", ["L0M0"]), seed=1, module_ids=["L0M0"])
    # the same training without any outer step: where solo's local params must be after 4 inner steps
    twin = make_worker("twin", (0,), DENSE, OuterConfig(inner_steps=100), None, seed=1, module_ids=["L0M0"])
    for w in (solo, twin):
        w.mods = {"embed": build_module(DENSE, "embed"), **w.mods, "head": build_module(DENSE, "head")}
    init = [p.detach().clone() for p in solo.mods["L0M0"].parameters()]
    ghost = hub.member("ghost", ["L0M0"])
    # the ghost closes round 0 alone (after its timeout) before solo gets there: solo's round 0 fails
    assert ghost.average("L0M0", 0, [torch.zeros(3)], 1.0, get_codec("none"), 0.05).group_size == 1
    hub.leave("ghost")
    solo.train_step()
    m = solo.train_step().modules["L0M0"]
    assert not m.applied and "closed before we arrived" in m.reason
    assert all(torch.equal(g, i) for g, i in zip(solo.opt.module_state("L0M0").global_params, init))
    assert solo.opt.module_round("L0M0") == 0  # its copy is still round 0's
    # the peer re-syncs from the group that applied round 0 (the ghost averaged a zero delta alone:
    # its state is the initial weights at round 1); the local progress rides on top
    momentum = [torch.zeros_like(i) for i in init]
    solo.opt.rebase_module_state("L0M0", [i.clone() for i in init], momentum, 1)
    assert solo.opt.module_round("L0M0") == 1
    solo.train_step()
    m = solo.train_step().modules["L0M0"]
    assert m.applied and m.group_size == 1
    for _ in range(4):
        twin.train_step()
    # both rounds' progress reached the global copy: round 0's delta was carried, not lost
    glob = solo.opt.module_state("L0M0").global_params
    for g, t, i in zip(glob, twin.mods["L0M0"].parameters(), init):
        assert torch.allclose(g, t.detach(), atol=1e-6) and not torch.allclose(g, i, atol=1e-3)


@pytest.mark.parametrize(
    "device, dtype",
    [("cpu", torch.bfloat16), pytest.param("cuda", torch.float32, marks=pytest.mark.gpu)],
)
@pytest.mark.parametrize("overlap", [False, True])
def test_local_params_on_any_device_and_dtype_share_one_cpu_fp32_global_copy(device, dtype, overlap):
    outer = OuterConfig(inner_steps=2, codec="int8", round_timeout=60.0, overlap=overlap)
    hub = LocalAverager()
    workers = []
    for k, name in enumerate("ab"):
        mods = {mid: build_module(DENSE, mid).to(device=device, dtype=dtype) for mid in DENSE.path_modules((0,))}
        params = [p for m in mods.values() for p in m.parameters()]
        opt = DiLoCoOptimizer(mods, torch.optim.SGD(params, lr=0.1), outer, DENSE, hub.member(name),
                              train_through_waits=False)  # rounds of exactly 2 steps
        workers.append((mods, opt, torch.Generator().manual_seed(k)))

    def train(mods, opt, gen) -> None:
        for _ in range(3 * outer.inner_steps):
            x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen).to(device)  # (B, T)
            h = mods["L0M0"](mods["embed"](x))  # (B, T, D)
            logits = mods["head"](h).float()  # (B, T, V)
            nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ((x * 3 + 1) % VOCAB).reshape(-1)).backward()
            opt.step(tokens=x.numel())
            opt.zero_grad()
        opt.close()

    run_threads([lambda w=w: train(*w) for w in workers])
    (mods_a, opt_a, _), (mods_b, opt_b, _) = workers
    for mid in opt_a.module_ids:
        sa, sb = opt_a.module_state(mid), opt_b.module_state(mid)
        assert sa.round_no == sb.round_no == 3
        for ga, gb, ma, mb in zip(sa.global_params, sb.global_params, sa.momentum, sb.momentum):
            assert ga.device.type == "cpu" and ga.dtype == torch.float32
            assert torch.equal(ga, gb) and torch.equal(ma, mb) and float(ma.abs().max()) > 0
        if not overlap:  # after the last outer step, local = global in the params' own device and dtype
            for p, g in zip(mods_a[mid].parameters(), sa.global_params):
                assert p.device.type == device and p.dtype == dtype
                assert torch.equal(p.detach().cpu(), g.to(dtype))


# -- module_state while an exchange is in flight, and rebase_module_state ----------------------------


def _fingerprint(st) -> tuple:
    """A module state's round and the exact bytes of its global copy and momentum (cheap to compare)."""
    return (st.round_no, b"".join(t.numpy().tobytes() for t in st.global_params),
            b"".join(t.numpy().tobytes() for t in st.momentum))


def test_module_state_from_another_thread_is_never_torn_or_mislabelled():
    """While round 0's exchange waits for the other member, a state-serving thread reads
    ``module_state`` in a tight loop: it sees the pre-step global labelled round 0 (the round being
    averaged), then the post-step global labelled round 1, and never anything in between."""
    outer = OuterConfig(inner_steps=1, codec="none", round_timeout=60.0)
    hub = LocalAverager()
    other = hub.member("b")
    w = make_worker("a", (0,), DENSE, outer, hub.member("a"), seed=0)
    mid = w.opt.module_ids[0]
    pre = _fingerprint(w.opt.module_state(mid))
    samples: list[tuple] = []
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            samples.append(_fingerprint(w.opt.module_state(mid)))
            time.sleep(0)  # yield the GIL: a busy reader must not starve the training thread of the lock

    reading = threading.Thread(target=reader)
    stepping = threading.Thread(target=w.train_step)
    reading.start()
    stepping.start()
    try:
        from peer.localnet import wait_for

        wait_for(lambda: w.opt.module_round(mid) == 1, 60, "round 0's exchange to start")
        n_in_flight = len(samples)
        wait_for(lambda: len(samples) >= n_in_flight + 50, 60, "reads during the exchange")
        assert all(s == pre for s in samples[n_in_flight:n_in_flight + 50]), \
            "in flight: not the pre-step global labelled round 0"
        assert stepping.is_alive(), "the exchange finished without the other member"
        from concurrent.futures import ThreadPoolExecutor

        def contribute(m: str):  # the other member's delta for each module ``a`` holds
            like = w.opt.module_state(m).global_params
            delta = [torch.randn(g.shape, generator=torch.Generator().manual_seed(7)) * 0.01 for g in like]
            return other.average(m, 0, delta, float(BATCH * SEQ), w.opt.codec, 60.0)

        with ThreadPoolExecutor(len(w.opt.module_ids)) as pool:
            for res in pool.map(contribute, w.opt.module_ids):
                assert res.ok, res.reason
        stepping.join(60)
        assert not stepping.is_alive()
        n_done = len(samples)
        wait_for(lambda: len(samples) >= n_done + 20, 60, "reads after the exchange")
    finally:
        stop.set()
        reading.join(60)
    post = _fingerprint(w.opt.module_state(mid))
    assert post[0] == 1 and post[1] != pre[1] and post[2] != pre[2], "round 0 was not applied"
    kinds = ["pre" if s == pre else "post" if s == post else "torn" for s in samples]
    assert "torn" not in kinds, f"read {kinds.index('torn')} was neither the pre- nor the post-step state"
    assert kinds[-1] == "post" and "pre" not in kinds[kinds.index("post"):], "the state went back in time"


def test_rebase_keeps_local_progress_exactly():
    """``local <- new_global + (local - old_global)``, bit for bit; the new global copy, momentum and
    round are adopted; the error-feedback residual is kept; and the next round's delta carries the
    progress made before the rebase."""
    outer = OuterConfig(inner_steps=4, codec="int8", round_timeout=10.0)
    w = make_worker("a", (0,), DENSE, outer, LocalAverager().member("a"), seed=3)
    for _ in range(3):  # three of the round's four inner steps
        assert w.train_step() is None
    mid = w.opt.module_ids[0]
    old = w.opt.module_state(mid)
    local = [p.detach().clone() for p in w.mods[mid].parameters()]
    residual = w.opt.state_dict()["modules"][mid]["residual"].clone()
    gen = torch.Generator().manual_seed(11)
    new_global = [g + torch.randn(g.shape, generator=gen) * 0.1 for g in old.global_params]
    new_momentum = [torch.randn(g.shape, generator=gen) for g in old.global_params]
    w.opt.rebase_module_state(mid, new_global, new_momentum, 9)
    for p, l, g_old, g_new in zip(w.mods[mid].parameters(), local, old.global_params, new_global):
        assert torch.equal(p.detach(), g_new + (l - g_old)), "local progress not kept exactly"
    st = w.opt.module_state(mid)
    assert st.round_no == 9 and w.opt.module_round(mid) == 9
    assert all(torch.equal(a, b) for a, b in zip(st.global_params + st.momentum, new_global + new_momentum))
    assert torch.equal(w.opt.state_dict()["modules"][mid]["residual"], residual)
    progress = [l - g for l, g in zip(local, old.global_params)]
    delta_now = [g - p.detach() for g, p in zip(new_global, w.mods[mid].parameters())]
    for d, pr in zip(delta_now, progress):
        assert torch.allclose(d, -pr, atol=1e-6), "the pseudo-gradient lost the pre-rebase progress"
    report = w.train_step()  # the round's last step: the carried progress is exchanged as round 9
    assert report is not None and report.modules[mid].round_no == 9 and report.applied


class _Sparse:
    """A member averager that says whether a module is shared with a peer whose steps are far apart
    (``NetAverager.shares_with_sparse``), as the test sets it, and records its round policies."""

    def __init__(self, member) -> None:
        self.member, self.sparse, self.policies = member, False, []

    def average(self, *args, **kw):
        return self.member.average(*args, **kw)

    def shares_with_sparse(self, module_id, round_no) -> bool:
        return self.sparse

    def use_round_policy(self, wait_for_behind: bool) -> None:
        self.policies.append(wait_for_behind)


def test_a_path_peer_exchanges_behind_its_next_round_while_it_shares_a_module_with_a_sparse_stepper():
    """With ``overlap_beside_sparse`` the rounds wait for their exchange while no sparse stepper is
    seen, run it behind the next round once one is (that round's report comes once it is applied, and
    holders behind are not waited for), and wait again once none is seen and nothing is in flight."""
    outer = OuterConfig(inner_steps=2, codec="int8", round_timeout=60.0)
    hub = LocalAverager()
    averager = _Sparse(hub.member("a"))
    w = make_worker("a", (0,), DENSE, outer, averager, seed=1)
    w.opt.overlap_beside_sparse = True
    w.train_step()
    report = w.train_step()  # round 0: waited for
    assert report is not None and report.round == 0 and not report.overlap and not w.opt.overlapping
    averager.sparse = True
    w.train_step()
    assert w.train_step() is None  # round 1's end launches its exchange and returns
    assert w.opt.overlapping and averager.policies[-1] is False
    wait_for(lambda: not _in_flight(w), 30, "round 1's exchange to return")
    report = w.train_step()  # applied at the next step
    assert report is not None and report.round == 1 and report.overlap and report.applied
    averager.sparse = False
    report = w.train_step()  # round 2 ends with nothing in flight: it is waited for again
    assert report is not None and report.round == 2 and not report.overlap and report.applied
    assert not w.opt.overlapping and averager.policies[-1] is True
    w.opt.close()
