"""The coordinator's state machine with an injected clock: join, heartbeat, expiry and reassignment,
drain, rejoin with history, and restart from the database with nothing acknowledged lost."""

from __future__ import annotations

import pytest
from hypothesis import given, settings as hsettings, strategies as st

from coordinator.core import Coordinator, ProgressReport
from coordinator.errors import Incompatible, InvalidArgument, LeaseNotFound, NoFit, PeerNotFound
from coordinator.records import Capabilities
from coordinator.settings import CoordinatorSettings
from coordinator.sqlite_store import SQLiteStore
from coordinator.store import MemoryStore
from models.presets import tiny_cpu
from models.errors import HivepathError

RUN = tiny_cpu().replace(data={"manifest_hash": "ab" * 8})
SETTINGS = CoordinatorSettings(lease_timeout=30.0, heartbeat_interval=5.0, restart_grace=60.0, min_move_interval=0.0)


class Clock:
    def __init__(self, t: float = 1_000_000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


def pid(i: int) -> str:
    return f"12D3KooWpeer{i:08d}"


def caps(tps: float = 1000.0, memory: int = 8 << 30, port: int = 4000) -> Capabilities:
    return Capabilities("cpu", memory, tps, 0.0, 0.0, (f"/ip4/127.0.0.1/tcp/{port}",))


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def coord(clock):
    return Coordinator(RUN, SETTINGS, MemoryStore(), clock=clock)


def test_join_gives_lease_assignment_and_bootstrap_peers(coord):
    first = coord.join(pid(0), b"k0", caps(port=4000))
    assert first.assignment.path == (0, 0) and first.initial_peers == [] and not first.rejoined
    second = coord.join(pid(1), b"k1", caps(port=4001))
    assert second.initial_peers == [f"/ip4/127.0.0.1/tcp/4000/p2p/{pid(0)}"]
    assert second.assignment.path == (0, 1)
    assert len(second.lease.lease_id) == 32 and second.lease.lease_id != first.lease.lease_id


def test_heartbeat_renews_and_records_progress(coord, clock):
    j = coord.join(pid(0), b"k0", caps())
    clock.advance(25)
    r = coord.heartbeat(j.lease.lease_id, pid(0), [ProgressReport("L0M0", 3, 5000, 2.5)], assignment_version=1)
    assert r.lease_remaining == 30.0 and r.assignment is None and not r.drain
    clock.advance(25)  # 50 s after join, but 25 s after the heartbeat: still alive
    assert coord.tick() == []
    assert coord.peer(pid(0)).tokens == 5000
    assert coord.progress_of(pid(0))["L0M0"].round == 3


def test_heartbeat_with_old_version_gets_the_assignment(coord):
    j = coord.join(pid(0), b"k0", caps())
    r = coord.heartbeat(j.lease.lease_id, pid(0), assignment_version=0)
    assert r.assignment == j.assignment


def test_expiry_frees_work_and_it_goes_to_another_peer(coord, clock):
    joins = [coord.join(pid(i), b"k%d" % i, caps()) for i in range(5)]  # paths 00 01 10 11 00
    assert joins[4].assignment.path == (0, 0)
    clock.advance(20)
    for i in (0, 1, 2, 4):
        coord.heartbeat(joins[i].lease.lease_id, pid(i))
    clock.advance(15)  # peer 3 (path 1,1) has been silent for 35 s
    events = coord.tick()
    assert f"lease of {pid(3)} expired" in events
    assert coord.peer(pid(3)).state == "expired"
    moved = [e for e in events if "rebalanced" in e and "to 1,1" in e]
    assert moved, events
    mover = next(i for i in (0, 4) if coord.peer(pid(i)).assignment.path == (1, 1))
    r = coord.heartbeat(joins[mover].lease.lease_id, pid(mover), assignment_version=1)
    assert r.assignment is not None and r.assignment.path == (1, 1) and r.assignment.version == 2
    assert "path 1,1 has no peer" in r.assignment.reason
    with pytest.raises(LeaseNotFound):
        coord.heartbeat(joins[3].lease.lease_id, pid(3))


def test_expired_peer_rejoins_with_its_history(coord, clock):
    j = coord.join(pid(0), b"k0", caps())
    coord.heartbeat(j.lease.lease_id, pid(0), [ProgressReport("L0M0", 1, 700, 3.0)])
    clock.advance(31)
    coord.tick()
    again = coord.join(pid(0), b"k0", caps())
    assert again.rejoined and again.assignment.path == (0, 0)
    assert again.assignment.version == j.assignment.version  # same work: no spurious change
    coord.heartbeat(again.lease.lease_id, pid(0), [ProgressReport("L0M0", 2, 100, 2.9)])
    p = coord.peer(pid(0))
    assert p.tokens == 800 and p.joins == 2 and p.first_joined == j.lease.expires_at - 30.0


def test_same_peer_id_with_another_key_is_refused(coord):
    coord.join(pid(0), b"key-A", caps())
    with pytest.raises(InvalidArgument, match="peer_id: .* different public key"):
        coord.join(pid(0), b"key-B", caps())


def test_leave_frees_work_at_once(coord):
    a = coord.join(pid(0), b"k0", caps())
    coord.leave(a.lease.lease_id, pid(0), "done")
    assert coord.peer(pid(0)).state == "left"
    assert coord.view.holders == {}
    with pytest.raises(LeaseNotFound):
        coord.heartbeat(a.lease.lease_id, pid(0))


def test_preemption_notice_drains_and_hands_work_over(coord, clock):
    a = coord.join(pid(0), b"k0", caps())
    b = coord.join(pid(1), b"k1", caps())
    c = coord.join(pid(2), b"k2", caps())
    d = coord.join(pid(3), b"k3", caps())
    e = coord.join(pid(4), b"k4", caps())  # second peer on path (0,0)
    r = coord.heartbeat(b.lease.lease_id, pid(1), preempting=True)
    assert r.drain and "preemption" in r.drain_reason
    assert coord.peer(pid(1)).state == "draining"
    events = coord.tick()
    assert any("to 0,1" in ev for ev in events)
    coord.leave(b.lease.lease_id, pid(1), "preempted")
    assert coord.peer(pid(1)).state == "left"
    del a, c, d, e


def test_operator_drain(coord):
    a = coord.join(pid(0), b"k0", caps())
    assert coord.drain(pid(0), "maintenance") == "draining"
    r = coord.heartbeat(a.lease.lease_id, pid(0))
    assert r.drain and r.drain_reason == "maintenance" and r.assignment is None
    with pytest.raises(PeerNotFound):
        coord.drain(pid(9))


def test_refusals(coord):
    with pytest.raises(NoFit, match="capabilities.memory_bytes: no work fits"):
        coord.join(pid(0), b"k", caps(memory=1000))
    with pytest.raises(Incompatible, match="manifest_hash"):
        coord.join(pid(1), b"k", caps(), manifest_hash="cd" * 8)
    j = coord.join(pid(2), b"k2", caps(), manifest_hash="ab" * 8)
    with pytest.raises(InvalidArgument, match="progress.module_id"):
        coord.heartbeat(j.lease.lease_id, pid(2), [ProgressReport("L9M9", 1, 1, 1.0)])
    with pytest.raises(LeaseNotFound):
        coord.heartbeat(j.lease.lease_id, pid(3))
    assert coord.peer(pid(0)) is None


def test_restart_from_sqlite_loses_nothing_acknowledged(tmp_path, clock):
    db = tmp_path / "state.db"
    store = SQLiteStore(db)
    coord = Coordinator(RUN, SETTINGS, store, clock=clock)
    joins = [coord.join(pid(i), b"k%d" % i, caps(1000.0 + i)) for i in range(6)]
    coord.leave(joins[5].lease.lease_id, pid(5))
    coord.drain(pid(4), "op")
    coord.heartbeat(joins[0].lease.lease_id, pid(0), [ProgressReport("embed", 2, 300, 2.0)])
    coord.store.apply(coord.take_dirty())  # the periodic group commit
    before = {p.peer_id: p for p in coord.peers()}
    leases_before = {l.lease_id: l.peer_id for l in coord.leases()}
    store.close()  # no clean shutdown of the coordinator itself: like kill -9 after the commits

    clock.advance(45)  # down longer than lease_timeout: the grace period keeps leases alive
    again = Coordinator(RUN, SETTINGS, SQLiteStore(db), clock=clock)
    after = {p.peer_id: p for p in again.peers()}
    assert after == before
    assert {l.lease_id: l.peer_id for l in again.leases()} == leases_before
    assert all(l.expires_at >= clock() + 60 for l in again.leases())
    assert again.tick() == []  # nothing expires, nothing is reshuffled
    r = again.heartbeat(joins[0].lease.lease_id, pid(0), assignment_version=1)
    assert r.assignment is None and not r.drain
    assert again.heartbeat(joins[4].lease.lease_id, pid(4)).drain
    assert again.progress_of(pid(0))["embed"].tokens == 300
    assert again.peer(pid(0)).assignment == joins[0].assignment


def test_database_of_another_run_is_refused(tmp_path, clock):
    db = tmp_path / "state.db"
    Coordinator(RUN, SETTINGS, SQLiteStore(db), clock=clock)
    with pytest.raises(HivepathError, match="belongs to run"):
        Coordinator(RUN.replace(seed=7), SETTINGS, SQLiteStore(db), clock=clock)


def test_heartbeat_durability_is_the_flush(tmp_path, clock):
    """A renewal that was not flushed is lost on a crash, and the restart grace covers it."""
    db = tmp_path / "state.db"
    coord = Coordinator(RUN, SETTINGS, SQLiteStore(db), clock=clock)
    j = coord.join(pid(0), b"k0", caps())
    clock.advance(20)
    coord.heartbeat(j.lease.lease_id, pid(0))
    stored = SQLiteStore(db).load().leases[j.lease.lease_id].expires_at
    assert stored == j.lease.expires_at  # not yet flushed
    coord.store.apply(coord.take_dirty())
    assert SQLiteStore(db).load().leases[j.lease.lease_id].expires_at == clock() + 30


def test_rejoin_that_no_longer_fits_releases_the_old_lease(coord):
    j = coord.join(pid(0), b"k0", caps())
    with pytest.raises(NoFit):
        coord.join(pid(0), b"k0", caps(memory=1000))
    assert coord.peer(pid(0)).state == "expired"
    assert coord.leases() == [] and coord.view.holders == {}
    assert coord.store.load().peers[pid(0)].state == "expired"
    with pytest.raises(LeaseNotFound):
        coord.heartbeat(j.lease.lease_id, pid(0))


@hsettings(max_examples=40, deadline=None, derandomize=True)
@given(steps=st.lists(st.tuples(st.floats(0.0, 20.0), st.sets(st.integers(0, 7))), min_size=1, max_size=25))
def test_property_tick_expires_exactly_the_lapsed_leases(steps):
    clock = Clock()
    coord = Coordinator(RUN, SETTINGS, MemoryStore(), clock=clock)
    leases = {i: coord.join(pid(i), b"k%d" % i, caps()).lease.lease_id for i in range(8)}
    last_beat = {i: clock() for i in leases}
    for dt, beating in steps:
        clock.advance(dt)
        coord.tick()
        for i in beating:
            if clock() - last_beat[i] < SETTINGS.lease_timeout:
                coord.heartbeat(leases[i], pid(i))
                last_beat[i] = clock()
    clock.advance(0.0)
    coord.tick()
    alive = {i for i in leases if clock() - last_beat[i] < SETTINGS.lease_timeout}
    assert {l.peer_id for l in coord.leases()} == {pid(i) for i in alive}
    assert {p.peer_id for p in coord.peers() if p.state == "expired"} == {pid(i) for i in set(leases) - alive}
