"""How a module nobody holds starts: from the seed's init, or from a trained sibling of its level.

A newcomer on a path whose block module has no live holder and no checkpoint of ours would start that
module from the run seed's init: a random block between trained shared modules, whose first rounds'
pseudo-gradients of the shared modules are the furthest from the network's. A block module of the
same level (same shapes: every module of a level is the same stack of blocks) that someone holds is
a trained function of the same inputs into the same next level; starting from its global copy, with
a zeroed outer momentum and round 0, puts the new path near the network from its first step. The
sibling is picked by a fixed rule (the nearest index first, then the lower), the first with a live
holder whose state has had at least one round (at a run's start, when peers come one at a time, an
untrained sibling is only another seed's init: each module keeps its own); embeddings and heads
private to a path have sibling embeddings and heads in the same way.

``FRESH_START`` is the rule peers of this release apply (``bench.joiners`` measures both).
"""

from __future__ import annotations

import logging
import re
from typing import Any, Callable, Optional

import torch

from models.config import LatticeConfig

__all__ = ["FRESH_START", "FRESH_STARTS", "sibling_ids", "start_fresh_module"]

log = logging.getLogger(__name__)

FRESH_STARTS = ("seed", "sibling")
"""``seed``: the run seed's init; ``sibling``: a held sibling module's global copy (seed's init when none is held)."""

FRESH_START = "sibling"
"""What a path trainer, a stage server and a pipeline trainer do with a module nobody holds (:data:`FRESH_STARTS`)."""

_BLOCK = re.compile(r"^L(\d+)M(\d+)$")


def sibling_ids(lattice: LatticeConfig, module_id: str) -> list[str]:
    """Modules of ``module_id``'s kind and level with the same shapes, nearest index first (ties: the
    lower); a shared embedding or head has none."""
    m = _BLOCK.match(module_id)
    if m is not None:
        level, index = int(m.group(1)), int(m.group(2))
        others = [k for k in range(lattice.modules_per_level) if k != index]
        return [lattice.block_id(level, k) for k in sorted(others, key=lambda k: (abs(k - index), k))]
    kind = lattice.module_kind(module_id)
    if lattice.shared_embed:
        return []
    same = [mid for mid in lattice.module_ids() if lattice.module_kind(mid) == kind and mid != module_id]
    return same


def start_fresh_module(opt: Any, lattice: LatticeConfig, module_id: str, like: list[torch.Tensor],
                       fetch_state: Optional[Callable[..., Any]], how: str = FRESH_START) -> str:
    """Start ``module_id`` (held by ``opt``, a :class:`peer.diloco.DiLoCoOptimizer`, at the seed's
    init) the ``how`` way; returns its origin: ``init`` or ``sibling:<id>@<round>``."""
    if how not in FRESH_STARTS:
        raise ValueError(f"fresh start '{how}' is not one of {', '.join(FRESH_STARTS)}")
    if how == "seed" or fetch_state is None:
        return "init"
    for sibling in sibling_ids(lattice, module_id):
        # not joining: we copy the sibling's weights, we do not average it, so its holders must not wait
        # for our declarations as they do for a newcomer they sent a state to
        state = fetch_state(sibling, like, joining=False)
        if state is None or state.round_no < 1:
            continue
        if [tuple(g.shape) for g in state.global_params] != [tuple(t.shape) for t in like]:
            log.warning("module %s: sibling %s has other shapes; not used", module_id, sibling)
            continue
        zeros = [torch.zeros_like(g) for g in state.global_params]
        opt.load_module_state(module_id, state.global_params, zeros, 0)
        return f"sibling:{sibling}@{state.round_no}"
    return "init"
