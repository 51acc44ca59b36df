"""``hivepath demo``: a whole network on this machine, as real processes on loopback.

A coordinator, an archive peer and N volunteer peers train the demo preset's 2x2 lattice on the
built-in corpus for a few minutes; ``small_peers`` more peers, too small for a path
(:func:`peer.demo.roles.small_peer_memory`), serve pipeline stages or drive pipelines on the same
lattice. A live table shows peers and rounds; at the end the demo
evaluates routed validation bits per byte before and after (on the archive's copy of the model),
compares the bytes the network exchanged with what synchronous data-parallel training would have
sent for the same tokens, and writes ``runs/ID/report.md`` (with loss curves) and ``summary.json``.

The processes are the installed ``hivepath`` commands a user would run by hand; the demo only
starts, watches and stops them. Ctrl-C stops every process cleanly (a second Ctrl-C kills them).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from models.config import RunConfig
from models.errors import HivepathError
from models.presets import PRESETS
from peer import settings
from peer.demo.roles import MEMORY_HEADROOM, PeerLines, small_peer_memory

__all__ = ["DemoOptions", "run_demo"]

log = logging.getLogger(__name__)

START_LIMIT_S = 300.0
"""How long the demo waits for the first trained tokens before it gives up (torch loading, joining)."""

COORDINATOR = {"heartbeat_interval": 2.0, "lease_timeout": 15.0, "memory_headroom": MEMORY_HEADROOM}
"""The demo's ``[coordinator]`` table: leases of a network on one machine (a stopped peer's work goes to
another within seconds), and the share of a peer's memory the role rules count on
(:data:`peer.demo.roles.MEMORY_HEADROOM`)."""

ARCHIVE_WAIT_S = 300.0
"""How long past ``--minutes`` the demo keeps training while the archive holds no whole path yet (a
loaded machine: every module of a path must finish a round before there is a trained model to score)."""


@dataclass
class DemoOptions:
    peers: int = 4
    small_peers: int = 0
    """Peers started with a ``--max-memory`` too small for a path: stage servers and pipeline trainers."""
    minutes: float = 3.0
    preset: str = "demo"
    out: Optional[Path] = None
    data: Optional[Path] = None
    threads_per_peer: int = 1
    eval_documents: int = 40
    """Validation documents per path for the before/after bits per byte."""
    live: bool = True
    """The live table; else plain progress lines every ``HIVEPATH_PROGRESS_INTERVAL`` seconds and one
    line per event of a peer, through the log."""
    extra_peer_args: list[str] = field(default_factory=list)


def run_demo(opts: DemoOptions) -> dict[str, Any]:
    """Run the demo network; returns the summary (also written to ``OUT/summary.json``)."""
    from models.checkpoint.layout import is_run_dir, resolve_snapshot
    from peer.coordinator_client import CoordinatorClient
    from peer.demo.report import (
        DemoMonitor,
        evaluate_init,
        evaluate_run_dir,
        write_report,
    )
    from peer.localnet import LocalNetwork, ProcessGroup
    from peer.node import ensure_dataset
    from peer.node.startup import drain_signals

    if opts.peers < 1:
        raise HivepathError(f"--peers must be >= 1, got {opts.peers}")
    if opts.small_peers < 0:
        raise HivepathError(f"--small-peers must be >= 0, got {opts.small_peers}")
    if opts.minutes <= 0:
        raise HivepathError(f"--minutes must be > 0, got {opts.minutes}")
    if opts.preset not in PRESETS:
        raise HivepathError(f"--preset {opts.preset!r} is not one of {', '.join(PRESETS)}")
    out = Path(opts.out or Path("runs") / time.strftime("demo-%Y%m%d-%H%M%S"))
    (out / "logs").mkdir(parents=True, exist_ok=True)
    cfg = PRESETS[opts.preset]()
    lat = cfg.lattice
    data_dir = Path(opts.data or Path("data") / f"default-{cfg.data.tokenizer.replace(':', '')}-{lat.levels}x{lat.modules_per_level}")
    dataset = ensure_dataset(cfg, data_dir, out, "")
    cfg = cfg.replace(lattice={"vocab_size": dataset.manifest["vocab_size"]}, data={"manifest_hash": dataset.manifest_hash})
    small = small_peer_memory(cfg) if opts.small_peers else None
    procs = ProcessGroup(out / "logs")
    # the network's run.toml, token file, state database and each peer's work directory live in OUT
    net = LocalNetwork(procs, out, data_dir, cfg, COORDINATOR, threads=opts.threads_per_peer,
                       env={"HIVEPATH_LOG_LEVEL": "INFO"})
    names: list[str] = []
    begun = time.monotonic()
    stopped_by: Optional[str] = None  # what ended the run early: "SIGTERM received after 12.3 s"

    # Ctrl-C, SIGTERM (timeout, docker stop, systemd) or SIGHUP (terminal closed): stop training, drain
    # every peer and still write the report; a second signal exits at once, and the watchdog of
    # peer.node.lifetime stops the children
    def on_signal(why: str) -> None:
        nonlocal stopped_by
        stopped_by = f"{why} after {time.monotonic() - begun:.1f} s"

    with drain_signals(on_signal):
        # the untrained lattice (every peer's start, fixed by the seed) is scored while the network
        # starts, not before it: the processes come up at once instead of after minutes of evaluation
        before = _Background(_on_one_thread, evaluate_init, cfg, dataset, opts.eval_documents)
        lines = PeerLines()
        monitor = DemoMonitor(cfg, live=opts.live, lines=lines, interval=settings.read("HIVEPATH_PROGRESS_INTERVAL"))
        try:
            net.start_coordinator(timeout=START_LIMIT_S)
            client = CoordinatorClient(net.address, net.token, retry_timeout=30.0, expect_starting=True)
            client.status()
            net.start_archive("archive", eval_docs=None,
                              extra=["--identity", str(out / "archive.key"), "--progress", "json"])
            names.append("archive")
            small_args = [] if small is None else ["--max-memory", f"{small.max_memory_gb:g}"]
            peers = [(f"peer{i}", []) for i in range(opts.peers)]
            peers += [(f"small{i}", small_args) for i in range(opts.small_peers)]
            for name, extra in peers:
                lines.watch(name, out / "logs" / f"{name}.log")
                net.start_peer(name, *extra, *opts.extra_peer_args)
                names.append(name)
            if small is not None:
                log.info("small peers: --max-memory %g GB (%.0f%% usable) fits a stage (%d bytes) and a trainer "
                         "(%d) but not a path (%d)", small.max_memory_gb, 100 * MEMORY_HEADROOM, small.stage_bytes,
                         small.trainer_bytes, small.path_bytes)
            # --minutes is training time: the clock starts when the first peer reports trained tokens, so
            # that a slow start (torch loading on a busy machine) does not eat the run
            started = time.monotonic()
            deadline: Optional[float] = None
            waiting_archive = False
            with monitor:
                while stopped_by is None:
                    if deadline is not None and time.monotonic() >= deadline:
                        if time.monotonic() >= deadline + ARCHIVE_WAIT_S or _archived_path(out / "archive", cfg):
                            break
                        if not waiting_archive:
                            log.info("%g minutes trained; training on until the archive holds every module of one "
                                     "path (at most %.0f s more)", opts.minutes, ARCHIVE_WAIT_S)
                            waiting_archive = True
                    if monitor.bpb_before is None and before.done():
                        monitor.bpb_before = before.result()
                    monitor.poll(client, procs.procs, net.http_port)
                    if deadline is None and monitor.history and monitor.history[-1]["tokens"] > 0:
                        deadline = time.monotonic() + opts.minutes * 60
                    if deadline is None and time.monotonic() - started > START_LIMIT_S:
                        raise HivepathError(f"no peer started training within {START_LIMIT_S:.0f} s; "
                                            f"see the logs in {out / 'logs'}")
                    dead = [n for n in names if procs.procs[n].poll() is not None]
                    if dead and len(dead) == len(names):
                        raise HivepathError(f"every peer exited early; see the logs in {out / 'logs'}")
                    time.sleep(1.0)
            peer_names = [n for n in names if n != "archive"]
            codes = procs.stop(peer_names, timeout=60)
            monitor.poll(client, procs.procs, net.http_port)
            codes.update(procs.stop(["archive"], timeout=30))
            client.close()
        finally:
            procs.stop(list(procs.procs), timeout=30)
        bpb_before = before.result()
        if is_run_dir(resolve_snapshot(out / "archive")):
            bpb_after, per_path = evaluate_run_dir(out / "archive", dataset, opts.eval_documents)
        elif stopped_by is not None:  # stopped early: the report says there is nothing trained to score yet
            bpb_after, per_path = None, {}
        else:
            raise HivepathError(
                f"no module finished an averaging round in {opts.minutes:g} minutes of training, so the archive "
                f"({out / 'archive'}) holds no trained state to score; run longer with --minutes "
                f"(the logs are in {out / 'logs'})")
        summary = monitor.summary(cfg, opts, bpb_before, bpb_after, per_path, codes)
        summary["small_peer_max_memory_gb"] = small.max_memory_gb if small is not None else None
        summary["stopped_by"] = stopped_by
        summary["report"] = str(out / "report.md")
        write_report(out, summary, monitor)
    return summary


def _archived_path(archive: Path, cfg: RunConfig) -> bool:
    """True once the archive's newest snapshot holds every module of some path (a model to score)."""
    from models.checkpoint import CheckpointError
    from models.checkpoint.layout import read_summary, resolve_snapshot

    try:
        held = set(map(str, read_summary(resolve_snapshot(archive)).get("modules", ())))
    except (CheckpointError, AttributeError, TypeError):  # no snapshot yet, or not one we can read
        return False
    lattice = cfg.lattice
    return any(all(str(m) in held for m in lattice.path_modules(p)) for p in lattice.paths())


def _on_one_thread(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` with torch on one thread: the peers starting beside it get the other cores."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn(*args)
    finally:
        torch.set_num_threads(threads)


class _Background:
    """``fn(*args)`` in a daemon thread (an error or a second signal exits without waiting for it);
    :meth:`result` waits for its value or raises its exception."""

    def __init__(self, fn: Any, *args: Any):
        self._out: dict[str, Any] = {}
        self._thread = threading.Thread(target=self._run, args=(fn, args), name=getattr(fn, "__name__", "background"),
                                        daemon=True)
        self._thread.start()

    def _run(self, fn: Any, args: tuple) -> None:
        try:
            self._out["value"] = fn(*args)
        except BaseException as e:  # handed to the caller of result()
            self._out["error"] = e

    def done(self) -> bool:
        """Whether ``fn`` returned (:meth:`result` has its value) or raised."""
        return not self._thread.is_alive()

    def result(self) -> Any:
        self._thread.join()
        if "error" in self._out:
            raise self._out["error"]
        return self._out["value"]
