"""The volunteer peer end to end: a real coordinator, archive and peers as processes on loopback.

Invariants checked after faults: replicas of every module are bit-identical at equal rounds (peer
checkpoints and the archive's snapshots), loss falls, drained peers exit 0 with a checkpoint.
"""

from __future__ import annotations

import json
import re

import pytest

from peer.localnet import LocalNetwork, wait_for
from helpers.network import tiny_network
from peer.localnet.checks import first_loss, loss_thirds
from helpers.replicas import assert_identical_at_equal_rounds
from peer.localnet.checks import forked_rounds, snapshots_by_round
from peer.node import CheckpointDir
from peer.node.machine_share import usable_cores

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """The built-in corpus prepared once for the 2x2 lattice (a few seconds)."""
    from models.corpus import default_corpus
    from models.data import Dataset, prepare

    out = tmp_path_factory.mktemp("data") / "default-bytes-2x2"
    prepare(default_corpus(), out, levels=2, modules=2, tokenizer="bytes")
    return Dataset(out)


def all_training(net: LocalNetwork, names: list[str], rounds: int) -> list[str] | None:
    """The peers' ids once every one of them holds modules and every held module has done ``rounds``."""
    try:
        ids = [net.peer_id(name) for name in names]
    except AssertionError:  # a peer has printed no progress yet
        return None
    modules = (net.status() or {}).get("modules", [])
    held = [m for m in modules if m.get("holders")]
    if any(not any(pid in m["holders"] for m in held) for pid in ids):
        return None
    return ids if held and min(m["round"] for m in held) >= rounds else None


def test_network_trains_drains_and_replicas_stay_identical(procs, tmp_path, dataset):
    net = tiny_network(procs, tmp_path, dataset.dir, dataset.manifest_hash, share_cores=True)
    try:
        net.start_coordinator()
        archive = net.start_archive(eval_docs=1)  # its scores reach the status page (checked below)
        works = [net.start_peer(f"peer{i}") for i in range(3)]
        wait_for(lambda: all_training(net, ["peer0", "peer1", "peer2"], 6), 240,
                 "all three peers training, 6 rounds on every held module")
        # each peer measured its bandwidth against the coordinator and reported it at join
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{net.http_port}/status.json", timeout=10) as resp:
            peers = [p for p in json.loads(resp.read())["peers"] if p.get("mode", "path") != "archive"]
        measured = [p for p in peers if p["upload_bps"] > 0 and p["download_bps"] > 0]
        assert len(measured) >= 3, peers
        # the coordinator dialled each back at join (all on loopback here: all reachable)
        assert [p["reachability"] for p in peers] == ["reachable"] * len(peers), peers
        # the archive scored the paths whose every module it holds on validation documents and reported them
        status = wait_for(lambda: (s := net.status_json()) and any(p["val_bpb"] is not None for p in s["paths"]) and s,
                          120, "the archive's validation result on the status page")
        scored = {p["name"]: p["val_bpb"] for p in status["paths"] if p["val_bpb"] is not None}
        assert scored and set(scored) <= {p["name"] for p in status["paths"]}, scored
        assert all(0 < v < 64 for v in scored.values()) and status["counters"]["evaluations"] >= 1
        # three peers on one machine, no --threads: each came to use a third of the cores
        threads = max(1, usable_cores() // 3)
        for i in range(3):
            shares = re.findall(r"sharing this machine's \d+ cores (.*?)by default: (\d+) torch threads", net.procs.log(f"peer{i}"))
            assert shares and shares[-1] == ("with 2 other peers ", str(threads)), (i, shares)
        codes = [net.stop(f"peer{i}") for i in range(3)]
        assert codes == [0, 0, 0], [net.procs.log(f"peer{i}")[-2000:] for i in range(3)]
        for w in works:
            assert CheckpointDir(w / "checkpoints").load_latest() is not None
        forked = forked_rounds([net.procs.log(f"peer{i}") for i in range(3)])
        pairs = assert_identical_at_equal_rounds([w / "checkpoints" for w in works], forked=forked)
        assert pairs >= 3
        wait_for(lambda: CheckpointDir(archive).snapshots(), 30, "an archive snapshot")
        assert_identical_at_equal_rounds([archive, *[w / "checkpoints" for w in works]], forked=forked)
        # thirds, not the first and last reading: one reading of a small batch is noisy (a CI run failed
        # 3.277 -> 3.288 on endpoints alone). A peer that started from untrained modules must have lowered
        # its loss. One that joined late starts from modules the others trained, beside a fresh module of
        # its own path; its loss can rise while that path settles (a CI run: 3.98 -> 4.62 over 20 readings,
        # peer0 five seconds after the others on a loaded machine), so it is held to staying below the loss
        # the untrained model had (a diverged model is above it).
        lines = {i: net.progress_lines(f"peer{i}") for i in range(3)}
        untrained = max(first_loss(lines[i]) for i in range(3))
        for i in range(3):
            first, last, n = loss_thirds(lines[i])
            assert n >= 3, f"peer{i}: {n} loss readings"
            if first_loss(lines[i]) > 0.9 * untrained:  # started from scratch
                assert last < first, f"peer{i} loss did not fall: first third {first:.3f}, last {last:.3f}, {n} readings"
            else:
                assert last < untrained, (f"peer{i}, which joined late, ended above the untrained loss: last third "
                                          f"{last:.3f}, untrained {untrained:.3f}")
        # a drained peer left: the coordinator no longer counts it as live
        assert (net.status() or {}).get("live_leases", 99) <= 1
    finally:
        net.close()


def test_kill9_peer_comes_back_bit_identical_and_archive_restores(procs, tmp_path, dataset):
    net = tiny_network(procs, tmp_path, dataset.dir, dataset.manifest_hash, lease_timeout=6.0)
    try:
        net.start_coordinator()
        archive = net.start_archive()
        w0 = net.start_peer("peer0")
        w1 = net.start_peer("peer1")
        # both peers must be in: embed, head and peer0's path alone are already four held modules
        victim = wait_for(lambda: all_training(net, ["peer0", "peer1"], 2), 240,
                          "both peers training, two rounds on every held module")[1]
        rounds_at_kill = net.module_rounds()
        net.procs.kill("peer1")
        # the survivor goes on: its modules' rounds advance without the victim
        wait_for(lambda: net.module_rounds().get("embed", 0) >= rounds_at_kill["embed"] + 2, 120,
                 "the survivor to complete rounds after the kill")
        # the lease expires and the coordinator frees the victim's work
        wait_for(lambda: (net.peer_assignment(victim) or {}).get("state") != "active", 30,
                 "the killed peer's lease to expire")
        # restarted with the same identity and work dir: it rejoins and is bit-identical after a round
        net.procs.start("peer1b", net.procs.procs["peer1"].args, env=net.env)
        wait_for(lambda: "rejoined" in net.procs.log("peer1b") or "joined run" in net.procs.log("peer1b"), 120,
                 "the restarted peer to join")
        before = len(CheckpointDir(w1 / "checkpoints").snapshots())
        wait_for(lambda: len(CheckpointDir(w1 / "checkpoints").snapshots()) >= before + 2, 180,
                 "the restarted peer to complete two rounds")
        # the archive polls: let it take every module before the last trainers go (L1M0 is trained by the
        # restarted peer alone and can be a round or two old when it stops)
        held = set(net.module_rounds())  # the trainers still prune their own snapshots: ask the coordinator
        wait_for(lambda: held <= set(snapshots_by_round(archive)), 60, f"the archive to hold {sorted(held)}",
                 interval=0.5)
        assert net.stop("peer1b") == 0
        assert net.stop("peer0") == 0
        assert_identical_at_equal_rounds([w0 / "checkpoints", w1 / "checkpoints"], min_pairs=2)
        # every trainer gone: a fresh peer (no checkpoint) resumes from the archive, not from init
        wait_for(lambda: CheckpointDir(archive).snapshots(), 30, "an archive snapshot")
        fresh = net.start_peer("peer2")
        wait_for(lambda: "starting from" in net.procs.log("peer2"), 120, "the fresh peer to load its modules")
        log = net.procs.log("peer2")
        wait_for(lambda: "starting from" in net.procs.log("peer2") and net.procs.log("peer2").count("starting from") >= 4,
                 60, "all four modules loaded")
        log = net.procs.log("peer2")
        assert "starting from peer" in log and "starting from init" not in log, log[-3000:]
        assert net.stop("peer2") == 0
        assert_identical_at_equal_rounds([archive, fresh / "checkpoints"])
        # started with --eval-docs 0 (the tests' network's default): the archive scored no snapshot
        archive_log = net.procs.log("archive")
        assert "not scoring snapshots" in archive_log and "validation of" not in archive_log, archive_log[-2000:]
    finally:
        net.close()


def test_kill9_frees_the_path_and_another_peer_takes_it_within_the_lease(procs, tmp_path):
    """Two paths (a 1x2 lattice), three peers: one path has two peers, the other one. ``kill -9`` of
    the lone one: when its lease expires the coordinator moves a peer of the doubly held path to the
    freed path, and that peer trains it (its modules' rounds advance under the new holder)."""
    import time

    from models.corpus import default_corpus
    from models.data import Dataset, prepare

    prepare(default_corpus(), tmp_path / "data-1x2", levels=1, modules=2, tokenizer="bytes")
    data = Dataset(tmp_path / "data-1x2")
    lease = 6.0
    net = tiny_network(procs, tmp_path, data.dir, data.manifest_hash, lease_timeout=lease,
                  lattice={"levels": 1, "modules_per_level": 2})
    try:
        net.start_coordinator()
        for name in ("peer0", "peer1", "peer2"):
            net.start_peer(name)

        def by_path() -> dict[int, list[str]]:
            out: dict[int, list[str]] = {}
            for p in (net.status() or {}).get("peers", []):
                if p["state"] == "active" and p["mode"] == "path":
                    out.setdefault(p["path"][0], []).append(p["peer_id"])
            return out

        wait_for(lambda: sorted(len(v) for v in by_path().values()) == [1, 2] and len(net.module_rounds()) == 4
                 and min(net.module_rounds().values()) >= 1, 180, "three peers on both paths, one round done")
        paths = by_path()
        lone_path = next(p for p, peers in paths.items() if len(peers) == 1)
        victim = paths[lone_path][0]
        names = wait_for(lambda: {net.peer_id(n): n for n in ("peer0", "peer1", "peer2")}, 30, "every peer's id")
        net.procs.kill(names[victim])
        killed_at = time.monotonic()
        moved = wait_for(lambda: [p for p in by_path().get(lone_path, []) if p != victim] or None,
                         lease + 30, f"another peer to be assigned the freed path {lone_path}")
        assert len(moved) == 1 and moved[0] in paths[1 - lone_path], (moved, paths)
        took = time.monotonic() - killed_at
        module = f"L0M{lone_path}"
        before = net.module_rounds().get(module, 0)
        wait_for(lambda: net.module_rounds().get(module, 0) >= before + 1
                 and moved[0] in next(m["holders"] for m in (net.status() or {})["modules"] if m["module_id"] == module),
                 120, f"the moved peer to complete a round of {module}")
        assert (net.peer_assignment(victim) or {}).get("state") != "active"  # freed by the lease, not a guess
        log = net.procs.log(names[moved[0]])
        assert f"reassigned to path {lone_path} (" in log and f"path {lone_path} has no peer" in log, log[-2000:]
        # a machine too small for any work: one line, exit 5, and the run goes on
        import subprocess

        from peer.localnet import hivepath_cmd

        r = subprocess.run(hivepath_cmd("peer", "join", "--work-dir", str(tmp_path / "tiny"), "--max-memory", "0.000001",
                                        "--measure-seconds", "0.3", *net.common()),
                           capture_output=True, text=True, timeout=180, env={**__import__("os").environ, **net.env})
        assert r.returncode == 5 and "no work fits" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
        for name in names.values():
            if name != names[victim]:
                assert net.stop(name) == 0
        print(f"path {lone_path} reassigned {took:.1f}s after the kill (lease {lease}s)")
    finally:
        net.close()


def test_cli_errors_are_one_line_with_exit_codes(tmp_path, dataset):
    import subprocess

    from peer.localnet import free_port, hivepath_cmd

    def run(*args, env=None):
        import os

        r = subprocess.run(hivepath_cmd(*args), capture_output=True, text=True, timeout=120,
                           env={**os.environ, **(env or {})})
        return r.returncode, r.stderr

    port = free_port()
    code, err = run("peer", "join", "--coordinator", f"127.0.0.1:{port}", "--token", "x", "--work-dir",
                    str(tmp_path / "w"), "--coordinator-timeout", "2")
    assert code == 3 and "Traceback" not in err and "127.0.0.1" in err, err
    code, err = run("peer", "join", "--coordinator", f"127.0.0.1:{port}", "--work-dir", str(tmp_path / "w"),
                    env={"HIVEPATH_TOKEN": ""})
    assert code == 2 and "token" in err and "Traceback" not in err, err
    code, err = run("peer", "join", "--token", "x", env={"HIVEPATH_COORDINATOR": ""})
    assert code == 2 and "--coordinator" in err, err
    code, err = run("peer", "join", "--coordinator", "h:1", "--token", "x", "--keep-checkpoints", "0")
    assert code == 2 and "--keep-checkpoints" in err, err
    code, err = run("archive", "--coordinator", "h:1", "--token", "x")
    assert code == 2 and "--dir" in err, err


def test_wrong_token_incompatible_data_and_identity_in_use(procs, tmp_path, dataset):
    import subprocess

    from peer.localnet import hivepath_cmd
    from peer.network import load_or_create_identity

    net = tiny_network(procs, tmp_path, dataset.dir, "ab" * 8)  # the run pins another dataset
    try:
        net.start_coordinator()
        base = ["peer", "join", "--coordinator", net.address, "--work-dir", str(tmp_path / "w"),
                "--coordinator-timeout", "10", "--data", str(dataset.dir)]
        r = subprocess.run(hivepath_cmd(*base, "--token", "wrong"), capture_output=True, text=True, timeout=120)
        assert r.returncode == 3 and "token" in r.stderr.lower() and "Traceback" not in r.stderr, r.stderr
        r = subprocess.run(hivepath_cmd(*base, "--token", net.token), capture_output=True, text=True, timeout=120)
        assert r.returncode == 4 and "manifest" in r.stderr and "Traceback" not in r.stderr, r.stderr
        (tmp_path / "w2").mkdir()
        held = load_or_create_identity(tmp_path / "w2" / "identity.key")
        try:
            r = subprocess.run(hivepath_cmd("peer", "join", "--coordinator", net.address, "--token", net.token,
                                            "--work-dir", str(tmp_path / "w2"), "--coordinator-timeout", "10"),
                               capture_output=True, text=True, timeout=120)
        finally:
            held.release()
        assert r.returncode == 6 and "in use" in r.stderr and "Traceback" not in r.stderr, r.stderr
    finally:
        net.close()


def test_demo_short_run_writes_report(tmp_path):
    import subprocess

    from peer.localnet import hivepath_cmd

    out = tmp_path / "demo"
    r = subprocess.run(hivepath_cmd("demo", "--peers", "2", "--minutes", "0.5", "--preset", "tiny", "--out", str(out),
                                    "--data", str(tmp_path / "data"), "--no-live", "--eval-docs", "4"),
                       capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    for key in ("bpb_before", "bpb_after", "bytes_exchanged", "ddp_bytes_equivalent", "tokens", "peers", "minutes"):
        assert key in summary
    assert summary["tokens"] > 0 and summary["bytes_exchanged"] > 0
    assert summary["ddp_bytes_equivalent"] > summary["bytes_exchanged"]  # H=10, int8: far fewer bytes
    assert all(code == 0 for code in summary["exit_codes"].values()), summary["exit_codes"]
    # nothing but its --minutes ended the run (a CI run saw one stopped early by a signal: say which)
    assert summary["stopped_by"] is None, (summary, r.stdout[-2000:], r.stderr[-4000:])
    assert summary["bpb_after"] < summary["bpb_before"]
    assert summary["module_rounds"] and max(summary["module_rounds"].values()) >= 1, summary["module_rounds"]
    assert (out / "report.md").exists() and (out / "loss.png").stat().st_size > 1000
    assert "bits per byte" in r.stdout
    # piped, without the live table: progress lines at an interval and every peer's events, one line each
    assert re.search(r"INFO peer\.demo\.report: demo \d+s: 2 peers, [\d,]+ tokens, [\d.]+ MB exchanged, rounds L0M0:r\d+",
                     r.stderr), r.stderr[-3000:]
    for event in ("peer0 join: ", "peer1 assignment: mode=path", "peer0 round: ", "peer1 leave: "):
        assert event in r.stderr, (event, r.stderr[-3000:])
    # no --small-peers: every peer trains a whole path (small peers: tests/peer/demo/test_demo.py)
    assert summary["small_peers"] == 0 and summary["small_peer_max_memory_gb"] is None
    assert {n: p["role"] for n, p in summary["peer_roles"].items()} == {"peer0": "path", "peer1": "path"}
    assert "| peer0 | path |" in (out / "report.md").read_text()
