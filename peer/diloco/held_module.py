"""One module a DiLoCo peer holds, and what its outer round does to it.

:class:`peer.diloco.DiLoCoOptimizer` keeps one :class:`HeldModule` per module: the trained params,
the global copy and outer momentum (:class:`peer.outer.OuterOptimizer`), the error-feedback residual,
the group round number it contributes to next, and the exchange in flight. The optimizer schedules
the exchanges (when, on which thread, under its lock); this module holds the per-module arithmetic:
the delta to send, the outer step with the group's mean, and adopting a state from another peer.
Every member applies the same step to the same global copy, so the copies stay bit-identical.
"""

from __future__ import annotations

import logging
import math
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
from torch import Tensor

from models.config import LatticeConfig, OuterConfig
from models.sparse_spec import feedback_decay
from peer.averaging import AverageResult, flat_view, flatten
from peer.compression import ErrorFeedback
from peer.outer import ModuleState, OuterOptimizer

__all__ = ["HeldModule", "PendingExchange"]

logger = logging.getLogger(__name__)


class HeldModule:
    """Per-module state: params, outer optimizer, error feedback, group round number, pending exchange.

    ``lattice`` is needed only with ``outer.sqrt_sharing`` (DiPaCo: the averaged delta is scaled by the
    square root of the number of paths sharing the module)."""

    def __init__(self, module_id: str, params: list[Tensor], outer: OuterConfig,
                 lattice: Optional[LatticeConfig] = None):
        self.module_id = module_id
        self.params = params
        self.cfg = outer
        self.outer = OuterOptimizer(params, lr=outer.lr, momentum=outer.momentum, nesterov=outer.nesterov)
        self.ef = ErrorFeedback(self.outer.numel, feedback_decay(outer.codec))
        self.round_no = 0
        self.pending: Optional[PendingExchange] = None
        self.sharing_factor = math.sqrt(len(lattice.paths_through(module_id))) if outer.sqrt_sharing else 1.0

    def prepare(self, round_no: int) -> tuple[Optional[Tensor], str]:
        """``delta (+ residual)`` as a flat vector, or None and why it must not be sent."""
        flat = flatten(self.outer.pseudo_gradient(self.params))  # (n,)
        if not bool(torch.isfinite(flat).all()):
            bad = int((~torch.isfinite(flat)).sum())
            reason = f"delta holds {bad} NaN/Inf values: not sent, local progress kept"
            logger.warning("module %s round %d: %s", self.module_id, round_no, reason)
            return None, reason
        return (self.ef.add(flat) if self.cfg.error_feedback else flat), ""

    def apply(self, sent: Tensor, res: AverageResult) -> None:
        """Error feedback and the outer step on the global copy (identical on every member)."""
        if self.cfg.error_feedback:
            self.ef.update(sent, flat_view(res.own_decoded))  # the round's vector itself: no copy
        averaged = res.averaged
        if self.cfg.sqrt_sharing:
            averaged = [a * self.sharing_factor for a in averaged]
        self.outer.step(averaged)

    def roll_back(self, pending: PendingExchange) -> None:
        """A round this peer did not apply leaves its global copy at that round: its number goes back
        too, so the state is never labelled with a round it missed (the group that applied it is then
        ahead, and this peer re-syncs to it). In overlap mode too: a member cannot tell a round the
        whole group failed (every copy then goes back alike) from one the group applied without it
        (its group formed without it, or it fell behind), and counting on would label its un-averaged
        state, in snapshots and in the state it serves, with rounds the group applied."""
        self.round_no = pending.round_no

    @torch.no_grad()
    def adopt_local(self, anchor: Optional[list[Tensor]]) -> None:
        """After an applied round: ``local <- global``, plus (overlap mode, ``anchor`` the local params
        when the delta was taken) the local progress made since."""
        if anchor is None:
            self.outer.sync_to(self.params)
            return
        for p, g, a in zip(self.params, self.outer.global_params, anchor):
            progress = p.detach().to(device="cpu", dtype=torch.float32) - a  # made while exchanging
            p.data.copy_(g + progress)

    # -- state ----------------------------------------------------------------------------------

    def state(self) -> ModuleState:
        """Copies of the global params, outer momentum and the round they are ready for: while an
        exchange is in flight, the global copy is still that of the round being averaged."""
        pending = self.pending
        round_no = pending.round_no if pending is not None and pending.future is not None else self.round_no
        return ModuleState([g.clone() for g in self.outer.global_params],
                           [b.clone() for b in self.outer.momentum_buffers], round_no)

    @torch.no_grad()
    def rebase(self, global_params: Sequence[Tensor], momentum: Sequence[Tensor], round_no: int) -> None:
        """``local <- new_global + (local - old_global)``; the residual is kept."""
        progress = [p.detach().to(device="cpu", dtype=torch.float32) - g
                    for p, g in zip(self.params, self.outer.global_params)]
        self.outer.load_state_dict({"global": list(global_params), "momentum": list(momentum)})
        for p, g, d in zip(self.params, self.outer.global_params, progress):
            p.data.copy_(g + d)
        self.round_no = int(round_no)

    def load(self, global_params: Sequence[Tensor], momentum: Sequence[Tensor], round_no: int) -> None:
        """Global copy, momentum and round from a peer; local params reset to it, the residual cleared."""
        if self.pending is not None and self.pending.future is not None:
            self.pending.future.result()
        self.pending = None
        self.outer.load_state_dict({"global": list(global_params), "momentum": list(momentum)})
        self.outer.sync_to(self.params)
        self.ef.reset()
        self.round_no = int(round_no)

    def state_dict(self) -> dict[str, Any]:
        """Global copy, momentum, error-feedback residual and round number (copies)."""
        return {
            "global": [g.clone() for g in self.outer.global_params],
            "momentum": [b.clone() for b in self.outer.momentum_buffers],
            "residual": self.ef.residual.clone(),
            "round_no": self.round_no,
        }

    def load_state_dict(self, state: dict[str, Any], sync_local: bool) -> None:
        """Restore :meth:`state_dict`'s output; ``sync_local`` resets the local params to the global copy."""
        self.pending = None
        self.outer.load_state_dict({"global": state["global"], "momentum": state["momentum"]})
        self.ef.load_state_dict({"residual": state["residual"]})
        self.round_no = int(state["round_no"])
        if sync_local:
            self.outer.sync_to(self.params)


@dataclass
class PendingExchange:
    """An exchange launched and not yet applied (overlap mode: applied at the first inner step after it
    returned, at the latest at the end of the next round)."""

    round_no: int
    tokens: float
    sent: Optional[Tensor] = None  # (n,) what we contributed (delta + residual)
    anchor: Optional[list[Tensor]] = None  # local params when the delta was taken
    future: Optional[Future] = None
    refused: str = ""
    """Why nothing was sent (the delta held NaN/Inf); then ``future`` is None."""
