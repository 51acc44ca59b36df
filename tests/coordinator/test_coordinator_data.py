"""The coordinator's side of a volunteer needing no data of its own: seeders per shard on the status page
from peers' heartbeats, and bad seeders reported by peers and banned by two distinct reporters; then
the same fields over real gRPC."""

from __future__ import annotations

import pytest

from coordinator.core import Coordinator
from coordinator.errors import InvalidArgument
from coordinator.server import BackgroundServer, ServeOptions
from coordinator.settings import CoordinatorSettings
from coordinator.status import snapshot
from coordinator.store import MemoryStore
from coordinator.web import render_page
from models.presets import tiny_cpu
from peer.coordinator_client import CoordinatorClient, PeerInfo
from test_coordinator_core import Clock, caps, pid


def b58(i: int) -> str:
    return "12D3KooWdata" + str(i).replace("0", "z").rjust(8, "z")  # base58: no zero

HASH = "ab" * 8

RUN = tiny_cpu().replace(data={"manifest_hash": HASH}, lattice={"levels": 2, "modules_per_level": 2})
SETTINGS = CoordinatorSettings(lease_timeout=30.0, heartbeat_interval=5.0, ban_reporters=2, ban_reports=5,
                               ban_window=60.0)


def _coord() -> Coordinator:
    return Coordinator(RUN, SETTINGS, MemoryStore(), clock=Clock())


def test_status_counts_seeders_per_path_from_heartbeats_of_live_peers():
    coord = _coord()
    a = coord.join(pid(1), b"k1", caps(port=4001))
    b = coord.join(pid(2), b"k2", caps(port=4002))
    coord.heartbeat(a.lease.lease_id, pid(1), seeded_paths=coord.check_seeded_paths(["0-0", "1-1"]))
    coord.heartbeat(b.lease.lease_id, pid(2), seeded_paths=coord.check_seeded_paths(["0-0"]))
    snap = snapshot(coord)
    seeders = {p["name"]: p["seeders"] for p in snap["paths"]}
    assert seeders == {"0,0": 2, "0,1": 0, "1,0": 0, "1,1": 1}
    assert snap["data"]["paths_without_seeder"] == ["0,1", "1,0"] and snap["data"]["seeding_peers"] == 2
    assert "no seeder for the shards of 2 path(s)" in render_page(snap)
    coord.heartbeat(a.lease.lease_id, pid(1))  # None: unchanged
    assert {p["name"]: p["seeders"] for p in snapshot(coord)["paths"]}["1,1"] == 1
    coord.leave(a.lease.lease_id, pid(1))  # a peer that left seeds nothing
    assert {p["name"]: p["seeders"] for p in snapshot(coord)["paths"]} == {"0,0": 1, "0,1": 0, "1,0": 0, "1,1": 0}
    coord.heartbeat(b.lease.lease_id, pid(2), seeded_paths=frozenset())
    assert snapshot(coord)["data"]["seeding_peers"] == 0


@pytest.mark.parametrize("names", [["2-0"], ["0"], ["0-0-0"], ["a-b"], ["00-1"], ["0-0"] * 5])
def test_seeded_paths_outside_the_lattice_are_refused(names):
    with pytest.raises(InvalidArgument, match="seeded_paths"):
        _coord().check_seeded_paths(names)


def test_a_seeder_reported_by_two_distinct_peers_is_banned_even_if_it_never_joined():
    coord = _coord()
    a = coord.join(pid(1), b"k1", caps(port=4001))
    b = coord.join(pid(2), b"k2", caps(port=4002))
    bad = pid(9)
    first = coord.report_seeder(a.lease.lease_id, pid(1), bad, HASH, "shards/0-0.train.tokens", 3, "bad bytes")
    again = coord.report_seeder(a.lease.lease_id, pid(1), bad, HASH, "shards/0-0.train.tokens", 3, "bad bytes")
    assert not first.banned and not again.banned and "1 distinct reporters of 2" in again.reason
    second = coord.report_seeder(b.lease.lease_id, pid(2), bad, HASH, "router.json", 0, "bad bytes")
    assert second.banned and "2 distinct peers" in second.reason
    assert coord.bans.is_banned(bad) and "seeder of dataset" in coord.bans.is_banned(bad).reason
    assert snapshot(coord)["banned"] == [bad] and coord.counters["seeder_reports"] == 3
    with pytest.raises(InvalidArgument, match="manifest_hash"):
        coord.report_seeder(a.lease.lease_id, pid(1), pid(8), "cd" * 8, "router.json", 0, "bad bytes")
    with pytest.raises(InvalidArgument, match="itself"):
        coord.report_seeder(a.lease.lease_id, pid(1), pid(1), HASH, "router.json", 0, "bad bytes")


def test_seeders_and_seeder_reports_over_grpc():
    opts = ServeOptions(db=":memory:", port=0, http_port=0, token="tok", host="127.0.0.1")
    with BackgroundServer(RUN, SETTINGS, opts) as server:
        clients = [CoordinatorClient(f"127.0.0.1:{server.port}", "tok",
                                     PeerInfo(b58(i), "cpu", 8 << 30, 1000.0, public_key=b"k%d" % i,
                                              manifest_hash=HASH), retry_timeout=5.0) for i in (1, 2)]
        try:
            for c in clients:
                c.join()
            clients[0].heartbeat(seeded_paths=["0-1"])
            status = clients[0].status()
            assert {tuple(p["path"]): p["seeders"] for p in status["paths"]}[(0, 1)] == 1
            banned, _ = clients[0].report_seeder(b58(9), HASH, "router.json", "sent bad bytes for chunk 0")
            assert not banned
            banned, why = clients[1].report_seeder(b58(9), HASH, "router.json", "sent bad bytes for chunk 0")
            assert banned and "2 distinct peers" in why
        finally:
            for c in clients:
                c.close()
