"""Replicas of a module compared across peers' snapshots: every pair at the same round bit-identical."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Optional

import torch

from peer.node import CheckpointDir

__all__ = ["snapshots_by_round", "forked_rounds", "replica_diff", "assert_identical_at_equal_rounds", "FORK",
           "FORK_OTHER"]


def snapshots_by_round(root: Path) -> dict[str, dict[int, dict[str, torch.Tensor]]]:
    """module id -> round -> tensors (weights and momentum) over every snapshot under ``root``."""
    out: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    ckpt = CheckpointDir(root)
    for path in ckpt.snapshots():
        snap = ckpt.load(path)
        for mid, round_no in snap.meta["rounds"].items():
            tensors = {**snap.groups[f"modules/{mid}"], **{f"outer.{k}": v for k, v in snap.groups[f"outer/{mid}"].items()}}
            out.setdefault(mid, {})[int(round_no)] = tensors
    return out


FORK = re.compile(r"_(\w+?)_r(\d+)_group: holders .* hold another state at this round \(a fork\)")
"""The kept side's line of a fork (``peer.averaging.matchmaking``)."""
FORK_OTHER = re.compile(r"module (\w+) round (\d+): no group \(forked: ")
"""The other side's line (``peer.averaging.net_averager``): a kept side that declared first need not see it."""


def forked_rounds(logs: list[str]) -> dict[str, int]:
    """The last round of each module at which its holders held two states, from the peers' logs. Peers
    that start seconds apart average in smaller groups first and meet as a fork; the majority's state
    is kept and the others re-sync to it (``peer.averaging.matchmaking``), so snapshots at those rounds
    differ by design, and every later round must not."""
    last: dict[str, int] = {}
    for text in logs:
        for mid, r in FORK.findall(text) + FORK_OTHER.findall(text):
            last[mid] = max(last.get(mid, 0), int(r))
    return last


def replica_diff(roots: list[Path], forked: Optional[dict[str, int]] = None) -> tuple[int, float, str]:
    """Over every pair of snapshots of the same module at the same round under ``roots`` (except at
    rounds up to a start-up fork of that module, ``forked``: :func:`forked_rounds`): the number of pairs
    compared, the largest absolute difference, and the first differing pair named ('' if none)."""
    forked = forked or {}
    views = [snapshots_by_round(r) for r in roots]
    pairs, diff, first = 0, 0.0, ""
    for i in range(len(views)):
        for j in range(i + 1, len(views)):
            for mid in set(views[i]) & set(views[j]):
                for r in sorted(set(views[i][mid]) & set(views[j][mid])):
                    if r == 0 or r <= forked.get(mid, 0):
                        continue
                    a, b = views[i][mid][r], views[j][mid][r]
                    if a.keys() != b.keys():
                        raise AssertionError(f"{mid} round {r}: {roots[i]} and {roots[j]} hold different tensors")
                    for k in a:
                        if torch.equal(a[k], b[k]):
                            continue
                        d = float((a[k].float() - b[k].float()).abs().max()) if a[k].shape == b[k].shape else math.inf
                        diff = max(diff, d if d > 0 else math.inf)  # NaN: a difference too
                        first = first or f"{mid} round {r} differs in {k} between {roots[i]} and {roots[j]}"
                    pairs += 1
    return pairs, diff, first


def assert_identical_at_equal_rounds(roots: list[Path], min_pairs: int = 1, forked: Optional[dict[str, int]] = None) -> int:
    """Every pair of snapshots of the same module at the same round is bit-identical, except at rounds
    up to a start-up fork of that module (``forked``: :func:`forked_rounds`); returns the number of pairs
    compared (the test asserts that enough were)."""
    pairs, diff, first = replica_diff(roots, forked)
    assert diff == 0.0, first
    assert pairs >= min_pairs, f"only {pairs} common (module, round) snapshots to compare"
    return pairs
