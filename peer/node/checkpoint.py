"""A peer's module states in checkpoint snapshots: what the path trainer and the archive save after a
round and resume from.

The layout on disk (files, groups, ``LATEST``, atomic writes, pruning, the error for a full disk) is
:mod:`models.checkpoint`'s; :class:`CheckpointDir`, :class:`CheckpointError` and :class:`Snapshot`
are re-exported here as part of ``peer.node``'s API. What this module adds is the mapping between a
:class:`~peer.outer.ModuleState` and a snapshot, and the rule that a failed save is logged once,
shown on the local status and never stops training.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import torch

from models.checkpoint import CheckpointDir, CheckpointError, Snapshot, module_groups
from peer.node.progress import PeerStatus
from peer.outer import ModuleState

__all__ = ["CheckpointDir", "CheckpointError", "Snapshot", "state_groups", "saved_state", "save_snapshot"]

log = logging.getLogger(__name__)


def state_groups(states: Mapping[str, ModuleState], names: Mapping[str, Sequence[str]], lattice_hash: str
                 ) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, dict[str, str]]]:
    """The snapshot groups and their metadata of ``states`` (module id -> state), each module's weights
    keyed by its parameter ``names``."""
    groups: dict[str, dict[str, torch.Tensor]] = {}
    metadata: dict[str, dict[str, str]] = {}
    for mid, state in states.items():
        g, m = module_groups(mid, names[mid], state.global_params, state.momentum, lattice_hash)
        groups.update(g)
        metadata.update(m)
    return groups, metadata


def saved_state(snap: Snapshot, module_id: str, names: Sequence[str]) -> Optional[ModuleState]:
    """``module_id``'s state as ``snap`` holds it (parameters in the order of ``names``), or None when
    the snapshot does not hold that module."""
    round_no = snap.module_round(module_id)
    if round_no < 0:
        return None
    params, momentum = snap.module_state(module_id, list(names))
    return ModuleState(params, momentum, round_no)


def save_snapshot(checkpoints: CheckpointDir, round_no: int, groups: dict[str, dict[str, torch.Tensor]],
                  meta: dict[str, Any], metadata: dict[str, dict[str, str]], status: PeerStatus) -> Optional[Path]:
    """Write a snapshot; a failure (a full disk) is logged once and shown in ``status``, not raised,
    since training must go on (the previous snapshot stays loadable). Returns the snapshot or None."""
    try:
        written = checkpoints.save(round_no, groups, meta, metadata)
    except CheckpointError as e:
        log.error("%s", e)
        status.checkpoint_error = str(e)
        return None
    status.checkpoint, status.checkpoint_error = str(written), ""
    return written
