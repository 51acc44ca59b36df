"""What ``hivepath demo`` shows and writes: the live table, the before/after evaluation, the report."""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any, Optional

from rich.console import Console
from rich.live import Live
from rich.table import Table

from models import strict_json
from models.config import RunConfig, format_path
from models.log_format import event_extra
from peer.demo.roles import PeerLines

__all__ = ["DemoMonitor", "evaluate_init", "evaluate_run_dir", "write_report", "ddp_bytes_equivalent", "role_lines",
           "role_table"]

log = logging.getLogger(__name__)


def ddp_bytes_equivalent(cfg: RunConfig, steps_by_path: dict[tuple[int, ...], int], holders: dict[str, int]) -> float:
    """Bytes synchronous data-parallel training would send for the same inner steps.

    Every step, each module's holders ring-all-reduce its fp32 gradient: each of the k holders
    sends 2(k-1)/k of the module's bytes. Summed over the modules of every peer's path.
    """
    total = 0.0
    lat = cfg.lattice
    for path, steps in steps_by_path.items():
        for mid in lat.path_modules(path):
            k = max(1, holders.get(mid, 1))
            total += steps * 2 * (k - 1) / k * 4 * lat.module_param_count(mid)
    return total


def evaluate_init(cfg: RunConfig, dataset: Any, max_docs: int) -> float:
    """Routed validation bits per byte of the untrained lattice (every peer's starting point)."""
    from models.evaluate import routed_evaluation
    from models.lattice import ModularLM

    model = ModularLM(cfg.lattice, seed=cfg.seed)
    return routed_evaluation(model.path_model, dataset, cfg.lattice.paths(), cfg.lattice.seq_len, "cpu",
                             max_documents_per_path=max_docs).bpb


def evaluate_run_dir(run_dir: Path, dataset: Any, max_docs: int) -> tuple[float, dict]:
    """Routed bits per byte of the newest snapshot under ``run_dir`` (an archive or a peer checkpoint)."""
    from models.evaluate import routed_evaluation
    from models.run_dir import load_run_dir

    loaded = load_run_dir(run_dir)
    paths = [p for p in loaded.cfg.lattice.paths() if all(m in loaded.model.mods for m in loaded.cfg.lattice.path_modules(p))]
    if not paths:
        return float("nan"), {}
    result = routed_evaluation(loaded.model.path_model, dataset, paths, loaded.cfg.lattice.seq_len, "cpu",
                               max_documents_per_path=max_docs)
    return result.bpb, result.per_path


class DemoMonitor:
    """Polls the coordinator's status, keeps the history for the report and shows the run: a live
    table (``live``, on a terminal), or else plain lines through the log, a progress line every
    ``interval`` seconds (:meth:`progress_fields`) and one line per event a peer prints, each a JSON
    object under ``--log-format json`` (``event`` ``demo_progress``, or the peer's event and ``peer``)."""

    def __init__(self, cfg: RunConfig, live: bool = True, lines: Optional[PeerLines] = None,
                 interval: float = 5.0):
        self.cfg = cfg
        self.lines = lines if lines is not None else PeerLines()
        """Each peer's own progress lines: its name, role, work and tokens (trained or served)."""
        if not live:
            self.lines.on_event = self.show_event
        self.interval = interval
        self._shown_at = float("-inf")
        self.bpb_before: Optional[float] = None
        """Routed validation bits per byte of the untrained lattice, once the demo has scored it."""
        self.start = time.monotonic()
        self.history: list[dict[str, Any]] = []
        self.last: dict[str, Any] = {}
        self.console = Console(stderr=True)
        self._live: Optional[Live] = Live(console=self.console, auto_refresh=False) if live else None
        self.peer_paths: dict[str, tuple[int, ...]] = {}
        """Last path each peer trained, itself or as a pipeline's trainer (peers that left have no
        assignment in the final status)."""
        self.peer_modules: dict[str, tuple[str, ...]] = {}
        """Modules each peer last held: a path's, a trainer's embedding and head, a stage's block."""
        self.stage_peers: set[str] = set()
        """Peers last seen serving a stage: the tokens they report were trained by a trainer too."""
        self.peer_tokens: dict[str, int] = {}
        self.module_rounds: dict[str, int] = {}
        """Highest round seen per module (a module's round reads 0 once its holders have left)."""

    def __enter__(self) -> "DemoMonitor":
        if self._live is not None:
            self._live.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._live is not None:
            self._live.stop()

    def poll(self, client: Any, procs: dict, http_port: int) -> None:
        self.lines.read()
        try:
            status = client.status()
        except Exception as e:  # the coordinator may be restarting; the demo keeps going
            log.debug("status failed: %r", e)
            return
        elapsed = time.monotonic() - self.start
        self.last = status
        for m in status.get("modules", []):
            self.module_rounds[m["module_id"]] = max(self.module_rounds.get(m["module_id"], 0), int(m["round"]))
        for p in status.get("peers", []):
            self._held(p)
            self.peer_tokens[p["peer_id"]] = max(self.peer_tokens.get(p["peer_id"], 0), p.get("tokens", 0))
        self.history.append({
            "t": round(elapsed, 1),
            "paths": {format_path(tuple(p["path"])): p["loss"] for p in status.get("paths", []) if p.get("loss")},
            "tokens": sum(p.get("tokens", 0) for p in status.get("peers", []) if p.get("mode") != "stage"),
            "bytes": status.get("bytes_exchanged", 0),
        })
        if self._live is not None:
            self._live.update(self._table(status, elapsed, http_port), refresh=True)
        elif time.monotonic() - self._shown_at >= self.interval:
            self._shown_at = time.monotonic()
            self.show_progress(self.progress_fields(status, elapsed, _validation_bpb(http_port)))

    def progress_fields(self, status: dict, elapsed: float, bpb_now: Optional[float]) -> dict[str, Any]:
        """What a progress line says: seconds since the start, live peers, tokens trained, each module's
        round, bytes exchanged, and routed validation bits per byte before training and of the archive's
        newest scored snapshot (None until known)."""
        peers = [p for p in status.get("peers", []) if p.get("mode") != "archive"]
        tokens = sum(n for peer_id, n in self.peer_tokens.items() if peer_id not in self.stage_peers)
        return {"elapsed_s": round(elapsed, 1), "peers": len(peers), "tokens": tokens,
                "rounds": dict(sorted(self.module_rounds.items())), "bytes_exchanged": status.get("bytes_exchanged", 0),
                "bpb_before": self.bpb_before, "bpb_now": bpb_now}

    @staticmethod
    def show_progress(fields: dict[str, Any]) -> None:
        rounds = " ".join(f"{m}:r{r}" for m, r in fields["rounds"].items()) or "-"
        bpb = [f"{fields[k]:.3f} {label}" for k, label in (("bpb_before", "before"), ("bpb_now", "now"))
               if fields[k] is not None]
        log.info("demo %.0fs: %d peers, %s tokens, %.1f MB exchanged, rounds %s%s", fields["elapsed_s"],
                 fields["peers"], f"{fields['tokens']:,}", fields["bytes_exchanged"] / 1e6, rounds,
                 f", bits per byte {', '.join(bpb)}" if bpb else "", extra=event_extra("demo_progress", **fields))

    @staticmethod
    def show_event(name: str, record: dict) -> None:
        """One line for event ``record`` that demo peer ``name`` printed."""
        kind = str(record.get("event"))
        fields = {k: v for k, v in record.items() if k not in ("event", "time")}
        shown = " ".join(f"{k}={_short(v)}" for k, v in fields.items() if v not in (None, "", [], {}))
        log.info("%s %s: %s", name, kind, shown, extra=event_extra(kind, peer=name, peer_time=record.get("time"),
                                                                      **fields))

    def _held(self, p: dict) -> None:
        """Note what peer row ``p`` of the status trains or serves."""
        lattice, mode, peer_id = self.cfg.lattice, p.get("mode"), p["peer_id"]
        if mode in ("path", "trainer") and p.get("path"):
            path = tuple(p["path"])
            self.peer_paths[peer_id] = path
            self.peer_modules[peer_id] = (tuple(lattice.path_modules(path)) if mode == "path"
                                          else (lattice.embed_id(path), lattice.head_id(path)))
            self.stage_peers.discard(peer_id)
        elif mode == "stage":
            self.peer_paths.pop(peer_id, None)
            self.peer_modules[peer_id] = (p.get("work", "").split(" ", 1)[-1],)  # "stage L0M1"
            self.stage_peers.add(peer_id)

    def _table(self, status: dict, elapsed: float, http_port: int) -> Table:
        t = Table(title=f"hivepath demo: {elapsed:5.0f}s, {status.get('total_tokens_per_s', 0):,.0f} tokens/s, "
                        f"{status.get('bytes_exchanged', 0) / 1e6:.1f} MB exchanged  (status page http://127.0.0.1:{http_port})")
        for col in ("name", "peer", "role", "state", "work", "tokens/s", "tokens", "last seen"):
            t.add_column(col)
        names = self.lines.names()
        rows = [(names.get(p["peer_id"], "archive" if p.get("mode") == "archive" else "-"), p)
                for p in status.get("peers", [])]
        for name, p in sorted(rows, key=lambda r: (r[0] == "-", r[0], r[1]["peer_id"])):
            role = p.get("mode") or "-"
            own = self.lines.peers.get(name)
            state = own.state if own is not None and own.state else p.get("state", "")  # waiting, training, ...
            work = (p.get("work") or "-").removeprefix(f"{role} ") or "-"  # "stage L0M1": the role has its column
            tokens = f"{p.get('tokens', 0):,}" + (" served" if role == "stage" else "")
            t.add_row(name, p["peer_id"][:12], role, state, work, f"{p.get('tokens_per_s', 0):,.0f}", tokens,
                      f"{p.get('last_seen_age_s', 0):.0f}s")
        rounds = ", ".join(f"{m['module_id']}:r{m['round']}" for m in status.get("modules", []))
        t.caption = f"module rounds: {rounds or '-'}"
        return t

    def summary(self, cfg: RunConfig, opts: Any, bpb_before: float, bpb_after: Optional[float], per_path: dict,
                codes: dict) -> dict[str, Any]:
        status = self.last
        # a stage server's tokens went through a trainer, which counts them
        tokens = sum(n for peer_id, n in self.peer_tokens.items() if peer_id not in self.stage_peers)
        holders: dict[str, int] = {}
        for modules in self.peer_modules.values():
            for mid in modules:
                holders[mid] = holders.get(mid, 0) + 1
        roles = {name: p.to_dict() for name, p in sorted(self.lines.peers.items())}
        by_role: dict[str, int] = {}
        for p in self.lines.peers.values():
            for role, n in p.tokens_by_role().items():
                by_role[role] = by_role.get(role, 0) + n
        step_tokens = cfg.inner.batch_size * cfg.lattice.seq_len
        steps_by_path: dict[tuple[int, ...], int] = {}
        for peer_id, path in self.peer_paths.items():
            steps_by_path[path] = steps_by_path.get(path, 0) + self.peer_tokens.get(peer_id, 0) // step_tokens
        return {
            "bpb_before": bpb_before,
            "bpb_after": bpb_after,
            "bpb_per_path": per_path,
            "bytes_exchanged": status.get("bytes_exchanged", 0),
            "ddp_bytes_equivalent": ddp_bytes_equivalent(cfg, steps_by_path, holders),
            "tokens": tokens,
            "peers": opts.peers,
            "small_peers": getattr(opts, "small_peers", 0),
            "peer_roles": roles,
            "tokens_by_role": dict(sorted(by_role.items())),
            "minutes": opts.minutes,
            "module_rounds": dict(sorted(self.module_rounds.items())),
            "exit_codes": codes,
            "config_hash": cfg.content_hash(),
        }


ROLE_TOKENS = {"path": "trained", "trainer": "trained", "stage": "served"}
"""What a role's tokens are: a path peer and a pipeline trainer train them, a stage server serves them."""


def _tokens(peer: dict[str, Any]) -> str:
    """``1,234 trained as path``, or one such part per role a moved peer had."""
    return ", ".join(f"{n:,} {ROLE_TOKENS.get(role, 'tokens')} as {role}" for role, n in peer["tokens_by_role"].items())


def role_lines(summary: dict[str, Any]) -> list[str]:
    """One line per peer of ``summary``: name, role, work, tokens (``peer0  path  0,1  1,234 trained as path``)."""
    return [f"{name:8} {p['role'] or '-':8} {p['work'] or '-':6} {_tokens(p) or '0 tokens'}"
            + (f", {p['failovers']} failovers" if p["failovers"] else "")
            for name, p in summary.get("peer_roles", {}).items()]


def role_table(summary: dict[str, Any]) -> list[str]:
    """The report's table of peers: name, role, work, tokens trained or served, failovers."""
    rows = [f"| {name} | {p['role'] or '-'} | {p['work'] or '-'} | {_tokens(p) or '0'} | {p['failovers']} |"
            for name, p in summary.get("peer_roles", {}).items()]
    return ["| peer | role | work | tokens | failovers |", "| --- | --- | --- | --- | --- |", *rows] if rows else []


def _short(value: Any) -> str:
    """An event's field in a text line: a list of peer ids as their first 12 characters, comma-joined."""
    if isinstance(value, list):
        return ",".join(str(v)[:12] if str(v).startswith(("Qm", "12D3")) else str(v) for v in value)
    return str(value)


def _validation_bpb(http_port: int) -> Optional[float]:
    """Mean routed validation bits per byte over the paths the archive has scored, from the
    coordinator's ``/status.json`` (None before the first score or when it does not answer)."""
    import json
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/status.json", timeout=2.0) as r:
            paths = json.loads(r.read()).get("paths", [])
    except (OSError, ValueError) as e:
        log.debug("status.json: %r", e)
        return None
    scores = [p["val_bpb"] for p in paths if isinstance(p.get("val_bpb"), (int, float))]
    return sum(scores) / len(scores) if scores else None


def write_report(out: Path, summary: dict[str, Any], monitor: DemoMonitor) -> None:
    """``summary.json``, ``loss.png`` and ``report.md`` under ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    (out / "summary.json").write_text(strict_json.dumps(summary, indent=2, sort_keys=True) + "\n")
    fig, ax = plt.subplots(figsize=(7, 4))
    paths = sorted({p for h in monitor.history for p in h["paths"]})
    for p in paths:
        pts = [(h["t"], h["paths"][p]) for h in monitor.history if p in h["paths"]]
        ax.plot([t for t, _ in pts], [v / math.log(2) for _, v in pts], label=f"path {p}")
    ax.set_xlabel("seconds")
    ax.set_ylabel("training loss (bits per token)")
    ax.set_title("hivepath demo: training loss per path")
    if paths:
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=100)
    plt.close(fig)
    ratio = summary["ddp_bytes_equivalent"] / summary["bytes_exchanged"] if summary["bytes_exchanged"] else float("inf")
    small = summary.get("small_peers", 0)
    lines = [
        "# hivepath demo report", "",
        f"{summary['peers']} peers{f' and {small} small peers' if small else ''}, {summary['minutes']} minutes, "
        f"{summary['tokens']:,} tokens trained."
        + (f" Stopped early: {summary['stopped_by']}." if summary.get("stopped_by") else ""), "",
        "| metric | value |", "| --- | --- |",
        f"| routed validation bits per byte, before | {summary['bpb_before']:.3f} |",
        "| routed validation bits per byte, after | " + (f"{summary['bpb_after']:.3f} |" if summary["bpb_after"] is not None
                                                          else "none: stopped before any module finished a round |"),
        f"| bytes exchanged | {summary['bytes_exchanged']:,} |",
        f"| synchronous data-parallel equivalent | {summary['ddp_bytes_equivalent']:,.0f} |",
        f"| reduction | {ratio:,.0f}x |", "",
        "![training loss](loss.png)", "",
        "Per path (validation): " + ", ".join(f"{k}: {v['bpb']:.3f}" for k, v in summary["bpb_per_path"].items() if "bpb" in v),
        "", *role_table(summary),
    ]
    (out / "report.md").write_text("\n".join(lines) + "\n")
