"""The status page in a real browser: Debian's ``chromium`` driven by Playwright (PyPI), against a real
``hivepath coordinator serve`` process fed by real peers' gRPC clients.

Needs the ``chromium`` executable (``apt-get install chromium``; another one through
``HIVEPATH_CHROMIUM``) and ``pip install playwright`` (in the dev extras; never ``playwright install``:
the system browser is used). Without them the test is skipped saying what to install;
``HIVEPATH_REQUIRE_BROWSER=1`` (set by ``.ci/run``) turns that skip into a failure.
"""

from __future__ import annotations

import json
import os
import shutil
import urllib.request

import pytest

from helpers.network import HISTORY_RUN_TOML
from peer.localnet import free_port, hivepath_cmd, wait_for
from peer.coordinator_client import CoordinatorClient, Evaluation, PeerInfo, Progress

pytestmark = pytest.mark.integration

TOKEN = "browser-test-token"
RUN_TOML = HISTORY_RUN_TOML
PLOTS = ("plot-bpb", "plot-tps", "plot-peers", "plot-bytes", "plot-tokens")


def _browser() -> tuple[object, str]:
    """Playwright's sync API and the chromium executable, or a skip naming what is missing."""
    missing = []
    executable = os.environ.get("HIVEPATH_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if not executable:
        missing.append("the chromium browser (apt-get install -y chromium, or HIVEPATH_CHROMIUM=/path/to/chrome)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        sync_playwright = None
        missing.append("Playwright (pip install playwright; the dev extras have it)")
    if missing:
        why = "status page browser test needs " + " and ".join(missing)
        if os.environ.get("HIVEPATH_REQUIRE_BROWSER") == "1":
            pytest.fail(why + " (HIVEPATH_REQUIRE_BROWSER=1)")
        pytest.skip(why)
    return sync_playwright, executable


def _get_json(http_port: int, path: str) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}{path}", timeout=10) as r:
        return json.loads(r.read())


def _peer(port: int, name: str, **kw) -> CoordinatorClient:
    info = PeerInfo(f"12D3KooWbrowser{name}xxxx", "cpu", 8 << 30, 1000.0, public_key=name.encode(), **kw)
    return CoordinatorClient(f"127.0.0.1:{port}", TOKEN, info, backoff_base=0.05, backoff_max=0.5,
                             heartbeat_stream=False)


def _report(client: CoordinatorClient, rnd: int, tokens: int) -> None:
    mods = client.joined.assignment.module_ids
    client.heartbeat(progress=[Progress(m, rnd, tokens, 2.5) for m in mods], bytes_sent=1000 * rnd,
                     bytes_received=1000 * rnd)


def _row_tokens(page, peer_id: str) -> str:
    return page.evaluate(
        "id => { const c = document.querySelector(`#contributions tr[data-peer='${id}'] td.tokens`);"
        " return c ? c.textContent : null; }", peer_id)


def test_plots_render_with_data_and_the_contributions_table_updates(procs, tmp_path):
    sync_playwright, chromium = _browser()
    (tmp_path / "run.toml").write_text(RUN_TOML)
    port, http_port = free_port(), free_port()
    procs.start("coord", hivepath_cmd("coordinator", "serve", "--run-config", str(tmp_path / "run.toml"),
                                      "--db", str(tmp_path / "state.db"), "--host", "127.0.0.1", "--port", str(port),
                                      "--http-port", str(http_port)), env={"HIVEPATH_TOKEN": TOKEN})
    wait_for(lambda: _get_json(http_port, "/status.json"), 60, "the coordinator's status page", interval=0.2)
    a, b = _peer(port, "aaaa"), _peer(port, "bbbb")
    archive = _peer(port, "arch", archive=True)
    late = _peer(port, "cccc")
    try:
        ja, jb = a.join(), b.join()
        archive.join()
        for rnd in (1, 2, 3):
            _report(a, rnd, 1000 * rnd)
            _report(b, rnd, 500 * rnd)
            archive.heartbeat(evaluations=[Evaluation(ja.assignment.path, 5.0 - 0.5 * rnd, rnd),
                                           Evaluation(jb.assignment.path, 5.2 - 0.4 * rnd, rnd)])
            series = wait_for(lambda: (s := _get_json(http_port, "/history.json")["series"])
                              and s.get("tokens", [[0, 0]])[-1][1] == 1500 * rnd and s, 30,
                              f"a history sample after round {rnd}")
        assert len(series["tokens_per_s"]) >= 2

        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=chromium, headless=True, args=["--no-sandbox"])
            try:
                page = browser.new_page(viewport={"width": 1280, "height": 1400})
                page.goto(f"http://127.0.0.1:{http_port}/?refresh=1")
                for plot in PLOTS:
                    # waited for, not read once: the page replaces its body every second, and a line read
                    # while the new body is not laid out yet has no geometry ("non-rendered element")
                    lines = page.wait_for_function(
                        "sel => { try { const out = [...document.querySelectorAll(sel)].map(e => ({points: "
                        "+e.dataset.points, length: e.getTotalLength(), width: e.getBoundingClientRect().width}));"
                        " return out.length && out.every(l => l.length > 0 && l.width > 0) ? out : null; }"
                        " catch (err) { return null; } }", arg=f"#{plot} polyline.line", timeout=30_000).json_value()
                    assert lines, f"{plot} draws no line"
                    for line in lines:
                        assert line["points"] >= 2 and line["length"] > 0 and line["width"] > 0, (plot, line)
                assert len(page.query_selector_all("#plot-bpb polyline.line")) == 2, "one line per evaluated path"

                assert _row_tokens(page, a.peer.peer_id) == "3000"
                assert _row_tokens(page, late.peer.peer_id) is None
                _report(a, 4, 7000)
                late.join()
                _report(late, 1, 250)
                a.leave("done")
                page.wait_for_function(
                    "([a, late]) => { const row = id => document.querySelector(`#contributions tr[data-peer='${id}']`);"
                    " return row(a) && row(a).querySelector('td.tokens').textContent === '7000'"
                    " && row(a).cells[1].textContent === 'left' && row(late) !== null; }",
                    arg=[a.peer.peer_id, late.peer.peer_id], timeout=30_000)
                assert page.eval_on_selector(f"#contributions tr[data-peer='{a.peer.peer_id}'] td.rounds",
                                             "c => c.textContent") == "3"
                shot = os.environ.get("HIVEPATH_STATUS_SCREENSHOT")
                if shot:  # docs/img/status-page.png is taken this way
                    page.screenshot(path=shot, full_page=True)
            finally:
                browser.close()
    finally:
        for c in (a, b, archive, late):
            c.close()
