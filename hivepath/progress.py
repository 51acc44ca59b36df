"""Progress displays of the command line that more than one command shows.

- :func:`prepare_with_progress`: ``hivepath data prepare`` and ``hivepath train-local`` (which
  prepares the built-in corpus on first use) run :func:`models.data.prepare` on
  :func:`models.corpus.select_corpus` behind a spinner naming the stage and the documents done.
- :func:`fetch_with_progress`: ``hivepath data fetch`` runs :func:`peer.datasync.fetch` behind a bar
  of bytes verified, rate and time left, or prints JSON lines (``progress`` at most every
  :data:`JSON_INTERVAL` seconds and at the end, ``bad_seeder`` when a seeder is dropped).
"""

from __future__ import annotations

import sys
import time
from typing import Any, Optional, Sequence

from models import strict_json

__all__ = ["prepare_with_progress", "fetch_with_progress", "JSON_INTERVAL"]

JSON_INTERVAL = 0.5
"""Seconds between two JSON progress lines of a fetch."""


def prepare_with_progress(sources: Sequence[str], corpus: Optional[str], out: str, levels: int, modules: int,
                          tokenizer: str, seed: int = 0) -> dict:
    """Prepare a dataset from ``sources`` or the ``corpus`` named (:func:`models.corpus.select_corpus`)
    with a transient rich display; returns the manifest."""
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from models.corpus import select_corpus
    from models.data import prepare

    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TextColumn("{task.completed} documents"),
                  TimeElapsedColumn(), transient=True) as bar:
        task = bar.add_task("preparing", total=None)
        return prepare(select_corpus(sources, corpus), out, levels=levels, modules=modules, tokenizer=tokenizer,
                       seed=seed, progress=lambda stage, n: bar.update(task, description=stage, completed=n))


def fetch_with_progress(dht: Any, manifest_hash: str, paths: Sequence[tuple[int, ...]], out: str, options: Any,
                        style: str = "bar") -> Any:
    """:func:`peer.datasync.fetch` with a rich bar (``style="bar"``) or JSON lines on stdout (``"json"``);
    returns its :class:`peer.datasync.FetchResult`."""
    from peer.datasync import fetch

    if style == "json":
        return _fetch_json(fetch, dht, manifest_hash, paths, out, options)
    from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                               TransferSpeedColumn)

    with Progress(TextColumn("fetching {task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  TimeRemainingColumn(), TextColumn("{task.fields[seeders]} seeder(s)"), transient=True) as bar:
        task = bar.add_task(manifest_hash, total=None, seeders=0)

        def show(p: Any) -> None:
            bar.update(task, total=p.total_bytes, completed=p.done_bytes, seeders=p.seeders)

        def bad(peer: str, what: str) -> None:
            bar.console.print(f"dropped seeder {peer}: {what}")

        return fetch(dht, manifest_hash, paths, out, options, on_progress=show, on_bad_seeder=bad)


def _fetch_json(fetch: Any, dht: Any, manifest_hash: str, paths: Sequence[tuple[int, ...]], out: str,
                options: Any) -> Any:
    started = time.monotonic()
    last = {"t": float("-inf")}

    def emit(event: dict) -> None:
        sys.stdout.write(strict_json.dumps({**event, "time": round(time.time(), 3)}) + "\n")
        sys.stdout.flush()

    def show(p: Any, final: bool = False) -> None:
        now = time.monotonic()
        if not final and now - last["t"] < JSON_INTERVAL and p.done_bytes < p.total_bytes:
            return
        last["t"] = now
        rate = p.fetched_bytes / max(now - started, 1e-9)
        eta = (p.total_bytes - p.done_bytes) / rate if rate > 0 else float("nan")
        emit({"event": "progress", "manifest_hash": manifest_hash, "done_bytes": p.done_bytes,
              "total_bytes": p.total_bytes, "fetched_bytes": p.fetched_bytes, "files_done": p.files_done,
              "files_total": p.files_total, "seeders": p.seeders, "rate_bytes_s": rate, "eta_s": eta})

    def bad(peer: str, what: str) -> None:
        emit({"event": "bad_seeder", "peer_id": peer, "what": what})

    return fetch(dht, manifest_hash, paths, out, options, on_progress=show, on_bad_seeder=bad)
