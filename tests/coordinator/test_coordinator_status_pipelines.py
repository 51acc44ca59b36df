"""Pipelines and roles on the coordinator's status outputs: ``/status.json``, the HTML page and
``/metrics``, over real HTTP, from a Coordinator (injected clock) whose three small peers form a
pipeline: served throughput shows 0 until measured, never the figure measured at join."""

from __future__ import annotations

import json
import urllib.request
from dataclasses import replace
from html.parser import HTMLParser

import pytest
from prometheus_client.parser import text_string_to_metric_families

from coordinator.core import Coordinator
from coordinator.records import MODE_STAGE, MODE_TRAINER, Capabilities
from coordinator.scheduler import fits_path
from coordinator.settings import CoordinatorSettings
from coordinator.status import snapshot
from coordinator.store import MemoryStore
from coordinator.web import StatusServer
from models.config import format_path
from models.presets import tiny_cpu

RUN = tiny_cpu()
SETTINGS = CoordinatorSettings(min_move_interval=60.0)
_, PATH_NEED = fits_path(Capabilities("cpu", 8 << 30, 1000.0), RUN, SETTINGS)
SMALL = Capabilities("cpu", int(PATH_NEED * 0.6), 5000.0)
"""Too small for a path, big enough for a stage or a trainer; 5000 tokens/s at join, never shown."""


class Clock:
    t = 1_000_000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def pipeline():
    """A coordinator with a stage server on each level and a trainer, and its status server."""
    coord = Coordinator(RUN, SETTINGS, MemoryStore(), clock=Clock())
    joins = {}
    for i in range(3):
        pid = f"12D3KooWpipe{i:08d}"
        joins[pid] = coord.join(pid, f"k{i}".encode(), replace(SMALL, multiaddrs=(f"/ip4/127.0.0.1/tcp/{5000 + i}",)))
    http = StatusServer(lambda max_peers: snapshot(coord, max_peers), host="127.0.0.1", port=0).start()
    try:
        yield coord, joins, http
    finally:
        http.stop()


def _get(http: StatusServer, path: str) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{http.port}{path}", timeout=10) as r:
        assert r.status == 200
        return r.read().decode()


def _metrics(http: StatusServer) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(_get(http, "/metrics")) for s in f.samples}


def _roles(joins) -> tuple[list[str], str]:
    servers = sorted(p for p, j in joins.items() if j.assignment.mode == MODE_STAGE)
    [trainer] = [p for p, j in joins.items() if j.assignment.mode == MODE_TRAINER]
    return servers, trainer


def _measure(coord: Coordinator, joins, peer_id: str, tps: float, capacity: float = 0.0) -> None:
    j = joins[peer_id]
    coord.heartbeat(j.lease.lease_id, peer_id, assignment_version=j.assignment.version, tokens_per_s=tps,
                    measured=True, capacity=capacity)


class _Text(HTMLParser):
    """The page's text, and the text of the element with id ``table_id`` (nested tags included)."""

    def __init__(self, table_id: str):
        super().__init__()
        self.table_id, self.depth = table_id, 0
        self.text: list[str] = []
        self.table: list[str] = []

    def handle_starttag(self, tag, attrs):
        if self.depth or dict(attrs).get("id") == self.table_id:
            self.depth += 1

    def handle_endtag(self, tag):
        if self.depth:
            self.depth -= 1

    def handle_data(self, data):
        self.text.append(data)
        if self.depth:
            self.table.append(data)


def _page(http: StatusServer, table_id: str) -> tuple[str, str]:
    page = _Text(table_id)
    page.feed(_get(http, "/"))
    return " ".join(page.text), " ".join(page.table)


def test_json_shows_roles_reasons_and_served_figures(pipeline):
    coord, joins, http = pipeline
    servers, trainer = _roles(joins)
    path = joins[trainer].assignment.path
    s = json.loads(_get(http, "/status.json"))
    rows = {p["peer_id"]: p for p in s["peers"]}
    assert {p: r["role"] for p, r in rows.items()} == {servers[0]: "stage", servers[1]: "stage", trainer: "trainer"}
    for pid, j in joins.items():
        assert rows[pid]["role_reason"] == j.assignment.reason
    assert "has a server on every level and no trainer" in rows[trainer]["role_reason"]
    assert any("waits for" in rows[p]["role_reason"] for p in servers)
    # nothing served yet: 0, never the 5000 tokens/s measured at join
    assert all(r["tokens_per_s"] == 0.0 for r in rows.values())
    assert [rows[p]["capacity_tokens_per_s"] for p in servers] == [0.0, 0.0]
    assert rows[trainer]["capacity_tokens_per_s"] is None
    assert s["total_tokens_per_s"] == 0.0
    assert s["peer_roles"] == {"path": 0, "stage": 2, "trainer": 1, "archive": 0}
    [pipe] = s["pipelines"]
    assert pipe["name"] == format_path(path) and pipe["state"] == "running"
    assert pipe["trainers"] == [{"peer_id": trainer, "tokens_per_s": 0.0}]
    assert [[sv["peer_id"] for sv in lv["servers"]] for lv in pipe["levels"]] == [[p] for p in servers]
    assert all(lv["busy"] is None and lv["tokens_per_s"] == 0.0 for lv in pipe["levels"])

    _measure(coord, joins, servers[0], 800.0, 1000.0)
    _measure(coord, joins, servers[1], 600.0, 2000.0)
    _measure(coord, joins, trainer, 700.0)
    s = json.loads(_get(http, "/status.json"))
    rows = {p["peer_id"]: p for p in s["peers"]}
    assert [rows[p]["tokens_per_s"] for p in (*servers, trainer)] == [800.0, 600.0, 700.0]
    assert [rows[p]["capacity_tokens_per_s"] for p in servers] == [1000.0, 2000.0]
    assert s["total_tokens_per_s"] == 700.0, "a trainer's tokens, counted once, not again at each stage"
    [pipe] = s["pipelines"]
    assert pipe["tokens_per_s"] == 700.0 and [lv["busy"] for lv in pipe["levels"]] == [0.8, 0.3]
    stages = {m["module_id"]: m for m in s["stages"]}
    assert {lv["module"]: lv["busy"] for lv in pipe["levels"]} == {m: r["busy"] for m, r in stages.items()}
    assert stages[pipe["levels"][0]["module"]]["capacity_tokens_per_s"] == 1000.0
    modules = {m["module_id"]: m["tokens_per_s"] for m in s["modules"]}
    assert [modules[lv["module"]] for lv in pipe["levels"]] == [800.0, 600.0]
    lattice = RUN.lattice
    assert modules[lattice.embed_id(path)] == 700.0 and modules[lattice.head_id(path)] == 700.0


def test_page_has_the_pipelines_table_and_each_peers_role(pipeline):
    coord, joins, http = pipeline
    servers, trainer = _roles(joins)
    _measure(coord, joins, servers[0], 800.0, 1000.0)
    _measure(coord, joins, trainer, 700.0)
    text, table = _page(http, "pipelines")
    name = format_path(joins[trainer].assignment.path)
    for needle in (name, "running", trainer, "700 tokens/s", servers[0], "800 of 1000 tokens/s", "80% busy",
                   servers[1], "busy not measured yet"):
        assert needle in table, needle
    _, peers = _page(http, "peers")
    for pid, j in joins.items():
        assert j.assignment.reason in peers, pid
    assert "why this role" in peers and "trainer" in peers and "stage" in peers

    module = joins[servers[1]].assignment.module_id
    coord.leave(joins[servers[1]].lease.lease_id, servers[1])
    _, table = _page(http, "pipelines")
    assert f"paused: no server of {module}" in table and "no server" in table


def test_metrics_show_pipelines_stages_and_roles(pipeline):
    coord, joins, http = pipeline
    servers, trainer = _roles(joins)
    name = format_path(joins[trainer].assignment.path)
    modules = [joins[p].assignment.module_id for p in servers]
    m = _metrics(http)
    assert m[("hivepath_coordinator_peers_role", (("role", "stage"),))] == 2
    assert m[("hivepath_coordinator_peers_role", (("role", "trainer"),))] == 1
    assert m[("hivepath_coordinator_peers_role", (("role", "path"),))] == 0
    assert m[("hivepath_coordinator_pipeline_running", (("path", name),))] == 1
    assert m[("hivepath_coordinator_pipeline_tokens_per_second", (("path", name),))] == 0.0
    assert m[("hivepath_coordinator_stage_tokens_per_second", (("module", modules[0]),))] == 0.0
    assert ("hivepath_coordinator_stage_busy_ratio", (("module", modules[0]),)) not in m, "not measured yet"

    _measure(coord, joins, servers[0], 800.0, 1000.0)
    _measure(coord, joins, trainer, 700.0)
    m = _metrics(http)
    assert m[("hivepath_coordinator_tokens_per_second", ())] == 700.0
    assert m[("hivepath_coordinator_pipeline_tokens_per_second", (("path", name),))] == 700.0
    assert m[("hivepath_coordinator_stage_servers", (("module", modules[0]),))] == 1
    assert m[("hivepath_coordinator_stage_tokens_per_second", (("module", modules[0]),))] == 800.0
    assert m[("hivepath_coordinator_stage_busy_ratio", (("module", modules[0]),))] == 0.8
    assert ("hivepath_coordinator_stage_busy_ratio", (("module", modules[1]),)) not in m
