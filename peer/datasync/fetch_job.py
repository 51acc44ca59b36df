"""``FetchJob``: the chunks of one fetch's wanted files and the requests in flight for them.

Each file is opened as a :class:`peer.datasync.partial.PartialFile` (chunks verified by an earlier fetch
are kept), its missing chunks queued and asked of the seeders :class:`peer.datasync.seeder_swarm.SeederSwarm`
picks, at most :attr:`FetchOptions.parallel` in flight; a chunk is checked against the manifest before
it is written, a whole file renamed into place. Also what a fetch is told (:class:`FetchOptions`) and
what it reports (:class:`FetchProgress`, :class:`FetchResult`). Separate from
:mod:`peer.datasync.fetcher`, which finds the manifest, guards the output directory and publishes the
dataset once this job is done.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import shutil
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from models.manifest import FileLayout
from peer.datasync.errors import DiskFull, NoSeeder
from peer.datasync.partial import PartialFile
from peer.datasync.protocol import request_chunk
from peer.datasync.seeder_swarm import SeederSwarm

__all__ = ["FetchJob", "FetchOptions", "FetchProgress", "FetchResult", "ProgressCallback", "FileCallback",
           "raise_no_room"]

log = logging.getLogger(__name__)

_NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
"""Write errors that mean the disk (or the process's file size limit) has no room."""


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


ProgressCallback = Callable[[FetchProgress], None]
FileCallback = Callable[[str], None]
"""``(file name)``: a wanted file is whole, verified and in place (a seeder may announce it now)."""


def raise_no_room(e: OSError, out: Path, name: str, kept: int) -> None:
    """Raise :class:`DiskFull` (naming ``name``, ``out``'s free bytes and the ``kept`` verified chunks) when
    ``e`` says the disk has no room; else return (the caller re-raises ``e``)."""
    if e.errno in _NO_ROOM:
        free = shutil.disk_usage(out).free
        raise DiskFull(f"no room on the disk for {name} in {out} ({free} bytes free); free some space and run the same "
                       f"command again ({kept} verified chunks are kept)") from None


class FetchJob:
    """The chunks of the wanted files and the requests in flight (see the module docstring)."""

    def __init__(self, p2p: Any, out: Path, manifest_hash: str, all_names: list[str], files: list[FileLayout],
                 swarm: SeederSwarm, options: FetchOptions, on_progress: Optional[ProgressCallback],
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
                raise_no_room(e, self.out, layout.name, 0)
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
            raise_no_room(e, self.out, name, self._kept())
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
            raise_no_room(e, self.out, pf.layout.name, self._kept())
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
