"""The run's dataset in a long-running peer process: found, prepared or fetched; seeded; kept in budget.

The one place where ``hivepath peer join`` (path and stage mode) and ``hivepath archive`` get their
data (a volunteer needs no data of its own):

1. **Local** (:func:`local_dataset`, before the DHT starts): ``--data`` if given (prepared there
   first when it holds no dataset yet and the corpus is here); else the dataset under the work
   directory, prepared there when the run's corpus can be prepared on this machine
   (the built-in corpus, or a corpus directory that exists here). Checked against the run's manifest
   hash, only the paths it holds (a ``--data`` directory may hold some paths only).
2. **From the network** otherwise (a run on a custom corpus that pins its manifest hash):
   :meth:`RunData.fetch_meta`, once the DHT is up and before joining, fetches the manifest (checked
   against the run's hash), router and tokenizer into ``WORK_DIR/data-<hash>`` (or ``--data``);
   :meth:`RunData.ensure_path`, once the coordinator assigned a path, fetches that path's training
   shard and returns as soon as it is verified (training starts then), and its validation shard in
   the background. Stage servers need no shard (a stage computes on the activations trainers send
   it), so they fetch none. Progress: :class:`peer.node.progress.FetchView` (rich bar or JSON lines).
3. **Seeding** (:meth:`RunData.start_seeding`, after the join): a :class:`peer.datasync.Seeder` over
   the dataset directory announces what is held; files fetched later are announced as each
   completes. ``--no-seed`` turns it off. :meth:`RunData.seeded_paths` goes into heartbeats, so the
   coordinator's status page counts seeders per shard.
4. **Reassignment**: :meth:`RunData.ensure_path` for the new path; other paths' shards stay under the
   ``--max-data-gb`` budget (:class:`peer.datasync.ShardCache`, least recently trained out first,
   never the path being trained).
5. **Bad seeders** seen by any fetch are reported to the coordinator (``ReportPeer`` with the
   manifest hash); those seen before the join are reported once joined.

A fetch runs in a worker thread while the caller polls ``should_stop``: a drain signal abandons it
at once, and the verified chunks are kept for the next start.
"""

from __future__ import annotations

import logging
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from models.config import RunConfig
from models.errors import DataError
from models.manifest import path_name
from peer.node.progress import PeerStatus, make_fetch_view

__all__ = ["DataOptions", "RunData", "local_dataset", "ensure_dataset", "fetched_dir"]

log = logging.getLogger(__name__)

_POLL = 0.2
"""Seconds between looks at ``should_stop`` while a fetch runs."""
_CHUNK_OF = re.compile(r"chunk (\d+) of (\S+)$")


@dataclass(frozen=True)
class DataOptions:
    """How a peer process gets and shares the run's dataset (``hivepath peer join`` flags)."""

    data_dir: Optional[Path] = None
    """A prepared (or fetched) dataset; None: found, prepared or fetched under the work directory."""
    seed: bool = True
    """Seed the files held to other peers (``--no-seed`` turns it off)."""
    max_data_bytes: Optional[int] = None
    """Disk budget for fetched shards (``--max-data-gb``); None: keep every path fetched."""
    progress: str = "auto"
    """``auto``, ``rich`` or ``json``: how a fetch shows its progress."""
    no_seeder_timeout: float = 120.0
    """Seconds a file may wait with no seeder sending it before the peer gives up (exit 3)."""


def fetched_dir(work_dir: Path, manifest_hash: str) -> Path:
    """Where a peer fetches dataset ``manifest_hash``: ``WORK_DIR/data-<hash>``."""
    return Path(work_dir) / f"data-{manifest_hash}"


def _prepared_dir(cfg: RunConfig, work_dir: Path) -> Path:
    lat = cfg.lattice
    name = Path(cfg.data.corpus).name or "corpus"
    return Path(work_dir) / f"data-{name}-{cfg.data.tokenizer.replace(':', '')}-{lat.levels}x{lat.modules_per_level}"


def _preparable(cfg: RunConfig, manifest_hash: str = "") -> bool:
    """Whether the run's corpus can be prepared here: a corpus directory that exists, or the built-in
    corpus with its packages installed. Without them, a run that pins its manifest hash is fetched
    from its seeders instead; one that does not is an error naming the command that installs them."""
    if cfg.data.corpus != "default":
        return Path(cfg.data.corpus).expanduser().exists()
    from models.corpus import missing_corpus_packages

    missing = missing_corpus_packages()
    if not missing:
        return True
    if not manifest_hash:
        raise DataError(f"the built-in corpus cannot be prepared here and the run pins no manifest hash to fetch it by; "
                        f"install it with: {' && '.join(missing)}")
    log.info("the built-in corpus is not installed here (%s installs it): fetching the run's data from the peers "
             "that seed it", " && ".join(missing))
    return False


def local_dataset(cfg: RunConfig, data_dir: Optional[Path], work_dir: Path, manifest_hash: str):
    """The run's dataset from this machine (see the module docstring), or None when it must come
    from the network: no ``data_dir``, a corpus not on this machine, and a manifest hash to fetch by."""
    from models.data import MANIFEST_FILE, Dataset

    if data_dir is not None and not (Path(data_dir) / MANIFEST_FILE).exists():
        if _preparable(cfg, manifest_hash):  # --data names where to prepare it
            _prepare_once(cfg, Path(data_dir))
        elif manifest_hash:
            return None  # fetched into data_dir
    if data_dir is None:
        prepared = _prepared_dir(cfg, work_dir)
        if (prepared / MANIFEST_FILE).exists() or _preparable(cfg, manifest_hash):
            data_dir = _prepare_once(cfg, prepared)
        elif manifest_hash and (fetched_dir(work_dir, manifest_hash) / MANIFEST_FILE).exists():
            data_dir = fetched_dir(work_dir, manifest_hash)
        elif manifest_hash:
            return None
        else:
            raise DataError(f"the run's corpus {cfg.data.corpus!r} is not on this machine and the run pins no "
                            "manifest hash to fetch it by; pass --data DIR (a prepared copy), or ask the operator to "
                            "set [data] manifest_hash in the run config")
    ds = Dataset(data_dir)
    if manifest_hash:
        ds.check(manifest_hash, paths=ds.local_paths)
    return ds


def ensure_dataset(cfg: RunConfig, data_dir: Optional[Path], work_dir: Path, manifest_hash: str):
    """The run's dataset from this machine (:func:`local_dataset`), or a :class:`DataError` when it
    would have to be fetched (the demo and the benchmarks prepare the built-in corpus)."""
    ds = local_dataset(cfg, data_dir, work_dir, manifest_hash)
    if ds is None:
        raise DataError(f"the run's corpus {cfg.data.corpus!r} is not on this machine; 'hivepath peer join' fetches "
                        f"it from the network, or pass --data DIR")
    return ds


def _prepare_once(cfg: RunConfig, data_dir: Path) -> Path:
    """Prepare the run's corpus into ``data_dir`` unless there already (once, under a lock:
    :func:`models.data.prepared`)."""
    from models.corpus import corpus_from_paths, default_corpus
    from models.data import prepared

    def corpus():
        log.info("preparing the run's dataset (%s, %s) in %s", cfg.data.corpus, cfg.data.tokenizer, data_dir)
        return default_corpus() if cfg.data.corpus == "default" else corpus_from_paths([cfg.data.corpus])

    lat = cfg.lattice
    prepared(data_dir, lat.levels, lat.modules_per_level, cfg.data.tokenizer, corpus=corpus)
    return data_dir


class Stopped(Exception):
    """``should_stop`` said so while a fetch ran (the peer is draining)."""


class RunData:
    """The dataset of one peer process (see the module docstring). ``status``: its state shows
    ``fetching`` while a fetch the peer waits for runs."""

    def __init__(self, cfg: RunConfig, manifest_hash: str, work_dir: Path, opts: DataOptions = DataOptions(),
                 status: Optional[PeerStatus] = None):
        self.cfg = cfg
        self.manifest_hash = manifest_hash
        self.work_dir = Path(work_dir)
        self.opts = opts
        self.status = status or PeerStatus()
        self.dataset: Any = None
        self.cache: Any = None
        self.seeder: Any = None
        self._dht: Any = None
        self._client: Any = None
        self._pending_reports: list[tuple[str, str]] = []
        self.bad_seeders: set[str] = set()
        """Seeders a fetch of this process dropped: later fetches never ask them."""
        self._lock = threading.Lock()
        self._background: Optional[threading.Thread] = None
        self._view = None

    # -- finding or fetching the dataset --------------------------------------------------------

    def open_local(self) -> Any:
        """:func:`local_dataset`; None when the dataset must be fetched (:meth:`fetch_meta`)."""
        self.dataset = local_dataset(self.cfg, self.opts.data_dir, self.work_dir, self.manifest_hash)
        if self.dataset is not None:
            self._use(self.dataset)
        return self.dataset

    def fetch_meta(self, dht: Any, should_stop: Callable[[], bool] = lambda: False) -> Any:
        """Fetch the manifest, router and tokenizer of the run's dataset; the :class:`models.data.Dataset`."""
        from models.data import Dataset

        self._dht = dht
        out = Path(self.opts.data_dir) if self.opts.data_dir is not None else fetched_dir(self.work_dir,
                                                                                           self.manifest_hash)
        log.info("the run's dataset %s is not on this machine: fetching it from its seeders into %s",
                 self.manifest_hash, out)
        self._fetch([], out, (), "manifest, router and tokenizer", should_stop)
        self.dataset = Dataset(out)
        self.dataset.check(self.manifest_hash, paths=[])
        self._use(self.dataset)
        return self.dataset

    def _use(self, dataset: Any) -> None:
        from peer.datasync import ShardCache

        self.cache = ShardCache(dataset.dir, dataset.manifest, self.opts.max_data_bytes)

    def holds(self, path: Sequence[int]) -> bool:
        """Whether ``path``'s shards are on disk, verified (no fetch: a pipeline trainer's detours go
        only where its data already is)."""
        return self.cache is not None and self.cache.holds(tuple(path))

    def ensure_path(self, path: Sequence[int], dht: Any, should_stop: Callable[[], bool] = lambda: False) -> None:
        """Make ``path``'s training shard present and verified (fetching it if needed; returns when it
        is), and its validation shard too, fetched in the background. Raises :class:`Stopped` when
        ``should_stop()`` turns true meanwhile."""
        path = tuple(path)
        self._dht = dht
        self._wait_background(should_stop)
        if self.cache.holds(path):
            self.cache.touch(path)
            return
        if not self.manifest_hash or self.dataset.manifest.get("format") != 2:
            raise DataError(f"{self.dataset.dir} does not hold path {path_name(path)}'s shards and the run pins no "
                            "format-2 manifest to fetch them by; pass --data with a dataset that holds every path")
        removed = self.cache.make_room(path)
        if removed and self.seeder is not None:
            self.seeder.drop(*removed)
        self.cache.touch(path)
        self._fetch([path], self.dataset.dir, ("train",), f"path {path_name(path)} train", should_stop)
        self._background = threading.Thread(target=self._fetch_quietly, args=(path,), name="data-validation",
                                            daemon=True)
        self._background.start()

    def _fetch_quietly(self, path: tuple[int, ...]) -> None:
        try:
            self._fetch([path], self.dataset.dir, ("validation",), f"path {path_name(path)} validation", None)
        except Exception as e:  # training goes on without it; the next start fetches it again
            log.warning("fetching path %s's validation shard failed: %s", path_name(path), e)

    def _wait_background(self, should_stop: Callable[[], bool]) -> None:
        t = self._background
        while t is not None and t.is_alive():
            t.join(_POLL)
            if should_stop():
                raise Stopped()
        self._background = None

    def _fetch(self, paths: list, out: Path, splits: Sequence[str], what: str,
               should_stop: Optional[Callable[[], bool]]) -> Any:
        """:func:`peer.datasync.fetch` in a worker thread, with the fetch view; the foreground one
        (``should_stop`` given) shows ``fetching`` in the status and can be abandoned."""
        from peer.datasync import FetchOptions, fetch

        view = make_fetch_view(self.opts.progress) if should_stop is not None else None
        last: dict[str, Any] = {}
        outcome: dict[str, Any] = {}

        def progress(p: Any) -> None:
            last["p"] = p
            if view is not None:
                view.update(p)

        def bad(peer_id: str, what_: str) -> None:
            self.bad_seeders.add(peer_id)
            if view is not None:
                view.bad_seeder(peer_id, what_)
            self._report(peer_id, what_)

        def on_file(name: str) -> None:
            if self.seeder is not None:
                self.seeder.add(name)

        def work() -> None:
            try:
                outcome["result"] = fetch(self._dht, self.manifest_hash, paths, out,
                                          FetchOptions(no_seeder_timeout=self.opts.no_seeder_timeout),
                                          on_progress=progress, on_bad_seeder=bad, splits=splits, on_file=on_file,
                                          exclude=set(self.bad_seeders))
            except BaseException as e:  # handed to the caller's thread
                outcome["error"] = e

        if should_stop is None:
            work()
            if "error" in outcome:
                raise outcome["error"]
            return outcome["result"]
        previous = self.status.state
        self.status.state = "fetching"
        if view is not None:
            view.start(what)
        worker = threading.Thread(target=work, name="data-fetch", daemon=True)
        worker.start()
        try:
            while worker.is_alive():
                worker.join(_POLL)
                self.status.mark_loop()
                if worker.is_alive() and should_stop():
                    log.info("stopping: the fetch of %s is abandoned (its verified chunks are kept)", what)
                    raise Stopped()
        finally:
            if view is not None:
                view.stop(last.get("p") if "result" in outcome else None)
            self.status.state = previous
        if "error" in outcome:
            raise outcome["error"]
        result = outcome["result"]
        if result.fetched:
            log.info("fetched %s: %d chunks from %d seeder(s), %d kept from before", what, result.fetched,
                     len(result.by_seeder), result.reused)
        return result

    # -- seeding and reporting ------------------------------------------------------------------

    def start_seeding(self, dht: Any, client: Any) -> None:
        """After the join: report bad seeders through ``client`` (those seen so far too), and seed the
        files held unless ``--no-seed``."""
        from peer.datasync import SeedError, Seeder, SeederOptions

        self._dht, self._client = dht, client
        with self._lock:
            pending, self._pending_reports = self._pending_reports, []
        for peer_id, what in pending:
            self._report(peer_id, what)
        if not self.opts.seed or self.dataset is None:
            return
        if self.dataset.manifest.get("format") != 2:
            log.info("not seeding %s: its manifest is format 1 (re-run 'hivepath data prepare' to seed it)",
                     self.dataset.dir)
            return
        try:
            # files at their final names were verified (checked at start-up, or fetched chunk by chunk)
            self.seeder = Seeder(dht, self.dataset.dir, SeederOptions(verify=False)).start()
        except SeedError as e:
            log.warning("not seeding: %s", e)

    def seeded_paths(self) -> Optional[list[str]]:
        """The paths whose shards this process seeds (for heartbeats); None when it does not seed."""
        return self.seeder.held_paths() if self.seeder is not None else None

    def _report(self, peer_id: str, what: str) -> None:
        client = self._client
        if client is None:
            with self._lock:
                self._pending_reports.append((peer_id, what))
            return
        m = _CHUNK_OF.search(what)
        file = m.group(2) if m else "manifest.json"
        client.report_seeder_later(peer_id, self.manifest_hash, file, what)

    def close(self) -> None:
        """Stop seeding (a background fetch ends with the DHT it runs on)."""
        if self.seeder is not None:
            self.seeder.close()
            self.seeder = None
