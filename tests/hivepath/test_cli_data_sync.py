"""``hivepath data serve|fetch|info`` as real processes on loopback: a seeder process prints
the multiaddrs to fetch from; ``info --manifest-hash`` names it and what it holds; ``fetch`` into an
empty directory gets one path's shards byte for byte with JSON progress; a fetch killed (SIGKILL)
while it waits for a chunk only a rotten seeder had resumes asking only for the chunks it had not verified; a full
disk is a one-line error that leaves nothing complete-looking; bad flags exit 2; SIGTERM stops the
seeder with exit 0."""

from __future__ import annotations

import json
import resource
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from helpers import write_corpus
from peer.localnet import hivepath_cmd, wait_for
from models.corpus import corpus_from_paths
from models.data import Dataset, prepare

pytestmark = pytest.mark.integration

CHUNK = 2048
LOOPBACK = ["--host-maddrs", "/ip4/127.0.0.1/tcp/0"]
ENV = {"HIVEMIND_MEMORY_SHARING_STRATEGY": "file_descriptor"}


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    corpus = write_corpus(tmp_path_factory.mktemp("corpus"), per_domain=30, seed=11)
    out = tmp_path_factory.mktemp("source") / "ds"
    prepare(corpus_from_paths([str(corpus)]), out, levels=2, modules=2, chunk_size=CHUNK)
    return out


def _serve(procs, name: str, directory: Path, *extra: str) -> list[str]:
    procs.start(name, hivepath_cmd("data", "serve", str(directory), *LOOPBACK, *extra), env=ENV)
    lines = wait_for(lambda: [l for l in procs.log(name).splitlines() if l.startswith("/ip4/127.0.0.1/")], 60,
                     f"{name} to print its multiaddrs")
    return lines


def _run(*args: str, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(hivepath_cmd(*args), capture_output=True, text=True, timeout=timeout,
                          env={**__import__("os").environ, **ENV}, **kw)


@pytest.mark.slow  # four hivepath processes, each importing torch and starting a p2p daemon
def test_serve_info_fetch(source, procs, tmp_path):
    h = Dataset(source).manifest_hash
    maddrs = _serve(procs, "seeder", source)
    assert f"seeding dataset {h}: 17 of 17 files" in procs.log("seeder")

    info = _run("data", "info", "--manifest-hash", h, "--initial-peers", maddrs[0], *LOOPBACK, "--json")
    assert info.returncode == 0, info.stderr
    seeders = json.loads(info.stdout)["seeders"]
    assert len(seeders) == 1 and len(next(iter(seeders.values()))) == 17

    out = tmp_path / "fetched"
    r = _run("data", "fetch", "--manifest-hash", h, "--path", "1-0", "--out", str(out), "--initial-peers", maddrs[0],
             *LOOPBACK, "--progress", "json")
    assert r.returncode == 0, r.stderr
    events = [json.loads(l) for l in r.stdout.splitlines() if l.startswith("{")]
    assert events[-1]["done_bytes"] == events[-1]["total_bytes"] > 0 and "eta_s" in events[-1]
    assert f"fetched path(s) 1-0 of dataset {h} into {out}" in r.stdout
    got = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert got == ["manifest.json", "router.json", "shards/1-0.train.docs", "shards/1-0.train.tokens",
                   "shards/1-0.validation.docs", "shards/1-0.validation.tokens"]
    assert all((out / n).read_bytes() == (source / n).read_bytes() for n in got)

    procs.signal("seeder", signal.SIGTERM)
    assert procs.procs["seeder"].wait(timeout=60) == 0
    assert "stopped seeding" in procs.log("seeder")


@pytest.mark.slow
def test_a_killed_fetch_resumes_without_asking_again(source, procs, tmp_path):
    h = Dataset(source).manifest_hash
    rotten = tmp_path / "rotten"
    shutil.copytree(source, rotten)
    maddrs = _serve(procs, "rotten", rotten)
    shard = rotten / "shards" / "0-1.train.tokens"
    data = bytearray(shard.read_bytes())
    data[2 * CHUNK] ^= 0x01  # chunk 2 rots on the only seeder's disk after it started
    shard.write_bytes(bytes(data))

    out = tmp_path / "fetched"
    procs.start("fetch", hivepath_cmd("data", "fetch", "--manifest-hash", h, "--path", "0-1", "--out", str(out),
                                      "--initial-peers", maddrs[0], *LOOPBACK, "--progress", "json",
                                      "--timeout", "120"), env=ENV)
    wait_for(lambda: '"bad_seeder"' in procs.log("fetch"), 60, "the fetcher to drop the rotten seeder")
    log = procs.log("fetch")
    assert "sent bad bytes for chunk 2 of shards/0-1.train.tokens" in log
    procs.signal("fetch", signal.SIGKILL)  # a crash while it waits for another seeder
    procs.procs["fetch"].wait(timeout=30)
    assert not (out / "manifest.json").exists() and not (out / "shards" / "0-1.train.tokens").exists()
    names = ["router.json"] + [f"shards/0-1.{s}.{k}" for s in ("train", "validation") for k in ("tokens", "docs")]
    total = sum(-(-(source / n).stat().st_size // CHUNK) for n in names)
    kept = sum(-(-(out / n).stat().st_size // CHUNK) for n in names if (out / n).exists())
    kept += sum(p.stat().st_size // 4 for p in (out / ".fetch").rglob("*.done"))  # 4 bytes per verified chunk

    honest = _serve(procs, "honest", source)
    r = _run("data", "fetch", "--manifest-hash", h, "--path", "0-1", "--out", str(out), "--initial-peers", honest[0],
             *LOOPBACK)
    assert r.returncode == 0, r.stderr
    assert f"fetched path(s) 0-1 of dataset {h}" in r.stdout
    assert f" {total - kept} chunks from 1 seeder(s), {kept} kept from before" in r.stdout  # none asked twice
    procs.signal("honest", signal.SIGTERM)
    assert procs.procs["honest"].wait(timeout=60) == 0
    assert f"({total - kept} chunks sent)" in procs.log("honest")  # the manifest was kept too
    for name in ("shards/0-1.train.tokens", "shards/0-1.validation.docs", "router.json"):
        assert (out / name).read_bytes() == (source / name).read_bytes()


@pytest.mark.slow
def test_a_full_disk_is_one_line_and_leaves_nothing_complete(source, procs, tmp_path):
    h = Dataset(source).manifest_hash
    maddrs = _serve(procs, "seeder", source)
    out = tmp_path / "fetched"
    limit = 2 * CHUNK  # no file of ours may grow past this: the shards are larger

    def small_disk():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG) instead of killing
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    r = _run("data", "fetch", "--manifest-hash", h, "--path", "1-1", "--out", str(out), "--initial-peers", maddrs[0],
             *LOOPBACK, preexec_fn=small_disk)
    assert r.returncode == 2, r.stderr
    err = [l for l in r.stderr.splitlines() if l.startswith("hivepath: error:")]
    assert len(err) == 1 and "no room on the disk for " in err[0] and "run the same command again" in err[0]
    assert "Traceback" not in r.stderr
    assert not (out / "manifest.json").exists()
    for p in out.rglob("*"):
        if p.is_file() and not p.relative_to(out).as_posix().startswith(".fetch/"):
            assert p.read_bytes() == (source / p.relative_to(out)).read_bytes()


@pytest.mark.parametrize("args, message", [
    (["data", "fetch", "--manifest-hash", "xyz", "--path", "0", "--out", "OUT"], "is not a manifest hash"),
    (["data", "fetch", "--manifest-hash", "0123456789abcdef", "--path", "a-b", "--out", "OUT"], "is not a lattice path"),
    (["data", "fetch", "--manifest-hash", "0123456789abcdef", "--path", "0", "--out", "OUT"], "no peers to reach the swarm"),
    (["data", "fetch", "--manifest-hash", "0123456789abcdef", "--path", "0", "--out", "OUT", "--initial-peers", "nope"],
     "is not a multiaddr"),
    (["data", "info"], "pass a dataset directory, or --manifest-hash"),
])
def test_user_mistakes_exit_2(args, message, tmp_path):
    r = _run(*[str(tmp_path / "out") if a == "OUT" else a for a in args], timeout=60)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
