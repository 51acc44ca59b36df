"""Bring a module back in line with its group after a round this peer did not apply.

Members that averaged together applied the same bytes (:mod:`peer.averaging.allreduce`), so their copies are
identical. A member that missed a round -- dropped by a deadline, cut off, or on the losing side of a
fork (two copies with one round number, see :mod:`peer.averaging.matchmaking`) -- would drift from them for good.
It fetches the group's state from a live holder and rebases on it, keeping the local progress it
made (``local <- new_global + (local - old_global)``), which then goes into its next round. Path
trainers, stage servers and stage trainers all call :func:`resync_after_round` after each outer round.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Optional

import torch

from peer.diloco.optimizer import DiLoCoOptimizer
from peer.diloco.reports import RoundReport
from peer.outer import ModuleState

__all__ = ["FetchState", "resync_module", "resync_after_round", "join_gathering_group", "install_resync",
           "skip_lost_rounds"]

log = logging.getLogger(__name__)

FetchState = Callable[..., Optional[ModuleState]]
"""``fetch_state(module_id, like, accept=None, min_round=-1, joining=True) -> ModuleState | None`` from
live holders (``accept``, ``min_round`` and ``joining`` as in
:func:`peer.averaging.state_transfer.fetch_module_state`: ``joining=False`` when we only copy the state
and will not average it from there)."""


def resync_module(opt: DiLoCoOptimizer, module_id: str, fetch_state: Optional[FetchState], adopt: str = "",
                  wait: float = 0.0, left_at: int = -1, overlap: Optional[bool] = None) -> bool:
    """Adopt the group's state of ``module_id`` if a live holder is ahead of us or holds the kept side
    of a fork (``adopt``: its digest). Returns True when our state changed.

    ``left_at``: the round our round failed behind, the holders at it having left (a drain, a
    preemption). When no live holder or archive sends a state that far, those rounds are lost with
    them: our state goes on as the module's, numbered from the round after theirs (:func:`skip_lost_rounds`).

    In overlap mode this runs from :attr:`DiLoCoOptimizer.before_launch`, between our completed
    exchange and the next launch. The group's members report the state of the exchange they have in
    flight; our failed round ``r`` left our number at ``r``, so a state past ``r`` (the group applied
    it) or the kept side of a fork at ``r`` is what lets us join the group's next exchange: for up to
    ``wait`` seconds we poll for it (members end rounds at about the same time). A holder at ``r``
    with our very state (the round failed for it too) ends the poll: nobody went on without us."""
    if fetch_state is None:
        return False
    mine = opt.module_state(module_id)
    like = list(mine.global_params)
    if opt.overlapping if overlap is None else overlap:
        deadline = time.monotonic() + wait
        in_step = False

        def past_ours(state: ModuleState) -> str:
            nonlocal in_step
            if state.round_no > mine.round_no or (adopt and state.round_no == mine.round_no and state.digest == adopt):
                return ""
            if state.round_no == mine.round_no and state.digest == mine.digest:
                in_step = True
            return f"round {state.round_no} is not past our round {mine.round_no}"

        while True:
            # every holder is asked: an overlap member's record can lag the state it serves
            remote = fetch_state(module_id, like, past_ours)
            if remote is not None or in_step or time.monotonic() >= deadline:
                break
            time.sleep(0.5)  # a poll of the group's progress, bounded by ``wait``
        if remote is None:
            return skip_lost_rounds(opt, module_id, left_at)
        opt.rebase_module_state(module_id, remote.global_params, remote.momentum, remote.round_no)
        log.info("module %s: re-synced to the group's state at round %d before our next exchange", module_id,
                 remote.round_no)
        return True
    if adopt:
        def wanted(state: ModuleState) -> str:
            if state.round_no > mine.round_no or (state.round_no == mine.round_no and state.digest == adopt):
                return ""
            return f"round {state.round_no} state {state.digest} is not the kept state {adopt}"

        remote = fetch_state(module_id, like, wanted, min_round=mine.round_no)
    else:  # only a holder that announces a later round can have moved on without us
        remote = fetch_state(module_id, like, min_round=mine.round_no + 1)
    if remote is None or remote.round_no < mine.round_no:
        # nobody live is ahead: the round failed for the whole group, which stays identical, or the
        # holders ahead left and took their rounds with them
        return skip_lost_rounds(opt, module_id, left_at)
    if remote.round_no == mine.round_no and all(
            torch.equal(a, b) for a, b in zip(remote.global_params, mine.global_params)):
        return False
    opt.rebase_module_state(module_id, remote.global_params, remote.momentum, remote.round_no)
    log.info("module %s: re-synced to the group's state at round %d%s (local progress kept)", module_id,
             remote.round_no, f", the kept side of a fork ({adopt})" if adopt else "")
    return True


def skip_lost_rounds(opt: DiLoCoOptimizer, module_id: str, left_at: int) -> bool:
    """Holders that left were at round ``left_at``, past ours, and nobody can send their state: number
    our state from ``left_at + 1`` on, keeping it (and our local progress). Stepping on from our own
    round would label our un-averaged state with rounds they applied (two states under one round
    number: snapshots, an archive, a state transfer could not tell them apart), and waiting for their
    withdrawals to expire would stall the module meanwhile. A holder that comes back from a checkpoint
    of those rounds is then behind and re-syncs to the module's state as it goes on. Returns True when
    our round number moved."""
    mine = opt.module_round(module_id)
    if left_at < mine:
        return False
    opt.renumber_module(module_id, left_at + 1)
    log.warning("module %s: holders that left were at round %d and no live holder or archive has their state: "
                "their rounds %d-%d are lost; going on from ours as round %d", module_id, left_at, mine, left_at,
                left_at + 1)
    return True


def join_gathering_group(opt: DiLoCoOptimizer, module_id: str, tokens: float, averager: Any,
                         fetch_state: Optional[FetchState]) -> bool:
    """After a round of ``module_id`` failed behind its group and we re-synced to the round the group
    went on to: when the group's members still gather that round (:meth:`NetAverager.gathering`),
    average it with them now (:meth:`DiLoCoOptimizer.exchange_now`, our failed round's ``tokens`` and
    local progress as our part) instead of at the end of our next round. True when it was applied.

    Our failed round's declaration came after that group began, and the group's next round is
    declared at the same moment as our failed one (the rounds of a peer's modules end together,
    and the other modules keep the two peers in step). Our next round would declare it as late again:
    behind the group every round, its updates never counting while the group waits for us until its
    gather deadline each time, for as long as we hold the module. Joining the round it gathers now
    puts us back in its rounds. Not applied (the group began meanwhile): re-synced as after any round
    we missed."""
    gathering = getattr(averager, "gathering", None)
    round_no = opt.module_round(module_id)
    if gathering is None or not gathering(module_id, round_no, opt.module_digest(module_id)):
        return False
    late = opt.exchange_now(module_id, tokens)
    if late.applied:
        log.info("module %s: joined round %d's group late (averaged by %d), back in step with it", module_id,
                 round_no, late.group_size)
        return True
    log.info("module %s: joining round %d's group late failed (%s)", module_id, round_no, late.reason)
    resync_module(opt, module_id, fetch_state, late.adopt, left_at=late.left_at)
    return False


def install_resync(opt: DiLoCoOptimizer, fetch_state: Optional[FetchState], wait: Optional[float] = None) -> None:
    """Overlap mode: re-sync failed modules between their completed exchange and the next launch,
    polling for the group's state for up to ``wait`` seconds (None: ``min(10, 0.2 * round_timeout)``).
    A stage server passes 0 (one try, a failed one retried after its next round): its step runs
    inside the request that completed it, so a poll there stalls its serving, and with rounds failing
    one after another (its group gone) a trainer's requests time out and its steps are abandoned."""
    if (opt.outer_cfg.overlap or opt.overlap_beside_sparse) and fetch_state is not None:
        wait = min(10.0, 0.2 * opt.outer_cfg.round_timeout) if wait is None else wait

        def before_launch(mid: str, report: Any) -> None:
            if "NaN" not in report.reason:
                resync_module(opt, mid, fetch_state, report.adopt, wait=wait,
                              left_at=report.left_at, overlap=True)

        opt.before_launch = before_launch


def resync_after_round(opt: DiLoCoOptimizer, report: RoundReport, averager: Any, fetch_state: Optional[FetchState],
                       join_late: bool = True) -> None:
    """Re-sync every module whose round was not applied (a NaN delta just waits: the group being
    ahead tells us at the next round; overlap mode re-syncs earlier, see :func:`install_resync`), then
    announce each module's current round to the DHT (in the background).

    ``join_late``: a module re-synced to the round live holders went on to without us, while they
    still gather it, joins their group now (:func:`join_gathering_group`). False for a stage server,
    whose rounds end inside a request it serves."""
    for mid, m in report.modules.items():
        if not m.applied and "NaN" not in m.reason and not report.overlap:
            try:
                if (resync_module(opt, mid, fetch_state, m.adopt, left_at=m.left_at)
                        and join_late and m.ahead >= 0 and not m.ahead_left):
                    join_gathering_group(opt, mid, m.tokens, averager, fetch_state)
            except Exception as e:  # a failed re-sync is retried after the next failed round
                log.warning("module %s: re-sync failed: %r", mid, e)
        if hasattr(averager, "hold"):
            # the digest of what a newcomer or the archive would fetch from us, stored in the background:
            # the training loop does not wait on a DHT store per module and round (a store can take a
            # large share of a round on a busy host; ``bench.utilization`` measures the share of wall time
            # left to training)
            averager.hold(mid, opt.module_round(mid), wait=False, digest=opt.module_digest(mid))
