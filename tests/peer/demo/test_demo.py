"""``hivepath demo --small-peers N``: peers too small for a path join the demo as stage servers and
pipeline trainers. The flag, the memory the demo gives them (checked against the coordinator's own
decisions), the roles read from each peer's progress lines, the live table and the report; the whole
demo with small peers is ``slow``. The demo without them: ``test_peer_network.test_demo_short_run_writes_report``."""

from __future__ import annotations

import json

import pytest

from coordinator.pipelines import trainer_memory
from coordinator.records import MODE_STAGE, MODE_TRAINER, Capabilities
from coordinator.scheduler import assign_peer, fits_path
from coordinator.settings import CoordinatorSettings
from coordinator.view import ClusterView
from peer.localnet import hivepath_cmd
from helpers.cli import run_cli
from hivepath.cli import build_parser
from models.presets import PRESETS, tiny_cpu
from peer.demo import DemoMonitor, PeerLines, small_peer_memory
from peer.demo.report import role_lines, role_table
from peer.demo.roles import MEMORY_HEADROOM


def test_small_peers_flag_defaults_to_none_and_takes_a_count():
    parser = build_parser()
    assert parser.parse_args(["demo"]).small_peers == 0
    assert parser.parse_args(["demo", "--small-peers", "3"]).small_peers == 3


@pytest.mark.parametrize("value", ["-1", "two", "1.5"])
def test_small_peers_flag_refuses_what_is_not_a_count(value):
    r = run_cli("demo", "--small-peers", value)
    assert r.returncode == 2 and r.stdout == ""
    [line] = r.stderr.strip().splitlines()
    assert "--small-peers" in line and "integer >= 0" in line and "Traceback" not in r.stderr


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_small_peer_memory_gets_a_stage_and_a_trainer_never_a_path(preset):
    """The coordinator's own decisions on the demo's small peer: no path fits, every block and a trainer
    do, and small peers joining an empty run serve stages, then drive the pipeline they complete."""
    run = PRESETS[preset]()
    settings = CoordinatorSettings()
    assert settings.memory_headroom == MEMORY_HEADROOM, "the demo judges fit with the coordinator's headroom"
    small = small_peer_memory(run)
    caps = Capabilities("cpu", int(small.max_memory_gb * 2**30), 1000.0)
    usable = caps.memory_bytes * settings.memory_headroom
    fits, need = fits_path(caps, run, settings)
    assert not fits and need == small.path_bytes
    assert usable >= trainer_memory(run, run.inner.batch_size) == small.trainer_bytes
    lattice = run.lattice
    assert all(lattice.training_memory_bytes([m], run.inner.batch_size) <= usable
               for m in lattice.module_ids() if lattice.module_kind(m) == "block")
    view, modes = ClusterView(), []
    for i in range(lattice.levels + 1):
        a, reason = assign_peer(0.0, caps, view, run, settings)
        assert a is not None, reason
        view.add(f"small{i}", a, 0.0)
        modes.append(a.mode)
    assert modes == [MODE_STAGE] * lattice.levels + [MODE_TRAINER], modes


def _progress(mode: str, work: str, tokens: int, state: str = "training", peer_id: str = "QmSmall") -> str:
    return json.dumps({"event": "progress", "peer_id": peer_id, "mode": mode, "assignment": work,
                       "state": state, "tokens": tokens, "tokens_per_s": 10.0}) + "\n"


def test_peer_lines_follow_role_work_and_tokens(tmp_path):
    log = tmp_path / "small0.log"
    log.write_text("an earlier run's line\n")
    lines = PeerLines()
    lines.watch("small0", log)
    with open(log, "a") as f:
        f.write(_progress("path", "", 0, "joining"))  # no work yet: no role
        f.write("17:19:07 INFO peer.node.stage_runner: serving L0M1; waiting for a trainer\n")
        f.write(_progress("stage", "L0M1", 0, "waiting"))
        f.write(_progress("stage", "L0M1", 512))
        f.write(json.dumps({"event": "failover", "module": "L0M1"}) + "\n")
        f.write(_progress("stage", "L0M1", 1024)[:30])  # still being written
    lines.read()
    peer = lines.peers["small0"]
    assert (peer.role, peer.work, peer.tokens, peer.failovers) == ("stage", "L0M1", 512, 1)
    assert lines.names() == {"QmSmall": "small0"}
    with open(log, "a") as f:
        f.write(_progress("stage", "L0M1", 1024)[30:])
        f.write(_progress("trainer", "1,1", 256))  # moved by the coordinator: counts from 0 again
    lines.read()
    assert peer.to_dict()["tokens_by_role"] == {"stage": 1024, "trainer": 256}
    assert (peer.role, peer.work, peer.to_dict()["tokens"]) == ("trainer", "1,1", 1280)


class _Client:
    def __init__(self, status: dict):
        self._status = status

    def status(self) -> dict:
        return self._status


def _peer(peer_id: str, mode: str, work: str, path: list[int], tokens: int) -> dict:
    return {"peer_id": peer_id, "mode": mode, "work": work, "path": path, "tokens": tokens, "state": "active",
            "tokens_per_s": 100.0, "last_seen_age_s": 1.0}


def test_monitor_shows_roles_and_counts_served_tokens_once(tmp_path):
    from rich.console import Console

    cfg = tiny_cpu()
    lines = PeerLines()
    for name, peer_id, mode, work, tokens in [("peer0", "QmPath", "path", "0,0", 4096),
                                              ("small0", "QmStage0", "stage", "L0M1", 1024),
                                              ("small1", "QmStage1", "stage", "L1M1", 1024),
                                              ("small2", "QmTrainer", "trainer", "1,1", 1024)]:
        lines.watch(name, tmp_path / f"{name}.log")  # before the peer starts: no log yet
        (tmp_path / f"{name}.log").write_text(_progress(mode, work, tokens, peer_id=peer_id))
    status = {"peers": [_peer("QmPath", "path", "path 0,0", [0, 0], 4096),
                        _peer("QmStage0", "stage", "stage L0M1", [], 1024),
                        _peer("QmStage1", "stage", "stage L1M1", [], 1024),
                        _peer("QmTrainer", "trainer", "trainer 1,1", [1, 1], 1024),
                        _peer("QmArchive", "archive", "archive", [], 0)],
              "modules": [], "paths": [], "bytes_exchanged": 1000}
    monitor = DemoMonitor(cfg, live=False, lines=lines)
    monitor.poll(_Client(status), {}, 0)
    assert monitor.history[-1]["tokens"] == 4096 + 1024, "a stage's served tokens are its trainer's"
    console = Console(width=200, record=True)
    console.print(monitor._table(status, 10.0, 0))
    table = console.export_text()
    for row in (("small0", "stage", "training", "L0M1", "1,024 served"), ("small2", "trainer", "1,1"),
                ("peer0", "path", "0,0", "4,096"), ("archive", "active")):
        assert any(all(cell in line for cell in row) for line in table.splitlines()), (row, table)
    summary = monitor.summary(cfg, type("Opts", (), {"peers": 1, "small_peers": 3, "minutes": 1.0})(),
                              8.0, 5.0, {}, {})
    assert summary["tokens"] == 4096 + 1024 and summary["small_peers"] == 3
    assert summary["tokens_by_role"] == {"path": 4096, "stage": 2048, "trainer": 1024}
    assert summary["peer_roles"]["small1"] == {"peer_id": "QmStage1", "role": "stage", "work": "L1M1",
                                               "state": "training", "tokens": 1024, "tokens_by_role": {"stage": 1024},
                                               "failovers": 0}
    assert "small0   stage    L0M1   1,024 served as stage" in role_lines(summary)
    assert "| small2 | trainer | 1,1 | 1,024 trained as trainer | 0 |" in role_table(summary)


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_demo_with_small_peers_trains_paths_and_a_pipeline(tmp_path):
    """Two path peers and three small ones on the tiny preset: a pipeline forms (two stage servers and
    a trainer) and trains beside the path peers; every process exits 0 and the report names the roles."""
    import subprocess

    out = tmp_path / "demo"
    r = subprocess.run(hivepath_cmd("demo", "--peers", "2", "--small-peers", "3", "--minutes", "1", "--preset", "tiny",
                                    "--out", str(out), "--data", str(tmp_path / "data"), "--no-live",
                                    "--eval-docs", "4"),
                       capture_output=True, text=True, timeout=560)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert all(code == 0 for code in summary["exit_codes"].values()), summary["exit_codes"]
    assert summary["stopped_by"] is None and summary["bpb_after"] < summary["bpb_before"]
    roles = summary["peer_roles"]
    assert [roles[f"peer{i}"]["role"] for i in range(2)] == ["path", "path"], roles
    small = [roles[f"small{i}"] for i in range(3)]
    assert sorted(p["role"] for p in small) == ["stage", "stage", "trainer"], roles
    assert all(p["tokens"] > 0 for p in roles.values()), roles
    assert summary["tokens_by_role"]["trainer"] > 0 and summary["tokens_by_role"]["stage"] > 0
    assert summary["small_peer_max_memory_gb"] == small_peer_memory(tiny_cpu()).max_memory_gb
    report = (out / "report.md").read_text()
    assert "3 small peers" in report and "served as stage" in report and "trained as trainer" in report
    assert "peers (role, work, tokens):" in r.stdout and "trained as trainer" in r.stdout
