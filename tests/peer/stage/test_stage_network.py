"""Stage mode in a real run: volunteers too small for a path join with ``peer join --max-memory`` and
nothing else, beside path peers. The coordinator makes them stage servers and a pipeline trainer; the
trainer drives tokens through the servers; no round of the path peers fails waiting for a small
peer's declaration; the servers and the path peers holding the same modules average together,
bit-identically; a server killed with SIGKILL costs the trainer failovers, not its run, and the
coordinator refills the level."""

from __future__ import annotations

import math
import signal
import time

import pytest

from peer.localnet import LocalNetwork, wait_for
from helpers.network import tiny_network
from peer.localnet.checks import forked_rounds, replica_diff

# 3-5 minutes on a loaded two-core machine (8 processes): past pytest's default hang guard of 300 s
pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

SMALL = ("--max-memory", "0.002")
"""2 MB: the tiny preset's stage module (1.07 MB) and trainer (1.05 MB) fit 80% of it, a path (3.2 MB) does not."""


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    from models.corpus import default_corpus
    from models.data import Dataset, prepare

    out = tmp_path_factory.mktemp("data") / "default-bytes-2x2"
    prepare(default_corpus(), out, levels=2, modules=2, tokenizer="bytes")
    return Dataset(out)


def _roles(net: LocalNetwork) -> dict[str, dict]:
    """peer id -> its row of /status.json."""
    return {p["peer_id"]: p for p in (net.status_json() or {}).get("peers", [])}


def _last(net: LocalNetwork, name: str, key: str, default=0):
    values = [p[key] for p in net.progress_lines(name) if key in p]
    return values[-1] if values else default


def _path_rounds(net: LocalNetwork, since: float, until: float) -> dict:
    """The path peers' module rounds reported after ``since`` and before ``until`` (unix times): done,
    failed, and why each failed. A peer reports all its modules' rounds of one outer round at one time,
    so a report stamped ``since`` (the one that holds the round that started the window) is left out
    with the rounds in it that ran before."""
    counts: dict = {"done": 0, "failed": 0, "reasons": []}
    for name in ("path0", "path1"):
        for e in net.progress_lines(name):
            if e.get("event") == "round" and since < e.get("time", 0.0) < until:
                ok = e.get("status") == "done"
                counts["done" if ok else "failed"] += 1
                if not ok:
                    counts["reasons"].append(f"{name} {e.get('module')} round {e.get('round')}: {e.get('reason')}")
    return counts


def _sharing(net: LocalNetwork, small: set[str]) -> set[str]:
    """Of the ``small`` peer ids, those holding a module that a path peer holds too (from /status.json:
    every module's holders); empty until the status page lists the small peers' modules."""
    status = net.status_json() or {}
    modes = {p["peer_id"]: (p.get("assignment") or {}).get("mode") for p in status.get("peers", [])}
    out = set()
    for m in status.get("modules", []):
        holders = set(m.get("holders", []))
        if holders & small and any(modes.get(h) == "path" for h in holders):
            out |= holders & small
    return out


def _first_joint_round(net: LocalNetwork, sharing: set[str], since: float) -> float:
    """The time by which every peer of ``sharing`` had averaged a round with a path peer since ``since``
    (0.0 until each has)."""
    first: dict[str, float] = {}
    for name in ("path0", "path1"):
        for e in net.progress_lines(name):
            if e.get("event") == "round" and e.get("status") == "done" and e.get("time", 0.0) >= since:
                for p in sharing & set(e.get("peers", [])):
                    first[p] = min(first.get(p, math.inf), e["time"])
    return max(first.values()) if sharing and set(first) == sharing else 0.0


def test_small_volunteers_train_through_a_pipeline_beside_path_peers(procs, tmp_path, dataset):
    net = tiny_network(procs, tmp_path, dataset.dir, dataset.manifest_hash, lease_timeout=8.0)
    try:
        net.start_coordinator()
        works = {name: net.start_peer(name) for name in ("path0", "path1")}
        wait_for(lambda: min(net.module_rounds().values(), default=0) >= 2 and len(net.module_rounds()) >= 4, 180,
                 "the path peers averaging")
        for i in range(3):
            works[f"small{i}"] = net.start_peer(f"small{i}", *SMALL)
        small = [f"small{i}" for i in range(3)]
        wait_for(lambda: all(_last(net, n, "peer_id", "") for n in small), 180, "the small peers to join")
        ids = {n: net.peer_id(n) for n in small}
        rows = wait_for(lambda: (r := _roles(net)) and all(ids[n] in r for n in small) and r, 60, "their roles")
        modes = sorted(rows[ids[n]]["assignment"]["mode"] for n in small)
        assert modes == ["stage", "stage", "trainer"], rows
        trainer = next(n for n in small if rows[ids[n]]["assignment"]["mode"] == "trainer")
        servers = [n for n in small if n != trainer]
        # the trainer drives tokens through both servers, and each server trains its module on them
        wait_for(lambda: _last(net, trainer, "tokens") > 0 and all(_last(net, s, "tokens") > 0 for s in servers), 240,
                 "tokens through the pipeline")
        served = {s: rows[ids[s]]["assignment"]["module_id"] for s in servers}
        # the small peers that share a module with the path peers (the trainer's embedding and head, a
        # server's block) come into step: each averages a round with them
        driven = time.time()
        sharing = wait_for(lambda: _sharing(net, {ids[n] for n in small}), 60, "the modules' holders on the status page")
        in_step = wait_for(lambda: _first_joint_round(net, sharing, driven), 240,
                           "each small peer sharing a module to average a round with the path peers")
        # the modules the servers share with the path peers keep averaging, several rounds on
        start = dict(net.module_rounds())
        wait_for(lambda: all(net.module_rounds().get(m, 0) >= start.get(m, 0) + 3 for m in served.values()), 240,
                 "the shared modules to go on averaging")
        # no round of the path peers fails waiting for a small peer's declaration while the pipeline
        # runs with them in step: a server's or the trainer's steps are far apart, so they end their
        # rounds between steps (empty ones too) for any holder that waits. (A small peer driven again
        # after being idle first catches up, re-syncing to the holders' round, twice when the state it
        # fetched was the round in flight; a small peer whose own round failed is behind until it
        # re-syncs. The path peers wait for it meanwhile as for any holder behind: the rule that keeps
        # replicas from forking, not a stall of stage mode's own.)
        beside = _path_rounds(net, in_step, time.time())
        blamed = [r for r in beside["reasons"] if "did not declare in time" in r
                  and any(ids[n] in r for n in small)]
        assert beside["done"] >= 4 and not blamed, (beside, ids)
        # the status page counts what a server served, not what its device measured at join
        status = wait_for(lambda: (s := net.status_json()) and any(
            p["peer_id"] in (ids[x] for x in servers) and 0 < p["tokens_per_s"] for p in s["peers"]) and s, 60,
                          "a server's served tokens/s on the status page")
        assert status is not None
        # a server killed mid-run: the trainer fails over or waits, never dies
        victim = servers[0]
        procs.signal(victim, signal.SIGKILL)
        before = _last(net, trainer, "tokens")
        net.start_peer("small3", *SMALL)  # a newcomer refills the level
        # (one joining before the killed server's lease expires is made a second trainer, then moved to
        # the emptied level: a peer moved from trainer to stage server must serve)
        wait_for(lambda: _last(net, trainer, "tokens") > before + 1000, 240, "the pipeline training again")
        assert procs.procs[trainer].poll() is None, procs.log(trainer)[-2000:]
        codes = [net.stop(n) for n in ("path0", "path1", trainer, servers[1], "small3")]
        assert codes == [0] * 5, codes
        logs = [procs.log(n) for n in works]
        roots = [w / "checkpoints" for n, w in works.items() if n != victim]
        pairs, diff, first = replica_diff(roots, forked_rounds(logs))
        assert diff == 0.0, first
        assert pairs >= 3, pairs
        # the stage server's module against a path peer's copy of it, at equal rounds
        stage_pairs, diff, first = replica_diff([works[servers[1]] / "checkpoints", works["path0"] / "checkpoints",
                                                 works["path1"] / "checkpoints"], forked_rounds(logs))
        assert diff == 0.0 and stage_pairs >= 1, (stage_pairs, first)
    finally:
        net.close()


def _failovers(net: LocalNetwork, name: str) -> list[dict]:
    return [e for e in net.progress_lines(name) if e.get("event") == "failover"]


@pytest.mark.slow
def test_a_standby_server_takes_a_killed_servers_requests(procs, tmp_path, dataset):
    """``servers_per_level = 2``: five small volunteers make one pipeline with two servers a level.
    A server killed with SIGKILL costs the trainer a retry on the other server of its level (a
    ``failover`` event naming the server it went to), and the pipeline trains on with no newcomer
    and before the killed one is back."""
    net = tiny_network(procs, tmp_path, dataset.dir, dataset.manifest_hash, lease_timeout=8.0,
                  coordinator={"servers_per_level": 2})
    try:
        net.start_coordinator()
        names = [f"small{i}" for i in range(5)]
        for n in names:
            net.start_peer(n, *SMALL)
        wait_for(lambda: all(_last(net, n, "peer_id", "") for n in names), 180, "the small peers to join")
        ids = {n: net.peer_id(n) for n in names}
        rows = wait_for(lambda: (r := _roles(net)) and all(ids[n] in r for n in names) and r, 60, "their roles")
        modes = {n: rows[ids[n]]["assignment"]["mode"] for n in names}
        assert sorted(modes.values()) == ["stage"] * 4 + ["trainer"], rows
        trainer = next(n for n in names if modes[n] == "trainer")
        module = {n: rows[ids[n]]["assignment"]["module_id"] for n in names if modes[n] == "stage"}
        assert sorted(module.values()).count(sorted(module.values())[0]) == 2 and len(set(module.values())) == 2
        wait_for(lambda: all(_last(net, s, "tokens") > 0 for s in module), 240, "every server to serve tokens")
        victim = next(iter(module))
        twin = next(s for s in module if s != victim and module[s] == module[victim])
        served = _last(net, twin, "tokens")
        killed = time.time()
        procs.signal(victim, signal.SIGKILL)
        procs.procs[victim].wait(timeout=30)
        before = _last(net, trainer, "tokens")
        wait_for(lambda: _last(net, trainer, "tokens") > before + 2000, 240, "the pipeline training on its standby")
        assert _last(net, twin, "tokens") > served, "the standby took the killed server's requests"
        assert all(n == victim or procs.procs[n].poll() is None for n in names)
        # the trainer never found the level empty (it waits then, its step dropped), and its requests
        # to the killed server went on to the twin
        assert not [e for e in net.progress_lines(trainer) if e.get("event") == "progress"
                    and e.get("time", 0.0) > killed and e.get("state") == "waiting"]
        moved = [e for e in _failovers(net, trainer) if e.get("from_server") == ids[victim]]
        assert moved and all(e.get("to_server") in (ids[twin], None) for e in moved), moved
        assert any(e.get("to_server") == ids[twin] for e in moved), moved
        codes = [net.stop(n) for n in names if n != victim]
        assert codes == [0] * 4, codes
    finally:
        net.close()
