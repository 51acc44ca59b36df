"""The status page, the JSON status and Prometheus metrics, over real HTTP from a real server."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from html.parser import HTMLParser

import pytest
from prometheus_client.parser import text_string_to_metric_families

from coordinator.core import ProgressReport
from coordinator.results import PathEvaluation
from coordinator.records import Capabilities
from coordinator.server import BackgroundServer, ServeOptions
from coordinator.settings import CoordinatorSettings
from models.presets import tiny_cpu

RUN = tiny_cpu()


@pytest.fixture(scope="module")
def server():
    opts = ServeOptions(db=":memory:", port=0, http_port=0, token="t", host="127.0.0.1")
    with BackgroundServer(RUN, CoordinatorSettings(), opts) as srv:
        coord = srv.coordinator
        for i, tps in enumerate([1000.0, 2000.0, 500.0]):
            pid = f"12D3KooWweb{'abc'[i]}xxxxxxxx"
            j = coord.join(pid, b"k", Capabilities("cuda H100" if i == 1 else "cpu", 8 << 30, tps))
            mods = j.assignment.module_ids
            coord.heartbeat(j.lease.lease_id, pid, [ProgressReport(m, 3 + i, 1000 * (i + 1), 2.0 + i) for m in mods],
                            bytes_exchanged=4096)
            coord.sample_history()
        archive = coord.join("12D3KooWwebarchivexx", b"a", Capabilities("cpu", 0, 0.0), archive=True)
        coord.heartbeat(archive.lease.lease_id, "12D3KooWwebarchivexx",
                        evaluations=[PathEvaluation((0, 0), 4.5, 3), PathEvaluation((0, 1), 4.25, 3)])
        coord.leave(archive.lease.lease_id, "12D3KooWwebarchivexx")  # left peers stay in the contributions
        yield srv


def get(server, path):
    with urllib.request.urlopen(f"http://127.0.0.1:{server.http_port}{path}", timeout=10) as r:
        return r.status, r.headers.get("Content-Type"), r.read().decode()


def test_json_status(server):
    status, ctype, body = get(server, "/status.json")
    assert status == 200 and ctype == "application/json"
    s = json.loads(body)
    assert s["run_id"] == RUN.run_id and s["live_leases"] == 3
    assert s["total_tokens_per_s"] == 3500.0
    assert s["bytes_exchanged"] == 3 * 4096
    by_path = {p["name"]: p for p in s["paths"]}
    assert by_path["0,0"]["loss"] == 2.0 and by_path["0,1"]["loss"] == 3.0 and by_path["1,1"]["loss"] is None
    embed = next(m for m in s["modules"] if m["module_id"] == "embed")
    assert len(embed["holders"]) == 3 and embed["round"] == 5
    assert [[c["module_id"] for c in row] for row in s["lattice"]["grid"]] == [["L0M0", "L0M1"], ["L1M0", "L1M1"]]
    assert by_path["0,0"]["val_bpb"] == 4.5 and by_path["1,1"]["val_bpb"] is None
    assert s["totals"]["tokens"] == 6000 and s["totals"]["module_rounds"]["embed"] == 5
    contrib = s["contributions"]
    assert [c["tokens"] for c in contrib] == [3000, 2000, 1000, 0]
    assert contrib[0]["share"] == 0.5 and contrib[-1]["state"] == "left"
    # path peers: their join figure counts, no pipelines
    # (tests/coordinator/test_coordinator_status_pipelines.py has them)
    assert {p["role"] for p in s["peers"]} == {"path"} and all(p["role_reason"] for p in s["peers"])
    assert all(p["capacity_tokens_per_s"] is None for p in s["peers"])
    assert s["pipelines"] == [] and s["stages"] == [] and s["peer_roles"]["path"] == 3


def test_history_json(server):
    status, ctype, body = get(server, "/history.json")
    assert status == 200 and ctype == "application/json"
    series = json.loads(body)["series"]
    assert [v for _, v in series["tokens"]] == [1000.0, 3000.0, 6000.0]
    assert [v for _, v in series["peers_online"]] == [1.0, 2.0, 3.0]
    assert series["bpb/0,0"][0][1] == 4.5 and series["bpb/0,1"][0][1] == 4.25


def test_metrics_parse_with_prometheus_parser(server):
    status, ctype, body = get(server, "/metrics")
    assert status == 200 and ctype.startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(body)}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}
    assert samples[("hivepath_coordinator_leases", ())] == 3
    assert samples[("hivepath_coordinator_peers", (("state", "active"),))] == 3
    assert samples[("hivepath_coordinator_tokens_per_second", ())] == 3500.0
    assert samples[("hivepath_coordinator_module_holders", (("module", "embed"),))] == 3
    assert samples[("hivepath_coordinator_path_loss", (("path", "1,0"),))] == 4.0
    assert samples[("hivepath_coordinator_joins_total", ())] == 4  # the archive's too
    assert samples[("hivepath_coordinator_heartbeats_total", ())] == 4
    assert samples[("hivepath_coordinator_path_validation_bpb", (("path", "0,1"),))] == 4.25
    assert ("hivepath_coordinator_path_validation_bpb", (("path", "1,1"),)) not in samples
    assert samples[("hivepath_coordinator_evaluations_total", ())] == 2
    assert samples[("hivepath_coordinator_peers_role", (("role", "path"),))] == 3
    assert samples[("hivepath_coordinator_peers_role", (("role", "stage"),))] == 0
    assert not any(name.startswith("hivepath_coordinator_pipeline_") for name, _ in samples), "no pipelines"


class _Collect(HTMLParser):
    def __init__(self):
        super().__init__()
        self.text: list[str] = []
        self.tags: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)

    def handle_data(self, data):
        self.text.append(data)


def test_status_page_for_people(server):
    status, ctype, body = get(server, "/")
    assert status == 200 and ctype.startswith("text/html")
    page = _Collect()
    page.feed(body)
    text = " ".join(page.text)
    assert "hivepath run" in text and "3500 tokens/s" in text
    for needle in ("cuda H100", "path 0,1", "L0M0", "L1M1", "exchanged", "Pipelines", "why this role"):
        assert needle in text, needle
    assert page.tags.count("table") == 4
    for needle in ("validation bits per byte", "tokens per second", "peers online", "Contributions", "50.0%"):
        assert needle in text, needle
    assert page.tags.count("figure") == 5 and page.tags.count("polyline") >= 5
    assert "http://" not in body.replace(f"http://127.0.0.1:{server.http_port}", ""), "nothing loaded from elsewhere"


def test_refresh_query_is_checked(server):
    assert "setInterval" in get(server, "/?refresh=2")[2]
    for bad in ("0.5", "fast"):
        with pytest.raises(urllib.error.HTTPError) as e:
            get(server, f"/?refresh={bad}")
        assert e.value.code == 400 and "refresh" in e.value.read().decode()


def test_unknown_path_is_404_and_healthz(server):
    with pytest.raises(urllib.error.HTTPError) as e:
        get(server, "/nope")
    assert e.value.code == 404
    assert get(server, "/healthz")[2] == "ok\n"


def test_line_chart_scales_every_series_into_the_frame():
    import re

    from coordinator.plots import RENDER_POINTS, line_chart

    svg = line_chart("bpb <run>", {"a": [(0.0, 1.0), (10.0, 3.0)], "b<": [(5.0, 2.0)]}, lambda v: f"{v:.1f}",
                     zero_based=False)
    assert "bpb &lt;run&gt;" in svg and "data-label='b&lt;'" in svg and "<circle" in svg
    xs, ys = [], []
    for pts in re.findall(r"(?<![-\w])points='([^']*)'", svg):
        for pair in pts.split():
            x, y = map(float, pair.split(","))
            xs.append(x)
            ys.append(y)
    width, height = map(int, re.search(r"viewBox='0 0 (\d+) (\d+)'", svg).groups())
    assert all(0 < x <= width for x in xs) and all(0 < y < height for y in ys)
    assert ys[0] > ys[1], "the larger value is drawn higher"
    assert "no data yet" in line_chart("empty", {"a": []}, str)
    long = line_chart("long", {"a": [(float(t), float(t)) for t in range(5000)]}, str)
    drawn = int(re.search(r"data-points='(\d+)'", long).group(1))
    assert drawn <= RENDER_POINTS + 1
    assert "<b>4999.0</b>" in long, "the latest value is in the legend"
