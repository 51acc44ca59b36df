"""The coordinator's HTTP side: a status page for people (``/``), JSON (``/status.json`` and the
run's history, ``/history.json``), Prometheus metrics (``/metrics``) and a liveness probe (``/healthz``).

Stdlib only (``http.server`` in a daemon thread): the page is read-only and small, and the gRPC
event loop is never blocked by a scrape. Everything is rendered from one
:func:`coordinator.status.snapshot`, so the page, the JSON and the metrics agree; the plots are SVG
drawn here (:mod:`coordinator.plots`) from the stored history, so the page loads nothing from
elsewhere. A few lines of inline script reload the page's body every ``refresh`` seconds (without
script, a meta refresh does).
"""

from __future__ import annotations

import html
import logging
import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Optional
from urllib.parse import parse_qs

from coordinator.history import BPB_PREFIX
from coordinator.metrics import CONTENT_TYPE, render_metrics
from coordinator.plots import line_chart
from models import strict_json

__all__ = ["StatusServer", "render_page", "render_history", "to_json", "BadQuery"]

History = dict[str, list[tuple[float, float]]]

log = logging.getLogger(__name__)

PAGE_PEERS = 500
"""Rows of the peers and contributions tables on the HTML page (the JSON has them all)."""
PAGE_ROUNDS = 16
"""Modules whose round the totals line names (the lattice grid shows every module's)."""
PAGE_PIPELINES = 64
"""Rows of the pipelines table (the JSON has them all)."""
PAGE_SERVERS = 8
"""Stage servers named per level of a pipeline on the page (the JSON has them all)."""
REFRESH = 5.0
"""Seconds between reloads of the page (``/?refresh=S`` sets another, 1 to 3600)."""


class BadQuery(ValueError):
    """A query parameter the page does not accept (answered 400 with this message)."""


def _refresh(query: str) -> float:
    values = parse_qs(query).get("refresh")
    if not values:
        return REFRESH
    try:
        refresh = float(values[-1])
    except ValueError:
        raise BadQuery(f"refresh: expected seconds between reloads, got {values[-1][:32]!r}") from None
    if not 1 <= refresh <= 3600:
        raise BadQuery(f"refresh: {refresh:g} is out of range (1 .. 3600 seconds)")
    return refresh


def to_json(snap: dict[str, Any]) -> str:
    """Strict JSON (NaN becomes null)."""
    return strict_json.dumps(snap, sort_keys=True)


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} PB"


def _fmt_loss(loss: Any) -> str:
    return "-" if loss is None or not math.isfinite(loss) else f"{loss:.3f}"


def _fmt_count(n: float) -> str:
    for unit in ("", "k", "M", "G", "T"):
        if abs(n) < 1000:
            return f"{n:.0f}{unit}" if unit == "" or abs(n) >= 100 else f"{n:.1f}{unit}"
        n /= 1000
    return f"{n:.1f}P"


def _fmt_time(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t)) if t > 0 else "-"


def render_history(history: History) -> str:
    """The plots of the run's history: validation bits per byte per path, tokens per second, peers
    online, bytes exchanged and tokens, over the whole run."""
    bpb = {f"path {name[len(BPB_PREFIX):]}": pts for name, pts in history.items() if name.startswith(BPB_PREFIX)}
    return "".join([
        line_chart("validation bits per byte (archive's latest snapshot, per path)", bpb, lambda v: f"{v:.3f}",
                   zero_based=False, chart_id="plot-bpb"),
        line_chart("tokens per second", {"run": history.get("tokens_per_s", [])}, _fmt_count, chart_id="plot-tps"),
        line_chart("peers online", {"active": history.get("peers_online", [])}, lambda v: f"{v:.0f}",
                   chart_id="plot-peers"),
        line_chart("bytes exchanged (averaging, all peers)", {"run": history.get("bytes_exchanged", [])}, _fmt_bytes,
                   chart_id="plot-bytes"),
        line_chart("tokens processed", {"run": history.get("tokens", [])}, _fmt_count, chart_id="plot-tokens"),
    ])


def _contributions(snap: dict[str, Any]) -> str:
    e = html.escape
    rows = [
        f"<tr data-peer='{e(c['peer_id'])}'><td><code>{e(c['peer_id'])}</code></td><td>{e(c['state'])}</td>"
        f"<td>{e(c['work'])}</td><td class='tokens'>{c['tokens']}</td><td class='rounds'>{c['rounds']}</td>"
        f"<td>{100 * c['share']:.1f}%</td><td>{e(c['reachability'].replace('_', ' '))}</td>"
        f"<td>{_fmt_time(c['first_seen'])}</td><td>{_fmt_time(c['last_seen'])}</td></tr>"
        for c in snap["contributions"][:PAGE_PEERS]
    ]
    if snap["totals"]["peers_ever"] > len(rows):
        rows.append(f"<tr><td colspan=9>... {snap['totals']['peers_ever'] - len(rows)} more peers in /status.json</td></tr>")
    return ("<table id='contributions'><tr><th>peer</th><th>state</th><th>work</th><th>tokens</th><th>rounds</th>"
            "<th>share of tokens</th><th>reachability</th><th>first seen (UTC)</th><th>last seen (UTC)</th></tr>"
            + "".join(rows) + "</table>")


def _fmt_busy(busy: Optional[float]) -> str:
    return "busy not measured yet" if busy is None else f"{100 * busy:.0f}% busy"


def _pipelines(snap: dict[str, Any]) -> str:
    """The pipelines table: per pipeline its path, state, trainers and each level's servers with the
    tokens/s they served (of what they can serve) and the level's busy share."""
    e = html.escape
    pipes = snap["pipelines"]
    if not pipes:
        return "<p id='pipelines'>none: no path has a trainer or a stage server on every level</p>"
    levels = max(len(p["levels"]) for p in pipes)
    rows = []
    for p in pipes[:PAGE_PIPELINES]:
        trainers = "<br>".join(f"<code>{e(t['peer_id'])}</code> {t['tokens_per_s']:.0f} tokens/s"
                               for t in p["trainers"]) or "none"
        cells = []
        for lv in p["levels"]:
            servers = [f"<code>{e(sv['peer_id'])}</code> {sv['tokens_per_s']:.0f}"
                       + (f" of {sv['capacity_tokens_per_s']:.0f}" if sv["capacity_tokens_per_s"] > 0 else "")
                       + " tokens/s" for sv in lv["servers"][:PAGE_SERVERS]]
            if len(lv["servers"]) > PAGE_SERVERS:
                servers.append(f"... {len(lv['servers']) - PAGE_SERVERS} more in /status.json")
            body = "<br>".join(servers) if servers else "no server"
            busy = f" · {_fmt_busy(lv['busy'])}" if lv["servers"] else ""
            cls = "ok" if lv["servers"] else "empty"
            cells.append(f"<td class='{cls}'><b>{e(lv['module'])}</b>{busy}<br>{body}</td>")
        state = p["state"]
        rows.append(f"<tr data-path='{e(p['name'])}'><td>{e(p['name'])}</td>"
                    f"<td class='{'ok' if state == 'running' else 'empty'}'>{e(state)}</td>"
                    f"<td>{p['tokens_per_s']:.0f}</td><td>{trainers}</td>{''.join(cells)}</tr>")
    if len(pipes) > PAGE_PIPELINES:
        rows.append(f"<tr><td colspan={4 + levels}>... {len(pipes) - PAGE_PIPELINES} more pipelines in "
                    "/status.json</td></tr>")
    head = "".join(f"<th>level {i} servers</th>" for i in range(levels))
    return (f"<table id='pipelines'><tr><th>path</th><th>state</th><th>tokens/s</th><th>trainers</th>{head}</tr>"
            + "".join(rows) + "</table>")


def _peer_tps(p: dict[str, Any]) -> str:
    cap = p.get("capacity_tokens_per_s")
    return f"{p['tokens_per_s']:.0f}" + (f" of {cap:.0f}" if cap else "")


def _health(snap: dict[str, Any]) -> str:
    """The long-run health signals (:mod:`coordinator.health`): one line per rising path or diverging peer."""
    e = html.escape
    h = snap["health"]
    lines = [f"<li class='bpb-rise'>path <b>{e(r['path'])}</b>: validation bpb rose {100 * r['rise']:.1f}% over "
             f"{r['scorings_rising']} archive scorings ({r['best_bpb']:.4f} to {r['latest_bpb']:.4f}), since round "
             f"{r['since_round']}; suspect module <b>{e(r['module'])}</b></li>" for r in h["paths"]]
    lines += [f"<li class='loss-divergence'>peer <code>{e(d['peer_id'])}</code>: loss on <b>{e(d['module'])}</b> "
              f"{100 * d['rise']:.1f}% above its best ({d['best_loss']:.3f} to {d['latest_loss']:.3f}) for "
              f"{d['reports_above']} rounds, since round {d['since_round']}</li>" for d in h["peers"]]
    if not lines:
        return "<p id='health'>no path's validation bpb rising, no peer's loss diverging</p>"
    return f"<ul id='health'>{''.join(lines)}</ul>"


def render_page(snap: dict[str, Any], history: Optional[History] = None, refresh: float = REFRESH) -> str:
    """The human status page (``history``: the series of :mod:`coordinator.history` to plot)."""
    e = html.escape
    rows = []
    for p in snap["peers"][:PAGE_PEERS]:
        rows.append(
            f"<tr data-peer='{e(p['peer_id'])}'><td><code>{e(p['peer_id'])}</code></td><td>{e(p['device'])}</td>"
            f"<td>{e(p['state'])}</td><td class='role'>{e(p['role'])}</td><td>{e(p['work'])}</td>"
            f"<td class='tps'>{_peer_tps(p)}</td><td>{_fmt_bytes(p['memory_bytes'])}</td>"
            f"<td>{p['tokens']}</td><td>{_fmt_bytes(p['bytes_exchanged'])}</td><td>{p['last_seen_age_s']:.1f}s</td>"
            f"<td title=\"{e(p['reachable_addr'] or p['observed_addr'])}\">{e(p['reachability'].replace('_', ' '))}"
            f"{' via <code>' + e(p['relay'][-8:]) + '</code>' if p['relay'] else ''}</td>"
            f"<td class='why'>{e(p['role_reason'])}</td><td class='version'>{e(p['version'] or '?')}</td></tr>"
        )
    if snap["peers_truncated"]:
        rows.append("<tr><td colspan=13>... more peers in /status.json</td></tr>")
    grid = []
    for level, cells in enumerate(snap["lattice"]["grid"]):
        tds = "".join(
            f"<td class='{'ok' if c['holders'] else 'empty'}'><b>{e(c['module_id'])}</b><br>{c['holders']} holders"
            f"<br>round {c['round']}</td>" for c in cells
        )
        grid.append(f"<tr><th>level {level}</th>{tds}</tr>")
    shared = "".join(
        f"<li><b>{e(m['module_id'])}</b>: {len(m['holders'])} holders, round {m['round']}</li>"
        for m in snap["modules"] if not m["module_id"].startswith("L")
    )
    pinned = bool(snap["manifest_hash"])
    paths = "".join(
        f"<tr><td>{e(p['name'])}</td><td>{len(p['peers'])}</td><td>{p['tokens_per_s']:.0f}</td>"
        f"<td>{_fmt_loss(p['loss'])}</td><td>{_fmt_loss(p['val_bpb'])}</td>"
        + (f"<td class='{'ok' if p['seeders'] else 'empty'}'>{p['seeders']}</td>" if pinned else "") + "</tr>"
        for p in snap["paths"]
    )
    at_risk = snap["data"]["paths_without_seeder"]
    data_line = ("" if not pinned else
                 f"<p>data {e(snap['manifest_hash'])}: {snap['data']['seeding_peers']} seeding peers"
                 + (f" · <b>no seeder for the shards of {len(at_risk)} path(s)</b>: {e(', '.join(at_risk[:16]))}"
                    if at_risk else " · every path's shards have a seeder") + "</p>")
    states = ", ".join(f"{e(k)} {v}" for k, v in sorted(snap["peer_states"].items())) or "none"
    unreachable = snap["peer_reachability"].get("unreachable", 0)
    if unreachable:
        states += f" · <b>{unreachable} unreachable</b> (behind NAT or a firewall)"
    relayed = snap["peer_reachability"].get("relayed", 0)
    if relayed:
        states += f" · {relayed} relayed (behind NAT, dialled through a relay peer)"
    totals = snap["totals"]
    shown = list(totals["module_rounds"].items())
    rounds = " · ".join(f"{e(m)} {r}" for m, r in shown[:PAGE_ROUNDS])
    if len(shown) > PAGE_ROUNDS:
        rounds += f" · ... {len(shown) - PAGE_ROUNDS} more in the lattice below and /status.json"
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>hivepath coordinator: {e(snap['run_id'])}</title>
<noscript><meta http-equiv="refresh" content="{refresh:g}"></noscript>
<script>
// Reload the body in place every {refresh:g} s (no flash, scroll kept); the coordinator draws everything.
setInterval(async () => {{
  try {{
    const r = await fetch(location.href, {{cache: "no-store"}});
    if (!r.ok) return;
    const fresh = new DOMParser().parseFromString(await r.text(), "text/html").body;
    document.body.replaceWith(fresh);
  }} catch (err) {{ /* the coordinator is away: keep what is shown */ }}
}}, {1000 * refresh:.0f});
</script>
<style>body{{font-family:sans-serif;margin:1.5em}}table{{border-collapse:collapse;margin-bottom:1em}}
td,th{{border:1px solid #ccc;padding:3px 8px;text-align:left}}td.empty{{background:#fdd}}td.ok{{background:#dfd}}
.plots{{display:flex;flex-wrap:wrap;gap:1em}}figure.plot{{margin:0;width:560px;max-width:100%}}
figure.plot svg{{width:100%;height:auto;font-size:11px}}figcaption{{font-weight:bold}}.legend{{font-size:12px}}</style>
</head><body>
<h1>hivepath run <code>{e(snap['run_id'])}</code></h1>
<p>config {e(snap['run_config_hash'])} · lattice {e(snap['lattice_hash'])} · data {e(snap['manifest_hash'] or 'not pinned')}</p>
<p><b>{snap['total_tokens_per_s']:.0f} tokens/s</b> · {snap['live_leases']} live leases · peers: {states}
 · {snap['tokens']} tokens · {_fmt_bytes(snap['bytes_exchanged'])} exchanged</p>
<p>rebalancing: {e(snap['rebalance'])}</p>
<p id="versions">coordinator hivepath {e(snap['versions']['release'])}{' (' + e(snap['versions']['commit']) + ')' if snap['versions']['commit'] else ''}
 · protocols {e(snap['versions']['protocols'])} · peers must run {e(snap['versions']['min_peer_version'] or 'any release')}{' or newer' if snap['versions']['min_peer_version'] else ''}</p>
<p id="totals">since the run began: <b>{totals['tokens']}</b> tokens · {totals['peers_ever']} peers · module rounds: {rounds}</p>
<h2>Health</h2>{_health(snap)}
<h2>History</h2><div class="plots">{render_history(history or {})}</div>
<h2>Contributions</h2>{_contributions(snap)}
<h2>Lattice</h2><table>{''.join(grid)}</table><ul>{shared}</ul>
<h2>Paths</h2>{data_line}<table><tr><th>path</th><th>peers</th><th>tokens/s</th><th>loss</th><th>validation bpb</th>{'<th>seeders</th>' if pinned else ''}</tr>{paths}</table>
<h2>Exchange plans</h2>{_plans(snap)}<p>slow links: {e(snap['slow_links'])}</p>
<h2>Pipelines</h2>{_pipelines(snap)}
<h2>Peers</h2><table id='peers'><tr><th>peer</th><th>device</th><th>state</th><th>role</th><th>work</th><th>tokens/s</th>
<th>memory</th><th>tokens</th><th>exchanged</th><th>last seen</th><th>reachability</th><th>why this role</th><th>version</th></tr>{''.join(rows)}</table>
</body></html>"""


PAGE_PLANS = 64
"""Modules with a plan of their own listed on the page (every one is in /status.json)."""


def _plans(snap: dict[str, Any]) -> str:
    """Each planned module's H and codec now and from which round, the next plan, and the planner's
    latest word on it; a line for the modules on the run's H and codec."""
    e = html.escape
    planned = [m for m in snap["modules"] if m["plan"]["from_round"] or m["plan"]["next"]]
    rows = []
    for m in planned[:PAGE_PLANS]:
        p, nxt = m["plan"], m["plan"]["next"]
        then = (f"H={nxt['inner_steps']}, {e(nxt['codec'])}{', overlapped' if nxt['overlap'] else ''} "
                f"from round {nxt['from_round']}") if nxt else ""
        why = e(m["plan_reason"] or p["reason"])
        rows.append(f"<tr><td>{e(m['module_id'])}</td><td>{p['inner_steps']}</td><td>{e(p['codec'])}</td>"
                    f"<td>{'yes' if p['overlap'] else 'no'}</td><td>{p['from_round']}</td><td>{then}</td><td class='why'>{why}</td></tr>")
    rest = len(snap["modules"]) - len(planned)
    line = f"<p>{rest} module(s) on the run's H and codec" + (
        f" (planner: {e(snap['modules'][0]['plan_reason'])})" if rest and snap["modules"] and not planned
        and snap["modules"][0]["plan_reason"] else "") + "</p>"
    if not rows:
        return line
    more = f"<p>... {len(planned) - PAGE_PLANS} more in /status.json</p>" if len(planned) > PAGE_PLANS else ""
    return (f"<table id='plans'><tr><th>module</th><th>H</th><th>codec</th><th>overlapped</th><th>since round</th><th>next</th>"
            f"<th>why</th></tr>{''.join(rows)}</table>{more}{line}")


class StatusServer:
    """Serves the page, JSON and metrics from ``get_snapshot(max_peers)`` (None: every peer row) and
    ``get_history()`` (series name -> points) on ``host:port`` in a daemon thread."""

    def __init__(self, get_snapshot: Callable[[Optional[int]], dict[str, Any]], host: str = "0.0.0.0",
                 port: int = 0, get_history: Callable[[], History] = dict):
        self._get = get_snapshot
        get = get_snapshot

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                path, _, query = self.path.partition("?")
                try:
                    if path == "/":
                        page = render_page(get(PAGE_PEERS), get_history(), _refresh(query))
                        body, ctype = page.encode(), "text/html; charset=utf-8"
                    elif path == "/status.json":
                        body, ctype = to_json(get(None)).encode(), "application/json"
                    elif path == "/history.json":
                        series = {name: [list(p) for p in pts] for name, pts in get_history().items()}
                        body, ctype = to_json({"series": series}).encode(), "application/json"
                    elif path == "/metrics":  # aggregates only: no per-peer rows to build
                        body, ctype = render_metrics(lambda: get(0)), CONTENT_TYPE
                    elif path == "/healthz":
                        body, ctype = b"ok\n", "text/plain"
                    else:
                        self.send_error(404, "not found: try /, /status.json, /history.json, /metrics or /healthz")
                        return
                except BadQuery as err:
                    self.send_error(400, str(err))
                    return
                except Exception:
                    log.exception("status page failed")
                    self.send_error(500)
                    return
                self.send_response(200)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, fmt: str, *args: Any) -> None:
                log.debug("http: " + fmt, *args)

        self._httpd = ThreadingHTTPServer((host, port), Handler)
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="status-http", daemon=True)

    def start(self) -> "StatusServer":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
