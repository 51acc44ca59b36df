"""Aggregates the scheduler reads: throughput and members per path and per module.

The coordinator keeps one :class:`ClusterView` up to date as peers join, leave, move and report
throughput (O(1) per change), so a decision never scans every peer: with 100,000 peers in state an
assignment costs what the lattice's size costs, not what the peer count costs.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterable, Optional

from coordinator.records import MODE_ARCHIVE, MODE_PATH, MODE_TRAINER, Assignment, PeerRecord

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
    trainer_peers: dict[Path_, dict[str, float]] = field(default_factory=lambda: defaultdict(dict))
    """Pipeline trainers of each path with the tokens/s they drove."""
    pinned: set[str] = field(default_factory=set)
    """Peers that asked for their role at join (``peer join --role``): rebalancing never moves them."""
    capacity: dict[str, float] = field(default_factory=dict)
    """peer id -> tokens/s a stage server could serve at full load (stage servers only; 0: unknown)."""
    module_members: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    """Peers averaging each module (path peers of every path through it, its stage servers, and the
    trainers holding an embedding or head)."""
    holders: dict[str, float] = field(default_factory=dict)
    """peer id -> tokens/s of every peer counted here."""
    assignments: dict[str, Assignment] = field(default_factory=dict)

    @classmethod
    def from_peers(cls, peers: Iterable[PeerRecord]) -> "ClusterView":
        view = cls()
        for p in peers:
            if p.holds_work:
                view.add(p.peer_id, p.assignment, p.counted_tokens_per_s(), p.capacity_tokens_per_s)
                if p.requested_role:
                    view.pinned.add(p.peer_id)
        return view

    def add(self, peer_id: str, assignment: Assignment, tokens_per_s: float, capacity: float = 0.0) -> None:
        """Count ``peer_id`` as doing ``assignment`` (it must not be counted already); ``capacity``:
        a stage server's measured tokens/s at full load (0: unknown)."""
        if peer_id in self.holders:
            raise ValueError(f"peer {peer_id} already holds {self.assignments[peer_id].label()}")
        self.holders[peer_id] = tokens_per_s
        self.assignments[peer_id] = assignment
        if assignment.mode == MODE_ARCHIVE:  # an archive covers no work
            return
        if assignment.mode == MODE_PATH:
            self.path_peers[assignment.path][peer_id] = tokens_per_s
            self.path_tps[assignment.path] += tokens_per_s
        elif assignment.mode == MODE_TRAINER:
            self.trainer_peers[assignment.path][peer_id] = tokens_per_s
        else:
            self.capacity[peer_id] = capacity
            self.stage_tps[assignment.module_id] += tokens_per_s
            self.stage_peers[assignment.module_id][peer_id] = tokens_per_s
        for m in assignment.module_ids:
            self.module_members[m] += 1

    def remove(self, peer_id: str) -> Optional[Assignment]:
        """Stop counting ``peer_id``; returns what it held (None if it held nothing)."""
        if peer_id not in self.holders:
            return None
        self.pinned.discard(peer_id)
        tps = self.holders.pop(peer_id)
        assignment = self.assignments.pop(peer_id)
        if assignment.mode == MODE_ARCHIVE:
            return assignment
        if assignment.mode == MODE_TRAINER:
            trainers = self.trainer_peers[assignment.path]
            del trainers[peer_id]
            if not trainers:
                del self.trainer_peers[assignment.path]
        elif assignment.mode == MODE_PATH:
            members = self.path_peers[assignment.path]
            del members[peer_id]
            if members:
                self.path_tps[assignment.path] -= tps
            else:
                del self.path_peers[assignment.path]
                del self.path_tps[assignment.path]
        else:
            self.capacity.pop(peer_id, None)
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

    def set_tokens_per_s(self, peer_id: str, tokens_per_s: float, capacity: Optional[float] = None) -> None:
        """A held peer reported a new throughput (and, for a stage server, capacity; None: unchanged)."""
        if peer_id not in self.holders:
            return
        capacity = self.capacity.get(peer_id, 0.0) if capacity is None else capacity
        if self.holders[peer_id] != tokens_per_s or self.capacity.get(peer_id, 0.0) != capacity:
            assignment, pinned = self.assignments[peer_id], peer_id in self.pinned
            self.remove(peer_id)
            self.add(peer_id, assignment, tokens_per_s, capacity)
            if pinned:
                self.pinned.add(peer_id)

    def complete(self, blocks: Iterable[str]) -> bool:
        """True when every module of ``blocks`` (a path's block modules) has a stage server."""
        return all(m in self.stage_peers for m in blocks)

    def copy(self) -> "ClusterView":
        out = ClusterView()
        for peer_id, assignment in self.assignments.items():
            out.add(peer_id, assignment, self.holders[peer_id], self.capacity.get(peer_id, 0.0))
        out.pinned = set(self.pinned)
        return out
