"""The coordinator's state in SQLite with write-ahead logging.

One connection, guarded by a lock, used from the coordinator's writer threads. Every
:meth:`SQLiteStore.apply` is one transaction; with ``synchronous=FULL`` (the default) a committed
transaction survives ``kill -9`` and power loss, with ``NORMAL`` it survives process crashes.
Peers are stored as JSON documents keyed by peer id; leases, progress and the run's sampled history
(:mod:`coordinator.history`, bounded per series) have their own tables.
"""

from __future__ import annotations

import logging
import math
import sqlite3
import threading
from pathlib import Path
from typing import Optional, Union

from coordinator.records import Lease, ModuleProgress, PeerRecord
from coordinator.store import MemoryStore, Store, StoredState, WriteBatch
from models.errors import HivepathError

__all__ = ["SQLiteStore", "SCHEMA_VERSION", "open_store"]

log = logging.getLogger(__name__)

SCHEMA_VERSION = "1"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS peers (peer_id TEXT PRIMARY KEY, doc TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS leases (
    lease_id TEXT PRIMARY KEY, peer_id TEXT NOT NULL, expires_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS progress (
    peer_id TEXT NOT NULL, module_id TEXT NOT NULL, round INTEGER NOT NULL, tokens INTEGER NOT NULL,
    loss REAL, updated_at REAL NOT NULL, PRIMARY KEY (peer_id, module_id)
);
CREATE TABLE IF NOT EXISTS history (
    series TEXT NOT NULL, t REAL NOT NULL, value REAL NOT NULL, PRIMARY KEY (series, t)
) WITHOUT ROWID;
"""


class SQLiteStore:
    """A :class:`coordinator.store.Store` in one SQLite file (WAL journal)."""

    def __init__(self, path: Union[str, Path], synchronous: str = "FULL"):
        self.path = Path(path)
        try:
            self._db = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute(f"PRAGMA synchronous={synchronous.upper()}")
            self._db.executescript(_SCHEMA)
            row = self._db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
        except sqlite3.DatabaseError as e:
            raise HivepathError(f"--db {self.path}: not a usable SQLite database ({e}); pass a new path") from None
        if row is None:
            self._db.execute("INSERT INTO meta VALUES ('schema_version', ?)", (SCHEMA_VERSION,))
        elif row[0] != SCHEMA_VERSION:
            raise HivepathError(
                f"--db {self.path}: schema version {row[0]}, this coordinator writes {SCHEMA_VERSION}; pass a new path"
            )
        self._lock = threading.Lock()
        self.commits = 0

    def load(self) -> StoredState:
        state = StoredState()
        with self._lock:
            for peer_id, doc in self._db.execute("SELECT peer_id, doc FROM peers"):
                state.peers[peer_id] = PeerRecord.from_json(doc)
            for lease_id, peer_id, expires_at in self._db.execute("SELECT lease_id, peer_id, expires_at FROM leases"):
                state.leases[lease_id] = Lease(lease_id, peer_id, expires_at)
            for peer_id, module_id, rnd, tokens, loss, updated_at in self._db.execute("SELECT * FROM progress"):
                loss = float("nan") if loss is None else loss
                state.progress[(peer_id, module_id)] = ModuleProgress(peer_id, module_id, rnd, tokens, loss, updated_at)
            for series, t, value in self._db.execute("SELECT series, t, value FROM history ORDER BY series, t"):
                state.history.setdefault(series, []).append((t, value))
            state.meta = {k: v for k, v in self._db.execute("SELECT key, value FROM meta") if k != "schema_version"}
        return state

    def apply(self, batch: WriteBatch) -> None:
        if not batch:
            return
        peers = [(p.peer_id, p.to_json()) for p in batch.peers.values()]
        leases = [(l.lease_id, l.peer_id, l.expires_at) for l in batch.leases.values()]
        progress = [
            (p.peer_id, p.module_id, p.round, p.tokens, p.loss if math.isfinite(p.loss) else None, p.updated_at)
            for p in batch.progress.values()
        ]
        with self._lock:
            db = self._db
            db.execute("BEGIN IMMEDIATE")
            try:
                if peers:
                    db.executemany("INSERT OR REPLACE INTO peers VALUES (?, ?)", peers)
                if batch.deleted_leases:
                    db.executemany("DELETE FROM leases WHERE lease_id=?", [(i,) for i in batch.deleted_leases])
                if leases:
                    db.executemany("INSERT OR REPLACE INTO leases VALUES (?, ?, ?)", leases)
                if batch.renewals:
                    db.executemany("UPDATE leases SET expires_at=? WHERE lease_id=?",
                                   [(t, i) for i, t in batch.renewals.items()])
                if progress:
                    db.executemany("INSERT OR REPLACE INTO progress VALUES (?, ?, ?, ?, ?, ?)", progress)
                if batch.deleted_history:
                    db.executemany("DELETE FROM history WHERE series=? AND t=?", list(batch.deleted_history))
                if batch.history:
                    db.executemany("INSERT OR REPLACE INTO history VALUES (?, ?, ?)",
                                   [(name, t, v) for (name, t), v in batch.history.items()])
                if batch.meta:
                    db.executemany("INSERT OR REPLACE INTO meta VALUES (?, ?)", list(batch.meta.items()))
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
            self.commits += 1

    def close(self) -> None:
        with self._lock:
            self._db.close()

def open_store(path: Optional[str], synchronous: str = "FULL") -> Store:
    """An SQLite store at ``path``, or a memory store when ``path`` is None or ``":memory:"``."""
    if path is None or path == ":memory:":
        return MemoryStore()
    return SQLiteStore(path, synchronous=synchronous)
