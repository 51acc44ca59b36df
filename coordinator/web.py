"""The coordinator's HTTP side: a status page for people (``/``), JSON (``/status.json``),
Prometheus metrics (``/metrics``) and a liveness probe (``/healthz``).

Stdlib only (``http.server`` in a daemon thread): the page is read-only and small, and the gRPC
event loop is never blocked by a scrape. Everything is rendered from one
:func:`coordinator.status.snapshot`, so the page, the JSON and the metrics agree.
"""

from __future__ import annotations

import html
import logging
import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Optional

from coordinator.metrics import CONTENT_TYPE, render_metrics
from models import strict_json

__all__ = ["StatusServer", "render_page", "to_json"]

log = logging.getLogger(__name__)

PAGE_PEERS = 500
"""Rows of the peers table on the HTML page (the JSON has them all)."""


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


def render_page(snap: dict[str, Any]) -> str:
    """The human status page."""
    e = html.escape
    rows = []
    for p in snap["peers"][:PAGE_PEERS]:
        rows.append(
            f"<tr><td><code>{e(p['peer_id'])}</code></td><td>{e(p['device'])}</td><td>{e(p['state'])}</td>"
            f"<td>{e(p['work'])}</td><td>{p['tokens_per_s']:.0f}</td><td>{_fmt_bytes(p['memory_bytes'])}</td>"
            f"<td>{p['tokens']}</td><td>{_fmt_bytes(p['bytes_exchanged'])}</td><td>{p['last_seen_age_s']:.1f}s</td>"
            f"<td title=\"{e(p['reachable_addr'] or p['observed_addr'])}\">{e(p['reachability'].replace('_', ' '))}"
            f"{' via <code>' + e(p['relay'][-8:]) + '</code>' if p['relay'] else ''}</td></tr>"
        )
    if snap["peers_truncated"]:
        rows.append("<tr><td colspan=10>... more peers in /status.json</td></tr>")
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
        f"<td>{_fmt_loss(p['loss'])}</td>"
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
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>hivepath coordinator: {e(snap['run_id'])}</title>
<meta http-equiv="refresh" content="5">
<style>body{{font-family:sans-serif;margin:1.5em}}table{{border-collapse:collapse;margin-bottom:1em}}
td,th{{border:1px solid #ccc;padding:3px 8px;text-align:left}}td.empty{{background:#fdd}}td.ok{{background:#dfd}}</style>
</head><body>
<h1>hivepath run <code>{e(snap['run_id'])}</code></h1>
<p>config {e(snap['run_config_hash'])} · lattice {e(snap['lattice_hash'])} · data {e(snap['manifest_hash'] or 'not pinned')}</p>
<p><b>{snap['total_tokens_per_s']:.0f} tokens/s</b> · {snap['live_leases']} live leases · peers: {states}
 · {snap['tokens']} tokens · {_fmt_bytes(snap['bytes_exchanged'])} exchanged</p>
<p>rebalancing: {e(snap['rebalance'])}</p>
<h2>Lattice</h2><table>{''.join(grid)}</table><ul>{shared}</ul>
<h2>Paths</h2>{data_line}<table><tr><th>path</th><th>peers</th><th>tokens/s</th><th>loss</th>{'<th>seeders</th>' if pinned else ''}</tr>{paths}</table>
<h2>Peers</h2><table><tr><th>peer</th><th>device</th><th>state</th><th>work</th><th>tokens/s</th><th>memory</th>
<th>tokens</th><th>exchanged</th><th>last seen</th><th>reachability</th></tr>{''.join(rows)}</table>
</body></html>"""


class StatusServer:
    """Serves the page, JSON and metrics from ``get_snapshot(max_peers)`` (None: every peer row) on
    ``host:port`` in a daemon thread."""

    def __init__(self, get_snapshot: Callable[[Optional[int]], dict[str, Any]], host: str = "0.0.0.0",
                 port: int = 0):
        self._get = get_snapshot
        get = get_snapshot

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                path = self.path.split("?", 1)[0]
                try:
                    if path == "/":
                        body, ctype = render_page(get(PAGE_PEERS)).encode(), "text/html; charset=utf-8"
                    elif path == "/status.json":
                        body, ctype = to_json(get(None)).encode(), "application/json"
                    elif path == "/metrics":  # aggregates only: no per-peer rows to build
                        body, ctype = render_metrics(lambda: get(0)), CONTENT_TYPE
                    elif path == "/healthz":
                        body, ctype = b"ok\n", "text/plain"
                    else:
                        self.send_error(404, "not found: try /, /status.json, /metrics or /healthz")
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
