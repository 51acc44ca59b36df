"""Bring a module back in line with its group after a round this peer did not apply.

Members that averaged together applied the same bytes (:mod:`peer.allreduce`), so their copies are
identical. A member that missed a round -- dropped by a deadline, cut off, or on the losing side of a
fork (two copies with one round number, see :mod:`peer.matchmaking`) -- would drift from them for good.
It fetches the group's state from a live holder and rebases on it, keeping the local progress it
made (``local <- new_global + (local - old_global)``), which then goes into its next round. Path
trainers, stage servers and stage trainers all call :func:`after_round` after each outer round.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch

from peer.diloco import DiLoCoOptimizer, ModuleState, RoundReport

__all__ = ["FetchState", "resync_module", "after_round"]

log = logging.getLogger(__name__)

FetchState = Callable[..., Optional[ModuleState]]
"""``fetch_state(module_id, like, accept=None) -> ModuleState | None`` from live holders (``accept``
as in :func:`peer.state_transfer.fetch_module_state`)."""


def resync_module(opt: DiLoCoOptimizer, module_id: str, fetch_state: Optional[FetchState], adopt: str = "") -> bool:
    """Adopt the group's state of ``module_id`` if a live holder is ahead of us or holds the kept side
    of a fork (``adopt``: its digest). Returns True when our state changed. Overlap mode skips it:
    the next exchange is already in flight and the group re-aligns through matchmaking."""
    if fetch_state is None or opt.outer_cfg.overlap:
        return False
    mine = opt.module_state(module_id)
    like = list(mine.global_params)
    if adopt:
        def wanted(state: ModuleState) -> str:
            if state.round_no > mine.round_no or (state.round_no == mine.round_no and state.digest == adopt):
                return ""
            return f"round {state.round_no} state {state.digest} is not the kept state {adopt}"

        remote = fetch_state(module_id, like, wanted)
    else:
        remote = fetch_state(module_id, like)
    if remote is None or remote.round_no < mine.round_no:
        return False  # nobody is ahead: the round failed for the whole group, which stays identical
    if remote.round_no == mine.round_no and all(
            torch.equal(a, b) for a, b in zip(remote.global_params, mine.global_params)):
        return False
    opt.rebase_module_state(module_id, remote.global_params, remote.momentum, remote.round_no)
    log.info("module %s: re-synced to the group's state at round %d%s (local progress kept)", module_id,
             remote.round_no, f", the kept side of a fork ({adopt})" if adopt else "")
    return True


def after_round(opt: DiLoCoOptimizer, report: RoundReport, averager: Any, fetch_state: Optional[FetchState]) -> None:
    """Re-sync every module whose round was not applied (a NaN delta just waits: the group being
    ahead tells us at the next round), then announce each module's current round to the DHT."""
    for mid, m in report.modules.items():
        if not m.applied and "NaN" not in m.reason:
            try:
                resync_module(opt, mid, fetch_state, m.adopt)
            except Exception as e:  # a failed re-sync is retried after the next failed round
                log.warning("module %s: re-sync failed: %r", mid, e)
        if hasattr(averager, "hold"):
            averager.hold(mid, opt.module_round(mid))
