"""The run's history (coordinator.history): bounded series, thinned oldest first, mirrored into write
batches; the coordinator's sampling, per-peer rounds and evaluation reports (injected clock); and
totals, rounds and history surviving a restart of the real ``hivepath coordinator serve`` process."""

from __future__ import annotations

import json
import urllib.request

import pytest

from coordinator.core import Coordinator
from coordinator.errors import InvalidArgument
from coordinator.history import History, thin
from coordinator.records import Capabilities
from coordinator.results import PathEvaluation, ProgressReport
from coordinator.settings import CoordinatorSettings
from coordinator.store import MemoryStore, WriteBatch
from helpers.network import HISTORY_RUN_TOML
from peer.localnet import free_port, hivepath_cmd, wait_for
from models.presets import tiny_cpu
from peer.coordinator_client import CoordinatorClient, Evaluation, PeerInfo, Progress


def test_thin_drops_every_other_older_point_until_it_fits():
    points = [(float(t), float(t)) for t in range(10)]
    dropped = thin(points, 8)
    assert dropped == [(1.0, 1.0), (3.0, 3.0)]
    kept = [p for p in points if p not in dropped]
    assert len(kept) == 8 and kept[0] == points[0] and kept[-5:] == points[-5:]
    assert thin(points, 10) == []
    with pytest.raises(ValueError, match="max_points"):
        thin(points, 2)


def test_history_stays_bounded_spans_the_run_and_mirrors_the_store():
    store = MemoryStore()
    h = History(max_points=16)
    for t in range(1000):
        batch = WriteBatch()
        h.add("tokens", float(t), float(10 * t), batch)
        store.apply(batch)
    pts = h.series()["tokens"]
    assert len(pts) <= 16
    assert pts[0] == (0.0, 0.0) and pts[-1] == (999.0, 9990.0), "the first and the latest point stay"
    assert pts == sorted(pts)
    assert store.load().history["tokens"] == pts
    assert History(store.load().history, 16).last("tokens") == (999.0, 9990.0)


def test_history_refuses_a_non_finite_point():
    with pytest.raises(ValueError, match="finite"):
        History().add("tokens", 1.0, float("nan"), WriteBatch())


class Clock:
    def __init__(self):
        self.t = 1_000_000.0

    def __call__(self):
        return self.t


def _coordinator(store, clock):
    return Coordinator(tiny_cpu(), CoordinatorSettings(), store, clock=clock)


def test_sampling_rounds_and_totals_survive_a_restart():
    store, clock = MemoryStore(), Clock()
    coord = _coordinator(store, clock)
    j = coord.join("12D3KooWhista", b"k", Capabilities("cpu", 8 << 30, 1000.0))
    mods = j.assignment.module_ids
    lease = j.lease.lease_id
    store.apply(coord.sample_history())
    for rnd in (3, 4, 6):  # the first report sets where the peer starts: 3 rounds from 3 to 6
        clock.t += 10
        coord.heartbeat(lease, "12D3KooWhista", [ProgressReport(m, rnd, 100 * rnd, 2.0) for m in mods],
                        bytes_exchanged=50 * rnd)
        store.apply(coord.take_dirty())
        store.apply(coord.sample_history())
    series = coord.history_series()
    assert [v for _, v in series["tokens"]] == [0.0, 300.0, 400.0, 600.0]
    assert [v for _, v in series["tokens_per_s"]] == [30.0, 10.0, 20.0]
    assert [v for _, v in series["peers_online"]] == [1.0] * 4
    assert series["bytes_exchanged"][-1][1] == 300.0
    assert coord.peer("12D3KooWhista").rounds == 3

    again = _coordinator(store, clock)
    assert again.history_series() == series
    assert again.peer("12D3KooWhista").rounds == 3 and again.peer("12D3KooWhista").tokens == 600
    assert again.module_rounds == {m: 6 for m in mods}
    assert again.counters["heartbeats"] == 3 and again.counters["joins"] == 1


def test_only_an_archive_reports_validation_and_bad_numbers_are_refused():
    store, clock = MemoryStore(), Clock()
    coord = _coordinator(store, clock)
    trainer = coord.join("12D3KooWtrain", b"k", Capabilities("cpu", 8 << 30, 1000.0))
    archive = coord.join("12D3KooWarchv", b"a", Capabilities("cpu", 0, 0.0), archive=True)
    good = [PathEvaluation((0, 1), 3.5, 2)]
    with pytest.raises(InvalidArgument, match="only an archive peer") as e:
        coord.heartbeat(trainer.lease.lease_id, "12D3KooWtrain", evaluations=good)
    assert e.value.field == "evaluations"
    assert coord.history_series() == {}
    for bad, field in (([PathEvaluation((0, 2), 3.0)], "evaluations.path"),
                       ([PathEvaluation((0,), 3.0)], "evaluations.path"),
                       ([PathEvaluation((0, 1), float("nan"))], "evaluations.bpb"),
                       ([PathEvaluation((0, 1), 65.0)], "evaluations.bpb"),
                       (good + good, "evaluations.path")):
        with pytest.raises(InvalidArgument) as e:
            coord.check_evaluations(bad)
        assert e.value.field == field
    coord.check_evaluations(good)
    coord.heartbeat(archive.lease.lease_id, "12D3KooWarchv", evaluations=good)
    clock.t += 10
    coord.heartbeat(archive.lease.lease_id, "12D3KooWarchv", evaluations=[PathEvaluation((0, 1), 3.0, 3)])
    store.apply(coord.take_dirty())
    assert [v for _, v in coord.history_series()["bpb/0,1"]] == [3.5, 3.0]
    assert _coordinator(store, clock).status_view().latest_bpb == {"0,1": (clock.t, 3.0)}


TOKEN = "history-test-token"
RUN_TOML = HISTORY_RUN_TOML


def _status(http_port: int, path: str = "/status.json") -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}{path}", timeout=10) as r:
        return json.loads(r.read())


def _serve(procs, name, tmp_path, port, http_port):
    procs.start(name, hivepath_cmd("coordinator", "serve", "--run-config", str(tmp_path / "run.toml"), "--db",
                                   str(tmp_path / "state.db"), "--host", "127.0.0.1", "--port", str(port),
                                   "--http-port", str(http_port)), env={"HIVEPATH_TOKEN": TOKEN})
    return wait_for(lambda: _status(http_port), 60, f"{name}'s status page", interval=0.2)


@pytest.mark.integration
def test_totals_rounds_and_history_survive_a_restart_of_the_process(procs, tmp_path):
    (tmp_path / "run.toml").write_text(RUN_TOML)
    port, http_port = free_port(), free_port()
    _serve(procs, "coord1", tmp_path, port, http_port)
    trainer = CoordinatorClient(f"127.0.0.1:{port}", TOKEN, PeerInfo("12D3KooWrestartxxxxx", "cpu", 8 << 30, 1000.0),
                                backoff_base=0.05, backoff_max=0.5, heartbeat_stream=False)
    archive = CoordinatorClient(f"127.0.0.1:{port}", TOKEN,
                                PeerInfo("12D3KooWrestartarchx", "cpu", 0, 0.0, archive=True),
                                backoff_base=0.05, backoff_max=0.5, heartbeat_stream=False)
    try:
        mods = trainer.join().assignment.module_ids
        archive.join()
        for rnd in (2, 3, 5):
            trainer.heartbeat(progress=[Progress(m, rnd, 100 * rnd, 3.0) for m in mods], bytes_sent=10 * rnd)
        archive.heartbeat(evaluations=[Evaluation(trainer.joined.assignment.path, 4.75, 5)])
        before = wait_for(lambda: (s := _status(http_port))["totals"]["tokens"] == 500
                          and _status(http_port, "/history.json")["series"].get("tokens", [[0, 0]])[-1][1] == 500
                          and s, 30, "the reports in the status")
        history = _status(http_port, "/history.json")["series"]
        assert procs.stop(["coord1"]) == {"coord1": 0}  # SIGTERM: flushes state and stops

        after = _serve(procs, "coord2", tmp_path, port, http_port)
        assert after["totals"]["tokens"] == 500
        assert {m: after["totals"]["module_rounds"][m] for m in mods} == {m: 5 for m in mods}
        assert after["counters"]["heartbeats"] == before["counters"]["heartbeats"] == 4
        assert after["counters"]["evaluations"] == 1
        row = next(c for c in after["contributions"] if c["peer_id"] == trainer.peer.peer_id)
        assert (row["tokens"], row["rounds"], row["share"]) == (500, 3, 1.0)
        name = ",".join(map(str, trainer.joined.assignment.path))
        assert next(p for p in after["paths"] if p["name"] == name)["val_bpb"] == 4.75
        later = _status(http_port, "/history.json")["series"]
        for series, points in history.items():
            assert later[series][:len(points)] == points, f"{series} continues where it was"
    finally:
        trainer.close()
        archive.close()
