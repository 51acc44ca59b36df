"""Where the coordinator's state is kept: one interface, an SQLite-WAL implementation for real runs
(:mod:`coordinator.sqlite_store`, which also has :func:`~coordinator.sqlite_store.open_store`) and an
in-memory one for tests. Both pass the same contract suite
(``tests/coordinator/test_coordinator_store.py``).

Writes come as a :class:`WriteBatch` applied atomically. The coordinator commits joins, leaves,
drains and assignment changes before it replies (acknowledged = durable); heartbeat renewals and
progress are batched and group-committed every ``flush_interval`` seconds.
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass, field
from typing import Protocol

from coordinator.records import Lease, ModuleProgress, PeerRecord

__all__ = ["WriteBatch", "StoredState", "Store", "MemoryStore", "HistoryKey"]

HistoryKey = tuple[str, float]
"""A point of the run's history: (series name, unix time)."""


@dataclass
class WriteBatch:
    """Changes applied in one transaction."""

    peers: dict[str, PeerRecord] = field(default_factory=dict)
    """Peers to insert or replace, by id."""
    leases: dict[str, Lease] = field(default_factory=dict)
    """Leases to insert or replace (renewals included), by lease id."""
    deleted_leases: set[str] = field(default_factory=set)
    renewals: dict[str, float] = field(default_factory=dict)
    """New expiry times of existing leases (heartbeats), applied after inserts; a renewal of a lease
    that no longer exists is ignored."""
    progress: dict[tuple[str, str], ModuleProgress] = field(default_factory=dict)
    """Progress rows to insert or replace, by (peer id, module id)."""
    meta: dict[str, str] = field(default_factory=dict)
    history: dict[HistoryKey, float] = field(default_factory=dict)
    """History points to insert or replace: (series, time) -> value (:mod:`coordinator.history`)."""
    deleted_history: set[HistoryKey] = field(default_factory=set)
    """History points to drop (thinned out)."""

    def __bool__(self) -> bool:
        return bool(self.peers or self.leases or self.deleted_leases or self.renewals or self.progress or self.meta
                    or self.history or self.deleted_history)

    def merge(self, later: "WriteBatch") -> "WriteBatch":
        """This batch followed by ``later``, as one batch."""
        for lease_id in later.leases:
            self.deleted_leases.discard(lease_id)
            self.renewals.pop(lease_id, None)
        for lease_id in later.deleted_leases:
            self.leases.pop(lease_id, None)
            self.renewals.pop(lease_id, None)
        self.renewals.update(later.renewals)
        for key in later.history:
            self.deleted_history.discard(key)
        for key in later.deleted_history:
            self.history.pop(key, None)
        self.history.update(later.history)
        self.deleted_history |= later.deleted_history
        self.peers.update(later.peers)
        self.leases.update(later.leases)
        self.deleted_leases |= later.deleted_leases
        self.progress.update(later.progress)
        self.meta.update(later.meta)
        return self


@dataclass
class StoredState:
    """Everything a store holds, as loaded at start-up."""

    peers: dict[str, PeerRecord] = field(default_factory=dict)
    leases: dict[str, Lease] = field(default_factory=dict)
    progress: dict[tuple[str, str], ModuleProgress] = field(default_factory=dict)
    meta: dict[str, str] = field(default_factory=dict)
    history: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    """series -> its (time, value) points, oldest first."""


class Store(Protocol):
    """Persistence of the coordinator's state."""

    def load(self) -> StoredState:
        """Everything committed so far."""
        ...

    def apply(self, batch: WriteBatch) -> None:
        """Commit ``batch`` atomically; durable when this returns. Thread-safe."""
        ...

    def close(self) -> None:
        ...


class MemoryStore:
    """A :class:`Store` in a dict, for tests; ``load`` returns deep copies like a real reload would."""

    def __init__(self) -> None:
        self._state = StoredState()
        self._lock = threading.Lock()
        self.commits = 0

    def load(self) -> StoredState:
        with self._lock:
            return copy.deepcopy(self._state)

    def apply(self, batch: WriteBatch) -> None:
        batch = copy.deepcopy(batch)
        with self._lock:
            self._state.peers.update(batch.peers)
            for lease_id in batch.deleted_leases:
                self._state.leases.pop(lease_id, None)
            self._state.leases.update(batch.leases)
            for lease_id, expires_at in batch.renewals.items():
                if lease_id in self._state.leases:
                    self._state.leases[lease_id].expires_at = expires_at
            self._state.progress.update(batch.progress)
            self._state.meta.update(batch.meta)
            points = {(name, t): v for name, pts in self._state.history.items() for t, v in pts}
            for key in batch.deleted_history:
                points.pop(key, None)
            points.update(batch.history)
            history: dict[str, list[tuple[float, float]]] = {}
            for (name, t), v in sorted(points.items()):
                history.setdefault(name, []).append((t, v))
            self._state.history = history
            self.commits += 1

    def close(self) -> None:
        pass
