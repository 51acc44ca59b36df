"""A volunteer needs no data, end to end with real processes: a coordinator, an archive that
seeds the operator's prepared dataset, and peers that join with empty work directories on a run
whose corpus is not on their machine. Each fetches only its own path's shards (byte for byte the
operator's), trains, and seeds what it holds (the coordinator's status page counts the seeders of
every shard). A seeder serving tampered bytes is dropped by every peer it sends them to, reported,
and banned by the coordinator once two distinct peers reported it.

The corpus is not the built-in one; the run config names a corpus directory that does not exist on
the peers' side, so they cannot prepare it and must fetch."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from helpers import write_corpus
from peer.localnet import LocalNetwork, hivepath_cmd, wait_for
from helpers.network import tiny_network
from models.data import Dataset

pytestmark = pytest.mark.integration

LATTICE = {"levels": 1, "modules_per_level": 2}


@pytest.fixture(scope="module")
def operator_data(tmp_path_factory) -> Dataset:
    """The operator prepares a custom corpus with the command line (1x2 lattice: two paths)."""
    root = tmp_path_factory.mktemp("operator")
    corpus = write_corpus(root / "corpus", per_domain=40, seed=3)
    out = root / "prepared"
    r = subprocess.run(hivepath_cmd("data", "prepare", str(corpus), "--out", str(out), "--lattice", "1x2"),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return Dataset(out)


def _network(procs, tmp_path: Path, data: Dataset) -> LocalNetwork:
    # a corpus directory the peers do not have: they must fetch the dataset
    return tiny_network(procs, tmp_path, data.dir, data.manifest_hash, inner_steps=4, lattice=LATTICE,
                   corpus=str(tmp_path / "operator-only-corpus"))


def _start_archive_seeding(net: LocalNetwork) -> None:
    net.start_coordinator()
    net.start_archive()
    wait_for(lambda: all(p["seeders"] >= 1 for p in (net.status_json() or {}).get("paths", [{"seeders": 0}])),
             90, "the archive to seed every path")


def _trained(net: LocalNetwork, name: str, steps: int = 1) -> bool:
    return any(p.get("event") == "progress" and p.get("step", 0) >= steps for p in net.progress_lines(name))


def _fetched_dir(work: Path, data: Dataset) -> Path:
    return work / f"data-{data.manifest_hash}"


def _shards(directory: Path) -> set[str]:
    return {p.name for p in (directory / "shards").iterdir()} if (directory / "shards").is_dir() else set()


def _assert_own_path_only(net: LocalNetwork, name: str, work: Path, data: Dataset) -> str:
    """The peer's fetched directory holds its path's four shard files, equal to the operator's, and
    no other path's; returns the path's name."""
    peer = net.peer_assignment(net.peer_id(name))
    path = "-".join(map(str, peer["path"]))
    want = {f"{path}.{split}.{kind}" for split in ("train", "validation") for kind in ("tokens", "docs")}
    fetched = _fetched_dir(work, data)
    wait_for(lambda: _shards(fetched) == want, 60, f"{name}'s validation shard too")
    for f in want | {"router.json"}:
        rel = f if f == "router.json" else f"shards/{f}"
        assert (fetched / rel).read_bytes() == (data.dir / rel).read_bytes(), rel
    return path


def test_a_volunteer_with_an_empty_work_dir_fetches_its_path_and_trains(operator_data, procs, tmp_path):
    net = _network(procs, tmp_path, operator_data)
    try:
        _start_archive_seeding(net)
        work = net.start_peer("peer0", data=False)
        wait_for(lambda: _trained(net, "peer0"), 120, "peer0 to train on fetched data")
        lines = net.progress_lines("peer0")
        fetches = [p for p in lines if p.get("event") == "fetch"]
        assert fetches and fetches[-1]["done_bytes"] == fetches[-1]["total_bytes"] > 0
        path = _assert_own_path_only(net, "peer0", work, operator_data)
        # the peer seeds its path now: two seeders of it (archive and peer), one of the other path
        wait_for(lambda: {p["name"].replace(",", "-"): p["seeders"] for p in net.status_json()["paths"]}.get(path) == 2,
                 30, "the peer's heartbeats to say it seeds its path")
        assert net.stop("peer0") == 0
    finally:
        net.close()


def _tamper(source: Path, dest: Path) -> None:
    """A copy of the dataset whose every data file has one byte flipped in every 1 MiB chunk."""
    shutil.copytree(source, dest)
    for f in dest.rglob("*"):
        if f.is_file() and f.name != "manifest.json" and f.stat().st_size:
            raw = bytearray(f.read_bytes())
            for i in range(0, len(raw), 1 << 20):
                raw[i] ^= 0xFF
            f.write_bytes(bytes(raw))


@pytest.mark.slow
def test_two_volunteers_fetch_their_own_paths_and_a_tampering_seeder_is_banned(operator_data, procs, tmp_path):
    net = _network(procs, tmp_path, operator_data)
    try:
        _start_archive_seeding(net)
        tampered = tmp_path / "tampered"
        _tamper(operator_data.dir, tampered)
        procs.start("tamperer", hivepath_cmd("data", "serve", str(tampered), "--no-verify", "--coordinator",
                                             net.address, "--token-file", str(net.root / "token"),
                                             "--host-maddrs", "/ip4/127.0.0.1/tcp/0"), env=net.env)
        line = wait_for(lambda: next((l for l in procs.log("tamperer").splitlines() if "/p2p/" in l), None), 60,
                        "the tampering seeder to start")
        tamperer = re.search(r"/p2p/(\w+)", line).group(1)
        works = {name: net.start_peer(name, data=False) for name in ("peer0", "peer1")}
        for name in works:
            wait_for(lambda: _trained(net, name, 2), 180, f"{name} to train on fetched data")
        paths = {name: _assert_own_path_only(net, name, work, operator_data) for name, work in works.items()}
        assert sorted(paths.values()) == ["0", "1"]  # one path each, and only its own shards
        for name in works:  # each was sent bad bytes by the tamperer, dropped it and reported it
            bad = [p for p in net.progress_lines(name) if p.get("event") == "bad_seeder"]
            assert bad and {p["seeder"] for p in bad} == {tamperer}, name
        status = wait_for(lambda: (s := net.status_json()) and tamperer in s["banned"] and s, 30,
                          "the coordinator to ban the tampering seeder")
        assert status["counters"]["seeder_reports"] >= 2 and status["counters"]["bans"] >= 1
        assert f"banned {tamperer}" in procs.log("coordinator")
        for name in works:
            assert net.stop(name) == 0
    finally:
        net.close()
