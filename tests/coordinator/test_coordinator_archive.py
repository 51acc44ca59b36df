"""Archive peers at the coordinator: a lease but no work, never counted as coverage, handed out first
as DHT bootstrap peers."""

from __future__ import annotations

from coordinator.core import Coordinator
from coordinator.store import MemoryStore
from test_coordinator_core import RUN, SETTINGS, Clock, caps, pid


def test_archive_gets_no_work_and_is_bootstrapped_first():
    coord = Coordinator(RUN, SETTINGS, MemoryStore(), clock=Clock())
    trainer = coord.join(pid(0), b"k0", caps(port=4000))
    archive = coord.join(pid(9), b"k9", caps(memory=0, tps=0.0, port=4009), archive=True)
    assert archive.assignment.mode == "archive" and archive.assignment.label() == "archive"
    assert "archive" in archive.assignment.reason
    assert archive.initial_peers == [f"/ip4/127.0.0.1/tcp/4000/p2p/{pid(0)}"]
    # the archive covers no path: the next trainer still gets an uncovered path, and the archive's
    # address comes first in its bootstrap list
    second = coord.join(pid(1), b"k1", caps(port=4001))
    assert second.assignment.mode == "path" and second.assignment.path != trainer.assignment.path
    assert second.initial_peers[0] == f"/ip4/127.0.0.1/tcp/4009/p2p/{pid(9)}"
    assert pid(9) not in coord.view.path_peers.get((0, 0), {})


def test_archive_leave_and_rejoin_keeps_counts_consistent():
    coord = Coordinator(RUN, SETTINGS, MemoryStore(), clock=Clock())
    a = coord.join(pid(9), b"k9", caps(memory=0, tps=0.0), archive=True)
    coord.leave(a.lease.lease_id, pid(9))
    again = coord.join(pid(9), b"k9", caps(memory=0, tps=0.0), archive=True)
    assert again.assignment.mode == "archive" and again.rejoined
    assert not coord.view.path_tps and not coord.view.module_members
