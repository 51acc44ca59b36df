"""How a peer shows what it is doing: a live rich panel on a terminal, JSON lines elsewhere.

Both views render the same :class:`PeerStatus`, which the peer updates after inner steps and
outer rounds. JSON lines go to stdout, one object per update, for log collectors in containers.
Besides these ``progress`` lines a view shows **events** (:meth:`ProgressView.event`): as JSON lines
at once (``{"time": ..., "event": KIND, ...}``, the schema is :data:`EVENTS` and docs/cli.md), or as
lines printed above the rich panel. While the rich panel is up, log records go through rich's own
handler on the panel's console, so they print above it and never through it.
The same status feeds the local status endpoint (:mod:`peer.node.local_status`): it records when the
peer last made progress, when its main loop last turned and when the coordinator last answered.
"""

from __future__ import annotations

import abc
import logging
import os
import sys
import threading
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Callable, ClassVar, Optional, TextIO

from rich.console import Console
from rich.live import Live
from rich.table import Table

from models import strict_json
from peer import settings
from peer.diloco.link_rates import LinkRates

__all__ = ["PeerStatus", "ProgressView", "JsonLinesView", "RichView", "make_view", "WAITING_STATES", "FetchView",
           "make_fetch_view", "EVENTS"]

EVENTS: dict[str, tuple[str, ...]] = {
    "join": ("peer_id", "run_id", "reachability"),
    "assignment": ("mode", "work", "reason"),
    "reroute": ("mode", "work", "previous", "reason"),
    "round": ("module", "round", "status", "peers", "group_size", "bytes_sent", "bytes_received", "seconds",
              "transfer_seconds", "reason"),
    "checkpoint": ("path", "round", "error"),
    "drain": ("reason", "preempting", "drain_timeout"),
    "leave": ("reason", "drain_seconds"),
    "error": ("message", "exit_code"),
    "failover": ("module", "from_server", "to_server", "reason"),
    "detour": ("from_path", "to_path", "reason"),
}
"""The events a peer emits and the fields each carries (besides ``time`` and ``event``): ``join`` once
admitted; ``assignment`` for its first work and ``reroute`` when the coordinator moves it (``previous``:
the work it leaves); ``round`` per module and outer round (``status`` ``done`` or ``failed``, ``peers``
the group's members, ``seconds`` the exchange's wait, ``transfer_seconds`` its all-reduce's time);
``checkpoint`` after each snapshot (``error`` when it failed); ``drain`` when a drain begins; ``leave``
as the process ends (``drain_seconds``: how long the drain took, None without one); ``error`` for a problem that stops it; ``failover`` when a
stage-mode trainer's request leaves a stage server of ``module`` that failed (``reason``) for
``to_server``, or for none (None: no server of the module answered in time, the step is abandoned);
``detour`` when such a trainer drives another pipeline (``to_path``) because a level of the one it
drove (``from_path``) has no server, and when it goes back."""

WAITING_STATES = ("starting", "fetching", "joining", "loading", "waiting", "draining", "stopped")
"""States in which a peer waits on something outside its main loop (the coordinator, the DHT, a
module's holders, the end of a round, a pipeline to serve or a server of its level): they make no
training progress and are not a stall."""

_PROGRESS_FIELDS = frozenset({"step", "round_no", "tokens"})


@dataclass
class PeerStatus:
    """Everything the progress views show about one peer.

    Besides the fields, it keeps three monotonic clock readings for the health check, none of which
    any writer has to maintain by hand: ``progress_at`` moves whenever ``step``, ``round_no`` or
    ``tokens`` is assigned a new value (an inner step, an outer round, a stage server's work), and
    ``state_at`` whenever ``state`` changes; ``loop_at`` (:meth:`mark_loop`) and ``heartbeat_at``
    (:meth:`mark_heartbeat`, None until the coordinator first answers) are set by the peer.
    """

    peer_id: str = ""
    mode: str = "path"
    assignment: str = ""
    """The path (``0,1``) or the module served."""
    round_no: int = 0
    step: int = 0
    loss: Optional[float] = None
    tokens_per_s: float = 0.0
    """Path mode: tokens/s trained since the start of the work; stage server and trainer: tokens/s
    served over the last window (0 when idle)."""
    capacity_tokens_per_s: float = 0.0
    """A stage server's tokens/s at full load (served tokens over busy seconds; 0: not measured)."""
    busy_seconds: float = 0.0
    """A stage server's seconds spent serving, all told: its capacity over any window is the increase
    of ``tokens`` over the increase of this."""
    failovers: int = 0
    """A pipeline trainer's requests that another server answered after the first one failed."""
    tokens: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    group_sizes: dict[str, int] = field(default_factory=dict)
    """Module id -> members in its last averaging round."""
    link: LinkRates = field(default_factory=LinkRates)
    """Upload and download rates measured from this peer's averaging rounds (sent in heartbeats)."""
    coordinator: str = "connected"
    reachability: str = ""
    """Whether others can dial this peer, as the coordinator found at join (``reachable at ...``,
    ``unreachable``, ``client mode``)."""
    state: str = "starting"
    """starting, fetching (the dataset's files), joining, loading, training, averaging, following
    (archive), waiting (a stage server nobody drives, a trainer whose pipeline lacks a server),
    draining, stopped."""
    checkpoint: str = ""
    """The newest snapshot written (its directory)."""
    checkpoint_error: str = ""
    """Why the last checkpoint failed (disk full, ...); empty after a successful one."""

    clock: ClassVar[Callable[[], float]] = time.monotonic
    """Where the readings come from (monotonic seconds); :meth:`use_clock` swaps it in tests."""

    def __post_init__(self) -> None:
        now = self.clock()
        self.__dict__.update(progress_at=now, state_at=now, loop_at=now, heartbeat_at=None)

    def __setattr__(self, name: str, value) -> None:
        old = self.__dict__.get(name, value)
        if old != value:
            if name in _PROGRESS_FIELDS:
                self.__dict__["progress_at"] = self.clock()
            elif name == "state":
                self.__dict__["state_at"] = self.clock()
        object.__setattr__(self, name, value)

    def use_clock(self, clock: Callable[[], float]) -> None:
        """Read time from ``clock`` from now on (all readings restart at its current time)."""
        self.__dict__["clock"] = clock
        self.__post_init__()

    def mark_loop(self) -> None:
        """The main loop turned (called once per iteration; a loop that turns is not stuck)."""
        self.__dict__["loop_at"] = self.clock()

    def mark_heartbeat(self) -> None:
        """The coordinator answered a heartbeat."""
        self.__dict__["heartbeat_at"] = self.clock()

    def snapshot(self) -> dict:
        """The fields as a JSON-safe dict, safe to call from another thread while the peer writes."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["group_sizes"] = dict(self.group_sizes)
        out["link"] = asdict(self.link)
        return out


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


class ProgressView(abc.ABC):
    """Base view: ``update`` is cheap and rate-limited; ``close`` prints a final line."""

    def __init__(self, min_interval: float = 0.5):
        self.min_interval = min_interval
        self._last = 0.0

    def update(self, status: PeerStatus, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._last >= self.min_interval:
            self._last = now
            self.render(status)

    @abc.abstractmethod
    def render(self, status: PeerStatus) -> None:
        """Show ``status`` now."""

    def close(self, status: Optional[PeerStatus] = None) -> None:
        if status is not None:
            self.render(status)

    def event(self, kind: str, **fields: Any) -> None:
        """Show one event now (``kind`` and its fields: :data:`EVENTS`)."""
        unknown = set(fields) - set(EVENTS[kind])
        if unknown:
            raise ValueError(f"event {kind!r} has no field(s) {sorted(unknown)}")
        self.show_event(kind, {name: fields.get(name) for name in EVENTS[kind]})

    @abc.abstractmethod
    def show_event(self, kind: str, fields: dict) -> None:
        """Render one event (every field of its kind present)."""


class JsonLinesView(ProgressView):
    """One JSON object per update on ``stream`` (stdout by default), and one per event."""

    def __init__(self, stream: TextIO = sys.stdout, min_interval: float = 5.0):
        super().__init__(min_interval)
        self.stream = stream
        self._lock = threading.RLock()  # events come from the heartbeat thread and signal handlers too

    def render(self, status: PeerStatus) -> None:
        self._write({"time": round(time.time(), 3), "event": "progress", **asdict(status)})

    def show_event(self, kind: str, fields: dict) -> None:
        self._write({"time": round(time.time(), 3), "event": kind, **fields})

    def _write(self, record: dict) -> None:
        line = strict_json.dumps(record, sort_keys=True) + "\n"
        with self._lock:
            self.stream.write(line)
            self.stream.flush()


class RichView(ProgressView):
    """A small live table on the terminal. While it is up, the root logger's stream handlers are
    replaced by a :class:`rich.logging.RichHandler` on the panel's console, so log lines print above
    the panel instead of through it; :meth:`close` puts them back."""

    def __init__(self, console: Optional[Console] = None):
        super().__init__(0.25)
        self.console = console or Console(stderr=True)
        self.live = Live(console=self.console, auto_refresh=False, transient=False, redirect_stderr=False,
                         redirect_stdout=False)
        self._handlers = self._log_through_console()
        self.live.start()

    def _log_through_console(self) -> list[logging.Handler]:
        from rich.logging import RichHandler

        root = logging.getLogger()
        replaced = [h for h in root.handlers if type(h) is logging.StreamHandler]
        level = min((h.level for h in replaced), default=logging.NOTSET)
        for h in replaced:
            root.removeHandler(h)
        self._rich_handler = RichHandler(console=self.console, level=level, show_path=False, log_time_format="%H:%M:%S")
        root.addHandler(self._rich_handler)
        return replaced

    def show_event(self, kind: str, fields: dict) -> None:
        from rich.text import Text

        shown = " ".join(f"{k}={v}" for k, v in fields.items() if v not in (None, "", [], {}))
        self.console.print(Text.assemble((kind, "bold"), " ", shown), highlight=False)

    def render(self, status: PeerStatus) -> None:
        table = Table(title=f"hivepath peer {status.peer_id[:12]}", show_header=False, expand=False)
        table.add_column(style="bold")
        table.add_column()
        loss = f"{status.loss:.3f}" if status.loss is not None else "-"
        groups = ", ".join(f"{m}:{n}" for m, n in sorted(status.group_sizes.items())) or "-"
        rows = [
            ("state", f"{status.state} ({status.mode} {status.assignment})"),
            ("round / step", f"{status.round_no} / {status.step}"),
            ("loss", loss),
            ("tokens/s" if status.mode == "path" else "served tokens/s", f"{status.tokens_per_s:,.0f}"
             + (f" of {status.capacity_tokens_per_s:,.0f}" if status.mode == "stage" and status.capacity_tokens_per_s
                else "")),
            ("tokens", f"{status.tokens:,}"),
            *([("failovers", f"{status.failovers:,}")] if status.mode == "trainer" else []),
            ("sent / received", f"{_fmt_bytes(status.bytes_sent)} / {_fmt_bytes(status.bytes_received)}"),
            ("group sizes", groups),
            ("coordinator", status.coordinator),
            ("reachability", status.reachability or "-"),
            ("checkpoint", status.checkpoint_error or os.path.basename(status.checkpoint) or "-"),
        ]
        for k, v in rows:
            table.add_row(k, v)
        self.live.update(table, refresh=True)

    def close(self, status: Optional[PeerStatus] = None) -> None:
        try:
            super().close(status)
            self.live.stop()
        finally:
            root = logging.getLogger()
            root.removeHandler(self._rich_handler)
            for h in self._handlers:
                root.addHandler(h)


def make_view(fmt: str = "auto") -> ProgressView:
    """``rich`` on a terminal, ``json`` lines otherwise (``auto`` decides by stderr being a TTY).
    JSON lines come at most every ``HIVEPATH_PROGRESS_INTERVAL`` seconds (default 5)."""
    if fmt == "auto":
        fmt = "rich" if sys.stderr.isatty() else "json"
    if fmt == "rich":
        return RichView()
    if fmt == "json":
        return JsonLinesView(min_interval=settings.read("HIVEPATH_PROGRESS_INTERVAL"))
    raise ValueError(f"unknown progress format {fmt!r}; use auto, rich or json")


class FetchView:
    """What a peer shows while it fetches its path's shards (``peer.node.run_data``): a rich bar of
    bytes verified, rate, time left and seeders on a terminal, or JSON lines (``{"event": "fetch",
    ...}`` at most every ``min_interval`` seconds and at the end of each fetch, ``{"event":
    "bad_seeder", ...}`` when a seeder is dropped), the same fields ``hivepath data fetch --progress
    json`` prints."""

    def __init__(self, fmt: str, stream: TextIO = sys.stdout, min_interval: float = 0.5):
        self.fmt = fmt
        self.stream = stream
        self.min_interval = min_interval
        self._bar = None
        self._task = None
        self._what = ""
        self._started = time.monotonic()
        self._last = float("-inf")

    def start(self, what: str) -> None:
        """A new fetch begins (``what``: e.g. ``path 0-1 train``)."""
        self._what, self._started, self._last = what, time.monotonic(), float("-inf")
        if self.fmt == "rich":
            from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                                       TransferSpeedColumn)

            self._bar = Progress(TextColumn("fetching {task.description}"), BarColumn(), DownloadColumn(),
                                 TransferSpeedColumn(), TimeRemainingColumn(),
                                 TextColumn("{task.fields[seeders]} seeder(s)"), console=Console(stderr=True),
                                 transient=True)
            self._bar.start()
            self._task = self._bar.add_task(what, total=None, seeders=0)

    def update(self, p: Any, final: bool = False) -> None:
        """A :class:`peer.datasync.FetchProgress` after a chunk (``final``: the fetch is done)."""
        if self._bar is not None:
            self._bar.update(self._task, total=p.total_bytes, completed=p.done_bytes, seeders=p.seeders)
            return
        now = time.monotonic()
        if not final and now - self._last < self.min_interval:
            return
        self._last = now
        rate = p.fetched_bytes / max(now - self._started, 1e-9)
        eta = (p.total_bytes - p.done_bytes) / rate if rate > 0 else None
        self._emit({"event": "fetch", "what": self._what, "done_bytes": p.done_bytes, "total_bytes": p.total_bytes,
                    "fetched_bytes": p.fetched_bytes, "files_done": p.files_done, "files_total": p.files_total,
                    "seeders": p.seeders, "rate_bytes_s": rate, "eta_s": eta})

    def bad_seeder(self, peer_id: str, what: str) -> None:
        if self._bar is not None:
            self._bar.console.print(f"dropped seeder {peer_id}: {what}")
        else:
            self._emit({"event": "bad_seeder", "seeder": peer_id, "what": what})

    def stop(self, p: Any = None) -> None:
        """The fetch ended (``p``: its last progress, when it finished)."""
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
        elif p is not None:
            self.update(p, final=True)

    def _emit(self, event: dict) -> None:
        self.stream.write(strict_json.dumps({"time": round(time.time(), 3), **event}, sort_keys=True) + "\n")
        self.stream.flush()


def make_fetch_view(fmt: str = "auto") -> FetchView:
    """The fetch display matching :func:`make_view`'s choice (``auto``: rich on a terminal)."""
    if fmt == "auto":
        fmt = "rich" if sys.stderr.isatty() else "json"
    return FetchView(fmt)
