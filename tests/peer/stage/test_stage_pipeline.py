"""Stage mode with real processes on loopback: stage servers, a trainer and a path-mode
peer, each with its own DHT and p2p daemon, averaging over :class:`peer.averaging.net_averager.NetAverager`.

The file is also the peer process: ``python tests/peer/stage/test_stage_pipeline.py '<json options>'`` runs
one role -- ``server`` (:func:`peer.node.stage_runner.run_stage_server`), ``trainer``
(:func:`peer.node.stage_runner.run_stage_trainer`) or ``path`` (:class:`peer.node.trainer.PathTrainer`) -- until
a ``stop`` file appears in the output folder (or its own step/round budget is spent), then writes
``<name>.json``. Faults are injected by request count (a server SIGKILLs itself when its N-th
backward arrives, i.e. between a forward it served and that forward's backward), never by time.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import pytest  # noqa: E402

try:
    from helpers import write_corpus
    from peer.localnet import wait_for
except ImportError:  # run as a peer process, outside pytest
    wait_for = write_corpus = None

PEER_TIMEOUT = 150.0


def _config(opts: dict):
    from models.presets import tiny_cpu

    return tiny_cpu().replace(outer={"inner_steps": opts["inner_steps"], "round_timeout": opts["round_timeout"]})


def _wait_holders(dht, run_id: str, module_ids: list[str], count: int, timeout: float = 90.0) -> None:
    """Start-up barrier of the path peer: every module has ``count`` announced holders."""
    import time

    from peer.network import HolderRecord, holders_key, read_records

    deadline = time.monotonic() + timeout
    while not all(len(read_records(dht.dht, holders_key(run_id, m), HolderRecord)) >= count for m in module_ids):
        if time.monotonic() > deadline:
            raise TimeoutError(f"holders of {module_ids} did not appear")
        time.sleep(0.1)


def main() -> None:
    import torch

    from models.data import Dataset
    from peer.node import CheckpointDir
    from peer.network import DHTOptions, start_dht
    from peer.averaging import NetAverager
    from peer.node import PeerStatus
    from peer.node import run_stage_server, run_stage_trainer
    from peer.stage import StageServerOptions

    opts = json.loads(sys.argv[1])
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    out, name = Path(opts["out"]), opts["name"]
    cfg = _config(opts)
    dht = start_dht(DHTOptions(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=opts.get("initial_peers", [])))
    if opts.get("publish_maddrs"):
        (out / f"{name}.maddrs.tmp").write_text(json.dumps(dht.maddrs()))
        os.replace(out / f"{name}.maddrs.tmp", out / f"{name}.maddrs")
    averager = NetAverager(dht, cfg.run_id, cfg.content_hash(), holder_ttl=opts.get("holder_ttl", 6.0))
    checkpoints = CheckpointDir(out / name / "ckpt", keep=100)
    dataset = Dataset(opts["data"]) if opts.get("data") else None
    status = PeerStatus()
    result: dict = {"peer_id": dht.peer_id}
    stop_file = out / "stop"
    for mid, count in opts.get("barrier", {}).items():  # start together, so that round 0 groups everyone
        if mid in opts.get("holds", []):
            averager.hold(mid, 0)
    if opts.get("barrier"):
        _wait_holders(dht, cfg.run_id, list(opts["barrier"]), min(opts["barrier"].values()))
    try:
        if opts["role"] == "server":
            def hook(point: str, count: int) -> None:
                if point == "backward" and count == opts.get("die_at_backward"):
                    print(f"FAULT: killed at backward {count}", flush=True)
                    os.killpg(os.getpgid(0), signal.SIGKILL)
                if point == "forward" and count == 1:
                    (out / f"{name}.serving").write_text("1")

            options = StageServerOptions(record_ttl=opts.get("record_ttl", 4.0))
            result["reason"] = run_stage_server(cfg, opts["module"], dataset, torch.device("cpu"), dht, averager,
                                                checkpoints, lambda: "stop" if stop_file.exists() else None,
                                                status, options=options, event_hook=hook)
            result["steps"] = status.step
        elif opts["role"] == "trainer":
            losses, stats, driving = [], {}, []

            def on_step(trainer, loss: float) -> None:
                driving[:] = [trainer]
                losses.append(loss)
                stats.update(vars(trainer.client.stats))
                (out / f"{name}.steps.tmp").write_text(str(len(losses)))
                os.replace(out / f"{name}.steps.tmp", out / f"{name}.steps")

            def should_stop():
                if opts.get("max_steps") and len(losses) >= opts["max_steps"]:
                    return "max-steps"
                if opts.get("rounds") and driving and min(driving[0].opt.module_round(m) for m in
                                                          (driving[0].embed_id, driving[0].head_id)) >= opts["rounds"]:
                    return "rounds"
                return "stop" if stop_file.exists() else None

            result["reason"] = run_stage_trainer(cfg, tuple(opts["path"]), dataset, torch.device("cpu"), dht,
                                                 averager, checkpoints, should_stop, status, codec=opts["codec"],
                                                 request_timeout=5.0, on_step=on_step,
                                                 vacant_timeout=opts.get("vacant_timeout"))
            result.update(losses=losses, stats=stats)
        else:
            from peer.node import PathTrainer

            path = tuple(opts["path"])
            def fetch(mid, like, accept=None, min_round=-1, joining=True):  # as peer.node does: re-sync after
                try:                                                           # a missed round, fresh starts
                    return averager.fetch_state(mid, timeout=10.0, like=like, accept=accept, min_round=min_round,
                                                joining=joining)
                except Exception:
                    return None

            trainer = PathTrainer(cfg, path, dataset, torch.device("cpu"), averager, checkpoints, dht.peer_id, status,
                                  fetch_state=fetch)
            rounds = opts["rounds"]
            result["reason"] = trainer.run(
                lambda: "done" if min(trainer.opt.module_round(m) for m in trainer.module_ids) >= rounds else None,
                lambda report: None)
            trainer.finish()
    finally:
        averager.shutdown()
        dht.shutdown()
    (out / f"{name}.json.tmp").write_text(json.dumps(result))
    os.replace(out / f"{name}.json.tmp", out / f"{name}.json")


# -- tests ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dataset_dir(tmp_path_factory) -> str:
    from models.corpus import corpus_from_paths
    from models.data import prepare

    root = tmp_path_factory.mktemp("stage-data")
    src = write_corpus(root / "src", per_domain=8)
    prepare(corpus_from_paths([str(src)]), root / "data", levels=2, modules=2)
    return str(root / "data")


class Swarm:
    """Peers of one test: the first publishes its address, the rest bootstrap from it."""

    def __init__(self, procs, out: Path, common: dict):
        self.procs, self.out, self.common = procs, out, common
        self.maddrs: list[str] = []

    def start(self, name: str, bootstrap: str = "", **spec) -> None:
        """Start peer ``name``; it bootstraps from ``bootstrap`` (default: the first peer)."""
        opts = {**self.common, **spec, "name": name, "out": str(self.out), "publish_maddrs": True}
        if self.maddrs:
            opts["initial_peers"] = self.address(bootstrap) if bootstrap else self.maddrs
        self.procs.start(name, [sys.executable, __file__, json.dumps(opts)], env={"OMP_NUM_THREADS": "1"})
        if not self.maddrs:
            self.maddrs = self.address(name)

    def address(self, name: str) -> list[str]:
        path = self.out / f"{name}.maddrs"
        return wait_for(lambda: path.exists() and json.loads(path.read_text()), 60, f"{name}'s address")

    def result(self, name: str) -> dict:
        proc = self.procs.procs[name]
        try:
            proc.wait(timeout=PEER_TIMEOUT)
        except Exception:
            pytest.fail(f"peer {name} did not finish:\n{self.procs.log(name)[-3000:]}")
        assert proc.returncode == 0, f"peer {name} exited {proc.returncode}:\n{self.procs.log(name)[-3000:]}"
        return json.loads((self.out / f"{name}.json").read_text())

    def steps(self, name: str) -> int:
        path = self.out / f"{name}.steps"
        return int(path.read_text()) if path.exists() else 0


@pytest.mark.integration
def test_pipeline_trains_survives_a_killed_server_and_takes_a_newcomer(procs, tmp_path, dataset_dir):
    """2 levels x 2 stage servers + 1 trainer on path (0,0). Server a0 dies when its 3rd backward
    arrives (mid-step: it served that step's forward); the step completes through a1. Then a2 joins
    L0M0, loads the module's state from a1 and serves. The loss falls throughout."""
    swarm = Swarm(procs, tmp_path, dict(inner_steps=4, round_timeout=20.0, data=dataset_dir))
    swarm.start("a0", role="server", module="L0M0", die_at_backward=3)
    swarm.start("a1", role="server", module="L0M0")
    swarm.start("b0", role="server", module="L1M0")
    swarm.start("b1", role="server", module="L1M0")
    swarm.start("t", role="trainer", path=[0, 0], codec="int8")

    wait_for(lambda: procs.procs["a0"].poll() is not None, PEER_TIMEOUT, "a0 to die at its 3rd backward")
    assert procs.procs["a0"].returncode == -signal.SIGKILL and "FAULT: killed at backward 3" in procs.log("a0")
    a1_ckpt = tmp_path / "a1" / "ckpt"
    wait_for(lambda: (a1_ckpt / "round-000001").exists(), PEER_TIMEOUT, "a1 to finish an outer round")
    swarm.start("a2", bootstrap="a1", role="server", module="L0M0")
    wait_for(lambda: (tmp_path / "a2.serving").exists(), PEER_TIMEOUT, "the newcomer a2 to serve")
    served_at_join = swarm.steps("t")
    wait_for(lambda: swarm.steps("t") >= max(40, served_at_join + 8), PEER_TIMEOUT, "40 trainer steps")
    (tmp_path / "stop").write_text("")
    t = swarm.result("t")
    servers = {n: swarm.result(n) for n in ("a1", "a2", "b0", "b1")}

    losses = t["losses"]
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 0.5, f"loss did not fall: {first:.3f} -> {last:.3f}"
    assert t["stats"]["failovers"] >= 1, "the killed server's backward was never redone elsewhere"
    assert "retrying elsewhere" in procs.log("t")
    for n, r in servers.items():
        assert r["steps"] > 0, f"{n} never took an inner step"
    a2_log = procs.log("a2")
    fetched = [line for line in a2_log.splitlines() if "module L0M0: starting from peer@" in line]
    assert fetched and int(fetched[0].rsplit("@", 1)[1]) >= 1, "a2 did not load L0M0's state from a live holder"
    # the activations travelled as int8: about a quarter of their fp32 size
    ratio = (t["stats"]["bytes_sent"] + t["stats"]["bytes_received"]) / t["stats"]["fp32_bytes"]
    assert 0.2 < ratio < 0.3, ratio


@pytest.mark.integration
def test_a_trainer_whose_level_lost_its_only_server_detours_and_comes_back(procs, tmp_path, dataset_dir):
    """One server each of L0M0, L0M1 and L1M0; a trainer of path (1,0). The only L0M1 server dies when
    its 3rd backward arrives. The trainer drives path (0,0) meanwhile (the embedding and head are
    every path's) and keeps stepping; once a new L0M1 server is up it drives (1,0) again, so the
    newcomer serves it."""
    swarm = Swarm(procs, tmp_path, dict(inner_steps=4, round_timeout=20.0, data=dataset_dir))
    swarm.start("a", role="server", module="L0M0")
    swarm.start("c", role="server", module="L0M1", die_at_backward=3)
    swarm.start("b", role="server", module="L1M0")
    swarm.start("t", role="trainer", path=[1, 0], codec="int8", vacant_timeout=2.0)

    wait_for(lambda: procs.procs["c"].poll() is not None, PEER_TIMEOUT, "c to die at its 3rd backward")
    assert procs.procs["c"].returncode == -signal.SIGKILL
    at_death = swarm.steps("t")
    wait_for(lambda: swarm.steps("t") >= at_death + 8, PEER_TIMEOUT, "8 trainer steps with no server of L0M1")
    assert "driving pipeline 0,0 instead of 1,0" in procs.log("t")
    swarm.start("c2", bootstrap="a", role="server", module="L0M1")
    wait_for(lambda: (tmp_path / "c2.serving").exists(), PEER_TIMEOUT, "the trainer to drive 1,0 through c2")
    back = swarm.steps("t")
    wait_for(lambda: swarm.steps("t") >= back + 4, PEER_TIMEOUT, "4 trainer steps back on 1,0")
    (tmp_path / "stop").write_text("")
    t = swarm.result("t")
    servers = {n: swarm.result(n) for n in ("a", "b", "c2")}
    assert "driving pipeline 1,0 instead of 0,0: pipeline 1,0 has a server on every level again" in procs.log("t")
    assert servers["a"]["steps"] > 0, "L0M0 never served the detour"
    assert servers["c2"]["steps"] > 0, "the trainer never came back to 1,0"
    # until it came back to 1,0 it never paused (after that, a newcomer that has not served yet may fail it:
    # another wait than the one this test is about)
    log = procs.log("t")
    before_back = log[:log.index("driving pipeline 1,0 instead of 0,0")]
    assert "the trainer waits for a server" not in before_back, "the trainer paused instead of detouring"
    assert all(math.isfinite(loss) for loss in t["losses"])


@pytest.mark.integration
@pytest.mark.slow
def test_stage_and_path_holders_of_a_module_stay_identical(procs, tmp_path, dataset_dir):
    """Path (0,0) trained twice at once: by a path-mode peer, and by a stage trainer (embed, head)
    through one stage server per level. Every module has one holder of each mode; after each of
    3 outer rounds their global copies and outer momentum are bit-identical. In the slow set: the
    default run compares stage servers' and path peers' snapshots with ``torch.equal`` in
    ``tests/peer/stage/test_stage_network.py``, on peers started with ``peer join``."""
    rounds, h = 3, 4
    barrier = {"embed": 2, "L0M0": 2, "L1M0": 2, "head": 2}
    swarm = Swarm(procs, tmp_path, dict(inner_steps=h, round_timeout=20.0, data=dataset_dir, barrier=barrier))
    swarm.start("s0", role="server", module="L0M0", holds=["L0M0"])
    swarm.start("s1", role="server", module="L1M0", holds=["L1M0"])
    # until its rounds are done, not a step count: a round it ends early for a waiting holder has fewer steps
    swarm.start("t", role="trainer", path=[0, 0], codec="int8", rounds=rounds, holds=["embed", "head"])
    swarm.start("p", role="path", path=[0, 0], rounds=rounds, holds=list(barrier))
    t = swarm.result("t")
    swarm.result("p")
    (tmp_path / "stop").write_text("")
    swarm.result("s0"), swarm.result("s1")

    from safetensors.torch import load_file

    holder = {"embed": "t", "head": "t", "L0M0": "s0", "L1M0": "s1"}
    for mid, name in holder.items():
        for r in range(1, rounds + 1):
            for group in ("modules", "outer"):
                mine = load_file(tmp_path / name / "ckpt" / f"round-{r:06d}" / group / f"{mid}.safetensors")
                theirs = load_file(tmp_path / "p" / "ckpt" / f"round-{r:06d}" / group / f"{mid}.safetensors")
                assert mine.keys() == theirs.keys()
                for k in mine:
                    assert torch_equal(mine[k], theirs[k]), f"{mid} {group} after round {r}: {name} and p differ at {k}"
    assert t["reason"] == "rounds" and len(t["losses"]) >= rounds
    from models.lattice import ModularLM

    init = ModularLM(_config({"inner_steps": h, "round_timeout": 20.0}).lattice, seed=0)
    for mid in holder:  # the rounds did apply averages (identical only because both sides applied them)
        final = load_file(tmp_path / "p" / "ckpt" / f"round-{rounds:06d}" / "modules" / f"{mid}.safetensors")
        start = init.mods[mid].state_dict()
        assert not all(torch_equal(final[k], start[k]) for k in final), f"{mid} never changed"


def torch_equal(a, b) -> bool:
    import torch

    return a.shape == b.shape and bool(torch.equal(a, b))


if __name__ == "__main__":
    main()
