"""Aggregates the scheduler reads: throughput and members per path and per module.

The coordinator keeps one :class:`ClusterView` up to date as peers join, leave, move and report
throughput (O(1) per change), so a decision never scans every peer: with 100,000 peers in state an
assignment costs what the lattice's size costs, not what the peer count costs.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterable, Optional

from coordinator.records import MODE_ARCHIVE, MODE_PATH, Assignment, PeerRecord

__all__ = ["ClusterView"]

Path_ = tuple[int, ...]


@dataclass
class ClusterView:
    """Who holds what, with throughput sums. Only peers that hold work (active or draining) count."""

    path_peers: dict[Path_, dict[str, float]] = field(default_factory=lambda: defaultdict(dict))
    """Path-mode peers of each path with their tokens/s."""
    path_tps: dict[Path_, float] = field(default_factory=lambda: defaultdict(float))
    """Sum of path-mode tokens/s per path (DiPaCo trains a path's data only on its peers)."""
    stage_tps: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    """Sum of stage-server tokens/s per module."""
    stage_peers: dict[str, dict[str, float]] = field(default_factory=lambda: defaultdict(dict))
    """Stage servers of each module with their tokens/s."""
    module_members: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    """Peers averaging each module (path peers of every path through it, plus its stage servers)."""
    holders: dict[str, float] = field(default_factory=dict)
    """peer id -> tokens/s of every peer counted here."""
    assignments: dict[str, Assignment] = field(default_factory=dict)

    @classmethod
    def from_peers(cls, peers: Iterable[PeerRecord]) -> "ClusterView":
        view = cls()
        for p in peers:
            if p.holds_work:
                view.add(p.peer_id, p.assignment, p.capabilities.tokens_per_s)
        return view

    def add(self, peer_id: str, assignment: Assignment, tokens_per_s: float) -> None:
        """Count ``peer_id`` as doing ``assignment`` (it must not be counted already)."""
        if peer_id in self.holders:
            raise ValueError(f"peer {peer_id} already holds {self.assignments[peer_id].label()}")
        self.holders[peer_id] = tokens_per_s
        self.assignments[peer_id] = assignment
        if assignment.mode == MODE_ARCHIVE:  # an archive covers no work
            return
        if assignment.mode == MODE_PATH:
            self.path_peers[assignment.path][peer_id] = tokens_per_s
            self.path_tps[assignment.path] += tokens_per_s
        else:
            self.stage_tps[assignment.module_id] += tokens_per_s
            self.stage_peers[assignment.module_id][peer_id] = tokens_per_s
        for m in assignment.module_ids:
            self.module_members[m] += 1

    def remove(self, peer_id: str) -> Optional[Assignment]:
        """Stop counting ``peer_id``; returns what it held (None if it held nothing)."""
        if peer_id not in self.holders:
            return None
        tps = self.holders.pop(peer_id)
        assignment = self.assignments.pop(peer_id)
        if assignment.mode == MODE_ARCHIVE:
            return assignment
        if assignment.mode == MODE_PATH:
            members = self.path_peers[assignment.path]
            del members[peer_id]
            if members:
                self.path_tps[assignment.path] -= tps
            else:
                del self.path_peers[assignment.path]
                del self.path_tps[assignment.path]
        else:
            servers = self.stage_peers[assignment.module_id]
            del servers[peer_id]
            if servers:
                self.stage_tps[assignment.module_id] -= tps
            else:
                del self.stage_peers[assignment.module_id]
                self.stage_tps.pop(assignment.module_id, None)
        for m in assignment.module_ids:
            self.module_members[m] -= 1
            if self.module_members[m] == 0:
                del self.module_members[m]
        return assignment

    def set_tokens_per_s(self, peer_id: str, tokens_per_s: float) -> None:
        """A held peer reported a new throughput."""
        if peer_id in self.holders and self.holders[peer_id] != tokens_per_s:
            assignment = self.assignments[peer_id]
            self.remove(peer_id)
            self.add(peer_id, assignment, tokens_per_s)

    def copy(self) -> "ClusterView":
        out = ClusterView()
        for peer_id, assignment in self.assignments.items():
            out.add(peer_id, assignment, self.holders[peer_id])
        return out
