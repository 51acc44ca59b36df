"""Replicas of a module compared across peers' snapshots, as a test asserts it (the comparison itself:
:mod:`peer.localnet.checks`)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from peer.localnet.checks import forked_rounds, replica_diff, snapshots_by_round

__all__ = ["assert_identical_at_equal_rounds", "forked_rounds", "replica_diff", "snapshots_by_round"]


def assert_identical_at_equal_rounds(roots: list[Path], min_pairs: int = 1, forked: Optional[dict[str, int]] = None) -> int:
    """Every pair of snapshots of the same module at the same round is bit-identical, except at rounds
    up to a start-up fork of that module (``forked``: :func:`forked_rounds`); returns the number of pairs
    compared (the test asserts that enough were)."""
    pairs, diff, first = replica_diff(roots, forked)
    assert diff == 0.0, first
    assert pairs >= min_pairs, f"only {pairs} common (module, round) snapshots to compare"
    return pairs
