"""One contract suite for every :class:`coordinator.store.Store`: SQLite (WAL) and in-memory."""

from __future__ import annotations

import math
import sqlite3

import pytest

from coordinator.records import Assignment, Capabilities, Lease, ModuleProgress, PeerRecord
from coordinator.sqlite_store import SQLiteStore
from coordinator.store import MemoryStore, WriteBatch
from models.errors import HivepathError


class MemoryFactory:
    def __init__(self, tmp_path):
        self.store = MemoryStore()

    def open(self):
        return self.store

    def reopen(self):
        return self.store


class SQLiteFactory:
    def __init__(self, tmp_path):
        self.path = tmp_path / "state.db"
        self.store = None

    def open(self):
        self.store = SQLiteStore(self.path)
        return self.store

    def reopen(self):
        self.store.close()
        return self.open()


@pytest.fixture(params=[MemoryFactory, SQLiteFactory], ids=["memory", "sqlite"])
def factory(request, tmp_path):
    return request.param(tmp_path)


def peer(pid: str, **kw) -> PeerRecord:
    caps = Capabilities("cuda NVIDIA H100", 80 << 30, 12345.5, 1e6, 2e6, ("/ip4/10.0.0.1/tcp/31337",))
    a = Assignment("path", (1, 0), "", ("embed", "L0M1", "L1M0", "head"), 50, "int8", "why", 3)
    return PeerRecord(pid, "ab" * 16, caps, assignment=a, first_joined=1.0, last_joined=2.0, last_seen=3.0, **kw)


def test_empty_store_loads_empty(factory):
    s = factory.open().load()
    assert s.peers == {} and s.leases == {} and s.progress == {}


def test_roundtrip_every_record(factory):
    store = factory.open()
    p = peer("12D3KooWalpha", tokens=77, joins=2, bytes_exchanged=9)
    lease = Lease("a" * 32, p.peer_id, 1234.5)
    prog = ModuleProgress(p.peer_id, "L0M1", 4, 1000, 2.5, 9.0)
    nan_prog = ModuleProgress(p.peer_id, "head", 1, 10, float("nan"), 9.0)
    store.apply(WriteBatch(peers={p.peer_id: p}, leases={lease.lease_id: lease},
                           progress={(p.peer_id, "L0M1"): prog, (p.peer_id, "head"): nan_prog},
                           meta={"run_config_hash": "x"}))
    s = factory.reopen().load()
    assert s.peers[p.peer_id] == p
    assert s.peers[p.peer_id].last_moved == float("-inf")
    assert s.leases == {lease.lease_id: lease}
    assert s.progress[(p.peer_id, "L0M1")] == prog
    assert math.isnan(s.progress[(p.peer_id, "head")].loss)
    assert s.meta["run_config_hash"] == "x"


def test_replace_and_delete(factory):
    store = factory.open()
    p = peer("12D3KooWbeta")
    store.apply(WriteBatch(peers={p.peer_id: p}, leases={"b" * 32: Lease("b" * 32, p.peer_id, 1.0)}))
    p2 = peer("12D3KooWbeta", state="left", tokens=5)
    store.apply(WriteBatch(peers={p.peer_id: p2}, deleted_leases={"b" * 32}))
    s = factory.reopen().load()
    assert s.peers[p.peer_id].state == "left" and s.peers[p.peer_id].tokens == 5
    assert s.leases == {}


def test_merged_batches_keep_the_last_word(factory):
    store = factory.open()
    first = WriteBatch(leases={"c" * 32: Lease("c" * 32, "12D3KooWgamma", 1.0)})
    second = WriteBatch(deleted_leases={"c" * 32})
    third = WriteBatch(leases={"d" * 32: Lease("d" * 32, "12D3KooWgamma", 5.0)})
    store.apply(first.merge(second).merge(third))
    assert set(factory.reopen().load().leases) == {"d" * 32}


def test_loaded_state_is_a_copy(factory):
    store = factory.open()
    p = peer("12D3KooWdelta")
    store.apply(WriteBatch(peers={p.peer_id: p}))
    p.tokens = 999  # mutating what was applied must not change what is stored
    loaded = store.load()
    loaded.peers[p.peer_id].tokens = 123
    assert factory.reopen().load().peers[p.peer_id].tokens == 0


def test_empty_batch_is_a_no_op(factory):
    store = factory.open()
    store.apply(WriteBatch())
    assert factory.reopen().load().peers == {}


def test_sqlite_uses_wal(tmp_path):
    SQLiteStore(tmp_path / "s.db").close()
    with sqlite3.connect(tmp_path / "s.db") as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_sqlite_refuses_a_file_that_is_not_a_database(tmp_path):
    bad = tmp_path / "bad.db"
    bad.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(HivepathError, match="not a usable SQLite database"):
        SQLiteStore(bad)


def test_renewals_update_existing_leases_only(factory):
    store = factory.open()
    store.apply(WriteBatch(leases={"e" * 32: Lease("e" * 32, "12D3KooWeps", 1.0)}))
    store.apply(WriteBatch(renewals={"e" * 32: 50.0, "f" * 32: 60.0}))
    assert factory.reopen().load().leases == {"e" * 32: Lease("e" * 32, "12D3KooWeps", 50.0)}
    # a renewal merged before a delete is dropped; one merged after an insert updates it
    store = factory.reopen()
    store.apply(WriteBatch(renewals={"e" * 32: 70.0}).merge(WriteBatch(deleted_leases={"e" * 32})))
    assert factory.reopen().load().leases == {}
    store = factory.reopen()
    batch = WriteBatch(leases={"g" * 32: Lease("g" * 32, "12D3KooWeps", 1.0)}).merge(WriteBatch(renewals={"g" * 32: 9.0}))
    store.apply(batch)
    assert factory.reopen().load().leases["g" * 32].expires_at == 9.0


def test_history_points_roundtrip_replace_and_delete(factory):
    store = factory.open()
    store.apply(WriteBatch(history={("tokens", 10.0): 1.0, ("tokens", 20.5): 2.0, ("bpb/0,1", 15.0): 3.25}))
    store.apply(WriteBatch(history={("tokens", 20.5): 7.0}, deleted_history={("tokens", 10.0)}))
    h = factory.reopen().load().history
    assert h == {"tokens": [(20.5, 7.0)], "bpb/0,1": [(15.0, 3.25)]}


def test_merged_history_batches_keep_the_last_word(factory):
    store = factory.open()
    store.apply(WriteBatch(history={("s", 1.0): 1.0, ("s", 2.0): 2.0}))
    batch = WriteBatch(deleted_history={("s", 1.0)}).merge(WriteBatch(history={("s", 1.0): 5.0}))
    batch.merge(WriteBatch(history={("s", 3.0): 3.0})).merge(WriteBatch(deleted_history={("s", 3.0), ("s", 2.0)}))
    store.apply(batch)
    assert factory.reopen().load().history == {"s": [(1.0, 5.0)]}
