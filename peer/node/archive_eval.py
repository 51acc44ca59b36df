"""The archive's evaluation of its snapshots: routed validation bits per byte of every complete path
(:func:`models.evaluate.evaluate_lattice`, what ``hivepath eval`` computes), handed to the coordinator
with the archive's next heartbeat; the status page plots them over the run.

The archive is the honest place for it: it holds the modules every trainer averaged (the majority's
state, :func:`peer.node.archive._majority_check`) and the run's dataset, and it trains nothing, so the
scoring costs no training time. It does cost CPU, often on a machine that trains too (a demo, a small
operator's box): one snapshot is scored at a time in a background thread, at most one every
``min_interval`` seconds; a snapshot written meanwhile waits, and only the newest waiting one is scored.
"""

from __future__ import annotations

import logging
import math
import threading
from pathlib import Path
from typing import Any, Callable, Optional

from models.config import format_path
from peer.coordinator_client import Evaluation

__all__ = ["evaluate_snapshot", "SnapshotEvaluator"]

log = logging.getLogger(__name__)


def evaluate_snapshot(snapshot: Path, dataset: Any, max_documents: int,
                      should_stop: Callable[[], bool] = lambda: False) -> list[Evaluation]:
    """Validation bits per byte of each complete path of ``snapshot`` (a run directory) on
    ``dataset``'s validation documents routed to it (at most ``max_documents`` per path); a path no
    validation document routes to is left out. ``round``: the lowest round of the path's modules.
    Paths are scored one at a time; ``should_stop`` true between two ends it early (no results)."""
    from models.evaluate import evaluate_lattice
    from models.run_dir import load_run_dir

    loaded = load_run_dir(snapshot, with_data=False)
    paths = loaded.available_paths()
    rounds = loaded.summary.get("rounds", {})
    out = []
    for path in paths:
        if should_stop():
            return []
        result = evaluate_lattice(loaded.model, dataset, [path], loaded.lattice.seq_len, "cpu", dense=loaded.dense,
                                  max_documents_per_path=max_documents)
        bpb = result.per_path.get("dense" if loaded.dense else format_path(path), {}).get("bpb")
        if bpb is None or not math.isfinite(bpb):
            continue
        rnd = min(int(rounds.get(m, 0)) for m in loaded.lattice.path_modules(path))
        out.append(Evaluation(tuple(path), float(bpb), rnd))
    return out


class SnapshotEvaluator:
    """Scores snapshots in one background thread and keeps the latest results until a heartbeat
    delivered them (:meth:`pending`, then :meth:`delivered` from the heartbeat's reply)."""

    def __init__(self, dataset: Any, max_documents: int, min_interval: float = 60.0):
        if max_documents < 1:
            raise ValueError(f"max_documents must be >= 1, got {max_documents}")
        if not min_interval >= 0:
            raise ValueError(f"min_interval must be >= 0, got {min_interval}")
        self.dataset = dataset
        self.max_documents = max_documents
        self.min_interval = min_interval
        self._closed = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()
        self._waiting: Optional[Path] = None
        self._busy = False
        self._results: list[Evaluation] = []
        self.scored = 0
        """Snapshots scored so far."""

    def submit(self, snapshot: Path) -> None:
        """Score ``snapshot`` when the thread is free (replacing any snapshot still waiting)."""
        with self._lock:
            if self._closed.is_set():
                return
            self._waiting = Path(snapshot)
            if self._busy:
                return
            self._busy = True
        self._thread = threading.Thread(target=self._work, name="archive-eval", daemon=True)
        self._thread.start()

    def close(self, timeout: float = 60.0) -> None:
        """Score nothing more, and wait for a scoring under way to end (at its next path): torch work
        still running in a thread when the interpreter exits aborts the process."""
        self._closed.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _work(self) -> None:
        rest = False
        while True:
            if rest and self._closed.wait(self.min_interval):  # after a scoring that cost something
                return
            with self._lock:
                snapshot, self._waiting = self._waiting, None
                if snapshot is None:
                    self._busy = False
                    return
            try:
                results = evaluate_snapshot(snapshot, self.dataset, self.max_documents, self._closed.is_set)
            except Exception as e:  # a snapshot rotated away meanwhile, a torn file: the next one is scored
                log.warning("could not evaluate %s: %s", snapshot, e)
                continue
            rest = bool(results)
            log.info("validation of %s: %s", snapshot.name,
                     ", ".join(f"path {format_path(r.path)} {r.bpb:.3f} bits/byte" for r in results) or "no path")
            with self._lock:
                if results:  # a snapshot without a complete path leaves the last results to be sent
                    self._results = results
                self.scored += 1

    def pending(self) -> list[Evaluation]:
        """The latest results not yet delivered (the same list object until :meth:`delivered`)."""
        with self._lock:
            return self._results

    def delivered(self, sent: list[Evaluation]) -> None:
        """A heartbeat carrying ``sent`` (a :meth:`pending` list) was answered: do not send it again."""
        with self._lock:
            if self._results is sent:
                self._results = []
