"""Fetching: the files of some paths of a dataset, from its seeders, every chunk verified.

:func:`fetch` (or :func:`fetch_async` on a loop that has a p2p handle) fills a directory that
:class:`models.data.Dataset` opens and trains the wanted paths from:

1. **The manifest**, from any seeder (:func:`fetch_manifest`), accepted only if its hash is the
   expected manifest hash (:func:`models.manifest.parse_manifest`); a seeder sending another is
   reported and dropped. It is kept in ``OUT/.fetch/`` until the end, so a resumed fetch does not ask again.
2. **The files** of :func:`models.manifest.path_files`: router and tokenizer, then each path's train
   and validation shards, chunk by chunk from every seeder that announces the file
   (:mod:`peer.datasync.records`), up to :attr:`FetchOptions.per_seeder` requests in flight to each and
   :attr:`FetchOptions.parallel` in all. Each chunk is checked against the manifest's hash before it is
   written (:class:`peer.datasync.partial.PartialFile`); a seeder that sends bad bytes is banned for the
   rest of the fetch and reported (``on_bad_seeder``, so the caller can tell the coordinator) and the
   chunk is asked of another. A seeder that fails or refuses rests a while (doubling) and is asked again.
3. **Finishing**: a whole, verified file is renamed into place; ``manifest.json`` is written last,
   when every wanted file is in place, so a directory with a manifest is a dataset for those paths.

Interrupted (a crash, Ctrl-C), a fetch keeps its verified chunks and the next one with the same output
asks only for the rest. Errors, one line each: no seeder for a file within
:attr:`FetchOptions.no_seeder_timeout` (:class:`NoSeeder`, naming the file and the seeders tried), a
manifest that is not the expected one (:class:`ManifestMismatch`), a full disk (:class:`DiskFull`;
checked before starting too), an output directory that holds something else or another fetch.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import logging
import shutil
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence, Union

from models.durable import atomic_write_bytes
from models.errors import DataError
from models.manifest import MANIFEST_FILE, SPLITS, FileLayout, layouts, parse_manifest, path_files
from models.manifest import manifest_hash as hash_of
from peer.datasync.errors import DiskFull, ManifestMismatch, NoSeeder
from peer.datasync.partial import STATE_DIR, PartialFile
from peer.datasync.protocol import own_p2p, MANIFEST_CHUNK, MAX_MANIFEST_BYTES, request_chunk
from peer.datasync.records import SeederRecord, seeders_from_value, seeders_key
from peer.network import unwrap_dht

__all__ = ["FetchOptions", "FetchProgress", "FetchResult", "fetch", "fetch_async", "fetch_manifest", "find_seeders"]

log = logging.getLogger(__name__)

_NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
"""Write errors that mean the disk (or the process's file size limit) has no room."""
_MAX_REST = 30.0


@dataclass(frozen=True)
class FetchOptions:
    """How a fetch waits, and how much it asks at once."""

    no_seeder_timeout: float = 60.0
    """Seconds a file (or the manifest) may wait with no seeder able to send it before the fetch fails."""
    request_timeout: float = 30.0
    """Seconds one chunk request may take."""
    parallel: int = 16
    """Chunk requests in flight at once, over all seeders."""
    per_seeder: int = 4
    """Chunk requests in flight to one seeder."""
    refresh_interval: float = 2.0
    """Seconds between looks at the DHT for seeders while some file has none."""
    retry_after: float = 0.5
    """Seconds a seeder rests after a failed request (doubled per failure in a row, at most 30)."""


@dataclass
class FetchProgress:
    """Where a fetch stands (handed to ``on_progress`` after every chunk)."""

    total_bytes: int
    """Bytes of every wanted file."""
    done_bytes: int
    """Bytes verified so far, those found on disk from an earlier fetch included."""
    fetched_bytes: int
    """Bytes received and verified by this fetch."""
    files_total: int
    files_done: int
    seeders: int
    """Seeders known and not banned."""


@dataclass
class FetchResult:
    """What a fetch did."""

    directory: Path
    manifest_hash: str
    files: list[str]
    """The wanted files, all in place now."""
    requested: int = 0
    """Chunk requests sent (the manifest's included)."""
    fetched: int = 0
    """Chunks received and verified."""
    reused: int = 0
    """Chunks (and whole files, by their chunk counts) found verified from an earlier fetch."""
    bad_seeders: set[str] = field(default_factory=set)
    by_seeder: Counter = field(default_factory=Counter)
    """Verified chunks per seeder."""


BadSeederCallback = Callable[[str, str], None]
"""``(peer_id, what it did)``: a seeder sent bytes that do not match the manifest."""
ProgressCallback = Callable[[FetchProgress], None]
FileCallback = Callable[[str], None]
"""``(file name)``: a wanted file is whole, verified and in place (a seeder may announce it now)."""


async def find_seeders(dht: Any, manifest_hash: str) -> dict[str, SeederRecord]:
    """The valid seeder records of a dataset on the DHT, by peer id."""
    found = await unwrap_dht(dht).get(seeders_key(manifest_hash), latest=True, return_future=True)
    return seeders_from_value(found)


class _Seeder:
    """A fetcher's view of one seeder."""

    def __init__(self, peer_id: str):
        self.peer_id = peer_id
        self.holds: set[str] = set()
        self.inflight = 0
        self.failures = 0
        self.rest_until = 0.0
        self.banned = False

    def ready(self, now: float, limit: int) -> bool:
        return not self.banned and self.inflight < limit and now >= self.rest_until

    def failed(self, now: float, retry_after: float) -> None:
        self.failures += 1
        self.rest_until = now + min(_MAX_REST, retry_after * 2 ** (self.failures - 1))


class _Swarm:
    """The seeders of one dataset as this fetch knows them; refreshed from the DHT."""

    def __init__(self, dht: Any, manifest_hash: str, own_peer_id: str, on_bad: Optional[BadSeederCallback],
                 exclude: Iterable[str] = ()):
        self.dht, self.manifest_hash, self.own = dht, manifest_hash, own_peer_id
        self.exclude = frozenset(exclude)
        self.seeders: dict[str, _Seeder] = {}
        self.asked: dict[str, set[str]] = {}
        """file -> seeders asked for a chunk of it (for the error naming how many were tried)."""
        self.on_bad = on_bad
        self.last_refresh = float("-inf")

    async def refresh(self, names: Optional[Sequence[str]]) -> None:
        self.last_refresh = time.monotonic()
        try:
            found = await find_seeders(self.dht, self.manifest_hash)
        except Exception as e:  # the DHT may be busy: the next look may find them
            log.debug("looking for seeders failed: %r", e)
            return
        for peer, record in found.items():
            if peer == self.own or peer in self.exclude:
                continue
            s = self.seeders.setdefault(peer, _Seeder(peer))
            s.holds = record.holds(names) if names is not None else set()

    def live(self) -> list[_Seeder]:
        return [s for s in self.seeders.values() if not s.banned]

    def pick(self, name: str, now: float, limit: int, avoid: set[str]) -> Optional[_Seeder]:
        """The least busy ready seeder holding ``name``, preferring those not in ``avoid``."""
        ready = [s for s in self.seeders.values() if name in s.holds and s.ready(now, limit)]
        fresh = [s for s in ready if s.peer_id not in avoid] or ready
        return min(fresh, key=lambda s: (s.inflight, s.failures, s.peer_id), default=None)

    def ban(self, seeder: _Seeder, what: str) -> None:
        seeder.banned = True
        log.warning("dropping seeder %s: %s", seeder.peer_id, what)
        if self.on_bad is not None:
            try:
                self.on_bad(seeder.peer_id, what)
            except Exception as e:  # the report is advice: the fetch goes on
                log.warning("reporting seeder %s failed: %r", seeder.peer_id, e)

    def tried(self, name: str) -> str:
        """How many seeders were tried for ``name`` and why none sent it (for :class:`NoSeeder`)."""
        asked = self.asked.get(name, set())
        if not asked:
            return f"0 seeders tried: none of the {len(self.seeders)} seeder(s) found announces it"
        bad = sum(1 for p in asked if self.seeders[p].banned)
        return f"{len(asked)} seeder(s) tried" + (f", {bad} of them sent bad bytes" if bad else ", none answered")


async def fetch_manifest(dht: Any, p2p: Any, manifest_hash: str, options: FetchOptions = FetchOptions(),
                         on_bad_seeder: Optional[BadSeederCallback] = None,
                         swarm: Optional[_Swarm] = None) -> tuple[bytes, dict]:
    """The raw bytes and the parsed manifest of dataset ``manifest_hash``, from any seeder, verified."""
    swarm = swarm or _Swarm(dht, manifest_hash, p2p.peer_id.to_base58(), on_bad_seeder)
    deadline = time.monotonic() + options.no_seeder_timeout
    tried: set[str] = set()
    mismatched: list[str] = []
    while True:
        await swarm.refresh(None)
        for s in [s for s in swarm.live() if s.peer_id not in tried]:
            tried.add(s.peer_id)
            try:
                blob = await _manifest_from(p2p, s.peer_id, manifest_hash, options)
                return blob, parse_manifest(blob, manifest_hash)
            except ManifestMismatch as e:
                mismatched.append(str(e))
                swarm.ban(s, f"sent a manifest that is not {manifest_hash}: {e}")
            except Exception as e:  # this seeder could not send it: ask the next
                log.info("seeder %s did not send the manifest: %r", s.peer_id, e)
        if time.monotonic() >= deadline:
            break
        await asyncio.sleep(min(options.refresh_interval, max(0.0, deadline - time.monotonic())))
    if mismatched and len(mismatched) == len(tried):
        raise ManifestMismatch(f"every seeder of {manifest_hash} sent another manifest ({mismatched[0]}); "
                               "check the manifest hash (hivepath data info DIR on the operator's copy)")
    raise NoSeeder(f"no seeder sent the manifest of dataset {manifest_hash} within {options.no_seeder_timeout:g}s "
                   f"({len(tried)} seeder(s) tried); check the hash and that a seeder is up "
                   "('hivepath data serve DIR' on a machine holding the dataset)")


async def _manifest_from(p2p: Any, peer: str, manifest_hash: str, options: FetchOptions) -> bytes:
    parts, size = [], None
    while size is None or sum(map(len, parts)) < size:
        reply, data = await request_chunk(p2p, peer, manifest_hash, MANIFEST_FILE, len(parts), MANIFEST_CHUNK,
                                          options.request_timeout)
        if not reply.ok:
            raise ConnectionError(reply.error)
        if size is None:
            size = int(reply.file_size)
            if size > MAX_MANIFEST_BYTES:
                raise ManifestMismatch(f"the manifest announced is {size} bytes, more than the {MAX_MANIFEST_BYTES} accepted")
        if not data:
            raise ConnectionError("an empty chunk of the manifest")
        parts.append(data)
    blob = b"".join(parts)
    if len(blob) != size:
        raise ManifestMismatch(f"the manifest sent is {len(blob)} bytes, not the {size} announced")
    return blob


def fetch(dht: Any, manifest_hash: str, paths: Iterable[Sequence[int]], out: Union[str, Path],
          options: FetchOptions = FetchOptions(), on_progress: Optional[ProgressCallback] = None,
          on_bad_seeder: Optional[BadSeederCallback] = None, splits: Sequence[str] = SPLITS,
          on_file: Optional[FileCallback] = None, exclude: Iterable[str] = ()) -> FetchResult:
    """:func:`fetch_async` on a loop of its own, over a P2P handle of its own on ``dht``'s daemon
    (:func:`peer.datasync.protocol.own_p2p`; blocks)."""

    async def run() -> FetchResult:
        p2p = await own_p2p(dht)
        try:
            return await fetch_async(dht, p2p, manifest_hash, paths, out, options, on_progress, on_bad_seeder,
                                     splits, on_file, exclude)
        finally:
            with contextlib.suppress(Exception):
                await p2p.shutdown()

    return asyncio.run(run())


async def fetch_async(dht: Any, p2p: Any, manifest_hash: str, paths: Iterable[Sequence[int]],
                      out: Union[str, Path], options: FetchOptions = FetchOptions(),
                      on_progress: Optional[ProgressCallback] = None,
                      on_bad_seeder: Optional[BadSeederCallback] = None, splits: Sequence[str] = SPLITS,
                      on_file: Optional[FileCallback] = None, exclude: Iterable[str] = ()) -> FetchResult:
    """Fetch ``paths``' files of dataset ``manifest_hash`` into ``out`` (see the module docstring):
    their shards of ``splits`` only (a trainer starts on ``("train",)`` and fetches the validation
    shards next). ``on_file(name)`` hears of each wanted file once it is in place; seeders in
    ``exclude`` (dropped by an earlier fetch) are never asked."""
    out = Path(out)
    _check_output(out, manifest_hash)
    state = out / STATE_DIR
    state.mkdir(parents=True, exist_ok=True)
    with _locked(state / "lock", out):
        swarm = _Swarm(dht, manifest_hash, p2p.peer_id.to_base58(), on_bad_seeder, exclude)
        blob, manifest, requested = await _manifest(dht, p2p, out, manifest_hash, options, on_bad_seeder, swarm)
        try:
            table = layouts(manifest)
        except DataError as e:
            raise DataError(f"dataset {manifest_hash} cannot be fetched: {e}") from None
        wanted = path_files(manifest, [tuple(p) for p in paths], splits)
        job = _Job(p2p, out, manifest_hash, sorted(table), [table[n] for n in wanted], swarm, options, on_progress,
                   on_file)
        job.result.requested += requested
        try:
            await job.run()
        finally:
            job.close()
        _publish(out, blob)
        return job.result


def _check_output(out: Path, expected: str) -> None:
    """Refuse an output that holds another dataset, or files that are neither a dataset nor a fetch."""
    if (out / MANIFEST_FILE).is_file():
        from peer.datasync.seeder import read_local_manifest

        _, there = read_local_manifest(out)
        if hash_of(there) != expected:
            raise DataError(f"{out} holds dataset {hash_of(there)}, not {expected}; pass another --out")
    elif out.is_dir() and any(p.name != STATE_DIR for p in out.iterdir()) and not (out / STATE_DIR).is_dir():
        raise DataError(f"{out} holds files but no dataset; pass an empty or new directory as --out")


@contextlib.contextmanager
def _locked(path: Path, out: Path):
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise DataError(f"another fetch is writing into {out}; wait for it or pass another --out") from None
        yield


async def _manifest(dht: Any, p2p: Any, out: Path, expected: str, options: FetchOptions,
                    on_bad: Optional[BadSeederCallback], swarm: _Swarm) -> tuple[bytes, dict, int]:
    """The manifest: in place, kept by an earlier fetch, or from a seeder (then kept). Returns the
    bytes, the manifest and how many chunk requests it took."""
    for path in (out / MANIFEST_FILE, out / STATE_DIR / MANIFEST_FILE):
        if path.is_file():
            try:
                blob = path.read_bytes()
                return blob, parse_manifest(blob, expected), 0
            except ManifestMismatch:
                path.unlink()  # only the kept copy can get here (_check_output read the one in place)
    blob, manifest = await fetch_manifest(dht, p2p, expected, options, on_bad, swarm)
    _write_atomically(out / STATE_DIR / MANIFEST_FILE, blob, out)
    return blob, manifest, -(-len(blob) // MANIFEST_CHUNK)


def _publish(out: Path, blob: bytes) -> None:
    """Write ``manifest.json`` (every wanted file is in place) and drop the fetch's state."""
    if not (out / MANIFEST_FILE).is_file():
        _write_atomically(out / MANIFEST_FILE, blob, out)
    state = out / STATE_DIR
    (state / MANIFEST_FILE).unlink(missing_ok=True)
    if not any(p.suffix == ".part" for p in state.rglob("*")):
        shutil.rmtree(state, ignore_errors=True)


def _write_atomically(path: Path, data: bytes, out: Path) -> None:
    try:
        atomic_write_bytes(path, data)  # a fresh temporary name: the directory may be another peer's too
    except OSError as e:
        _raise_no_room(e, out, path.name, 0)
        raise


def _raise_no_room(e: OSError, out: Path, name: str, kept: int) -> None:
    if e.errno in _NO_ROOM:
        free = shutil.disk_usage(out).free
        raise DiskFull(f"no room on the disk for {name} in {out} ({free} bytes free); free some space and run the same "
                       f"command again ({kept} verified chunks are kept)") from None


class _Job:
    """The chunks of the wanted files and the requests in flight (see the module docstring)."""

    def __init__(self, p2p: Any, out: Path, manifest_hash: str, all_names: list[str], files: list[FileLayout],
                 swarm: _Swarm, options: FetchOptions, on_progress: Optional[ProgressCallback],
                 on_file: Optional[FileCallback] = None):
        self.p2p, self.out, self.manifest_hash, self.swarm, self.options = p2p, out, manifest_hash, swarm, options
        self.on_progress, self.on_file = on_progress, on_file
        self.all_names = all_names
        """Every file of the manifest, sorted: what the seeders' bitmaps cover."""
        self.files = files
        self.result = FetchResult(out, manifest_hash, [f.name for f in files])
        self.partial: dict[str, PartialFile] = {}
        self.pending: dict[str, deque[int]] = {}
        self.avoid: dict[tuple[str, int], set[str]] = {}
        self.stalled_since: dict[str, float] = {}
        self.tasks: dict[asyncio.Task, tuple[str, int, Any]] = {}
        self.progress = FetchProgress(sum(f.size for f in files), 0, 0, len(files), 0, 0)

    async def run(self) -> None:
        self._open()
        self._check_space()
        self._report()
        while self.pending or self.tasks:
            now = time.monotonic()
            if self._stalled() and now - self.swarm.last_refresh >= self.options.refresh_interval:
                await self.swarm.refresh(self.all_names)
            self._assign(time.monotonic())
            self._check_deadlines(time.monotonic())
            if not self.tasks:
                await asyncio.sleep(self.options.refresh_interval / 4)
                continue
            done, _ = await asyncio.wait(self.tasks, timeout=self.options.refresh_interval,
                                         return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                self._settle(task, *self.tasks.pop(task))

    def _open(self) -> None:
        for layout in self.files:
            dest = self.out / layout.name
            if dest.is_file() and dest.stat().st_size == layout.size:  # renamed into place only when verified
                self.result.reused += layout.n_chunks
                self.progress.done_bytes += layout.size
                self._done_file(layout, kept=True)
                continue
            pf = PartialFile(self.out, layout)
            try:
                kept = pf.open()
            except OSError as e:
                _raise_no_room(e, self.out, layout.name, 0)
                raise
            self.partial[layout.name] = pf
            self.result.reused += len(kept)
            self.progress.done_bytes += sum(layout.span(i)[1] for i in kept)
            if pf.complete:
                self._finish(pf)
            else:
                self.pending[layout.name] = deque(pf.missing)

    def _check_space(self) -> None:
        need = self.progress.total_bytes - self.progress.done_bytes
        free = shutil.disk_usage(self.out).free
        if need > free:
            raise DiskFull(f"the files need {need} more bytes in {self.out} but the disk has {free} free; free some "
                           f"space or pass another --out ({self.result.reused} verified chunks are kept)")

    def _stalled(self) -> bool:
        return not self.swarm.seeders or any(
            not any(name in s.holds and not s.banned for s in self.swarm.seeders.values()) for name in self.pending)

    def _assign(self, now: float) -> None:
        for name in list(self.pending):
            queue = self.pending[name]
            while queue and len(self.tasks) < self.options.parallel:
                index = queue[0]
                seeder = self.swarm.pick(name, now, self.options.per_seeder, self.avoid.get((name, index), set()))
                if seeder is None:
                    if not any(n == name for n, _, _ in self.tasks.values()):
                        self.stalled_since.setdefault(name, now)
                    break
                queue.popleft()
                self.stalled_since.pop(name, None)
                self._start(name, index, seeder)
            if not queue:
                del self.pending[name]

    def _start(self, name: str, index: int, seeder: Any) -> None:
        layout = self.partial[name].layout
        seeder.inflight += 1
        self.swarm.asked.setdefault(name, set()).add(seeder.peer_id)
        self.result.requested += 1
        task = asyncio.ensure_future(request_chunk(self.p2p, seeder.peer_id, self.manifest_hash, name, index,
                                                   layout.span(index)[1], self.options.request_timeout))
        self.tasks[task] = (name, index, seeder)

    def _settle(self, task: asyncio.Task, name: str, index: int, seeder: Any) -> None:
        seeder.inflight -= 1
        pf = self.partial[name]
        now = time.monotonic()
        try:
            reply, data = task.result()
        except Exception as e:  # a timeout, a broken stream, a blob over the limit
            log.debug("chunk %d of %s from %s failed: %r", index, name, seeder.peer_id, e)
            reply, data = None, b""
        if reply is None or not reply.ok:
            if reply is not None and "does not hold" in reply.error:
                seeder.holds.discard(name)
            seeder.failed(now, self.options.retry_after)
            self._requeue(name, index, seeder)
            return
        if not pf.layout.check(index, data):
            self.swarm.ban(seeder, f"sent bad bytes for chunk {index} of {name}")
            self.result.bad_seeders.add(seeder.peer_id)
            self._requeue(name, index, seeder)
            return
        seeder.failures = 0
        try:
            pf.write(index, data)
        except OSError as e:
            _raise_no_room(e, self.out, name, self._kept())
            raise
        self.avoid.pop((name, index), None)
        self.result.fetched += 1
        self.result.by_seeder[seeder.peer_id] += 1
        self.progress.done_bytes += len(data)
        self.progress.fetched_bytes += len(data)
        if pf.complete:
            self._finish(pf)
        self._report()

    def _requeue(self, name: str, index: int, seeder: Any) -> None:
        self.avoid.setdefault((name, index), set()).add(seeder.peer_id)
        self.pending.setdefault(name, deque()).appendleft(index)

    def _finish(self, pf: PartialFile) -> None:
        try:
            pf.finish()
        except OSError as e:
            _raise_no_room(e, self.out, pf.layout.name, self._kept())
            raise
        del self.partial[pf.layout.name]
        self._done_file(pf.layout)

    def _done_file(self, layout: FileLayout, kept: bool = False) -> None:
        self.progress.files_done += 1
        if not kept:
            log.info("fetched %s (%d bytes)", layout.name, layout.size)
        if self.on_file is not None:
            try:
                self.on_file(layout.name)
            except Exception as e:  # announcing is advice: the fetch goes on
                log.warning("announcing %s failed: %r", layout.name, e)

    def _kept(self) -> int:
        return sum(len(pf.verified) for pf in self.partial.values())

    def _check_deadlines(self, now: float) -> None:
        for name, since in self.stalled_since.items():
            if now - since >= self.options.no_seeder_timeout:
                raise NoSeeder(f"no seeder sent {name} within {self.options.no_seeder_timeout:g}s "
                               f"({self.swarm.tried(name)}); the {self._kept()} verified chunks are kept: run the same "
                               f"command again once a seeder of it is up ('hivepath data info --manifest-hash "
                               f"{self.manifest_hash}')")

    def _report(self) -> None:
        self.progress.seeders = len(self.swarm.live())
        if self.on_progress is not None:
            self.on_progress(self.progress)

    def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        for pf in self.partial.values():
            pf.close()
