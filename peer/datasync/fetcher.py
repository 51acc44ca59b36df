"""Fetching: the files of some paths of a dataset, from its seeders, every chunk verified.

:func:`fetch` (or :func:`fetch_async` on a loop that has a p2p handle) fills a directory that
:class:`models.data.Dataset` opens and trains the wanted paths from:

1. **The manifest**, from any seeder (:func:`fetch_manifest`), accepted only if its hash is the
   expected manifest hash (:func:`models.manifest.parse_manifest`); a seeder sending another is
   reported and dropped. It is kept in ``OUT/.fetch/`` until the end, so a resumed fetch does not ask again.
2. **The files** of :func:`models.manifest.path_files`: router and tokenizer, then each path's train
   and validation shards, chunk by chunk (:class:`peer.datasync.fetch_job.FetchJob`) from every seeder
   that announces the file (:mod:`peer.datasync.records`, :class:`peer.datasync.seeder_swarm.SeederSwarm`),
   up to :attr:`~peer.datasync.fetch_job.FetchOptions.per_seeder` requests in flight to each and
   :attr:`~peer.datasync.fetch_job.FetchOptions.parallel` in all. Each chunk is checked against the
   manifest's hash before it is written (:class:`peer.datasync.partial.PartialFile`); a seeder that sends
   bad bytes is banned for the rest of the fetch and reported (``on_bad_seeder``, so the caller can tell
   the coordinator) and the chunk is asked of another. A seeder that fails or refuses rests a while
   (doubling) and is asked again.
3. **Finishing**: a whole, verified file is renamed into place; ``manifest.json`` is written last,
   when every wanted file is in place, so a directory with a manifest is a dataset for those paths.

Interrupted (a crash, Ctrl-C), a fetch keeps its verified chunks and the next one with the same output
asks only for the rest. Errors, one line each: no seeder for a file within
:attr:`~peer.datasync.fetch_job.FetchOptions.no_seeder_timeout` (:class:`NoSeeder`, naming the file and
the seeders tried), a manifest that is not the expected one (:class:`ManifestMismatch`), a full disk
(:class:`DiskFull`; checked before starting too), an output directory that holds something else or
another fetch.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import shutil
import time
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence, Union

from models.durable import atomic_write_bytes
from models.errors import DataError
from models.manifest import MANIFEST_FILE, SPLITS, layouts, parse_manifest, path_files
from models.manifest import manifest_hash as hash_of
from peer.datasync.errors import ManifestMismatch, NoSeeder
from peer.datasync.fetch_job import (FetchJob, FetchOptions, FetchResult, FileCallback, ProgressCallback,
                                     raise_no_room)
from peer.datasync.partial import STATE_DIR
from peer.network.dht import own_p2p
from peer.datasync.protocol import MANIFEST_CHUNK, MAX_MANIFEST_BYTES, request_chunk
from peer.datasync.seeder_swarm import BadSeederCallback, SeederSwarm

__all__ = ["fetch", "fetch_async", "fetch_manifest"]

log = logging.getLogger(__name__)


async def fetch_manifest(dht: Any, p2p: Any, manifest_hash: str, options: FetchOptions = FetchOptions(),
                         on_bad_seeder: Optional[BadSeederCallback] = None,
                         swarm: Optional[SeederSwarm] = None) -> tuple[bytes, dict]:
    """The raw bytes and the parsed manifest of dataset ``manifest_hash``, from any seeder, verified."""
    swarm = swarm or SeederSwarm(dht, manifest_hash, p2p.peer_id.to_base58(), on_bad_seeder)
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
    (:func:`peer.network.dht.own_p2p`; blocks)."""

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
        swarm = SeederSwarm(dht, manifest_hash, p2p.peer_id.to_base58(), on_bad_seeder, exclude)
        blob, manifest, requested = await _manifest(dht, p2p, out, manifest_hash, options, on_bad_seeder, swarm)
        try:
            table = layouts(manifest)
        except DataError as e:
            raise DataError(f"dataset {manifest_hash} cannot be fetched: {e}") from None
        wanted = path_files(manifest, [tuple(p) for p in paths], splits)
        job = FetchJob(p2p, out, manifest_hash, sorted(table), [table[n] for n in wanted], swarm, options, on_progress,
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
                    on_bad: Optional[BadSeederCallback], swarm: SeederSwarm) -> tuple[bytes, dict, int]:
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
        raise_no_room(e, out, path.name, 0)
        raise
