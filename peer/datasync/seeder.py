"""Seeding: serve the files of a prepared dataset to fetchers, chunk by chunk, and say so on the DHT.

A :class:`Seeder` owns one dataset directory (format 2, :mod:`models.manifest`). At start it finds the
files it holds whole (size, and with ``verify`` the sha256 of the manifest; a peer that fetched a
dataset holds only its paths' shards), registers the ``Data.Chunk`` handler
(:mod:`peer.datasync.protocol`) on a replica of this process's p2p daemon, and stores its
:class:`~peer.datasync.records.SeederRecord` under :func:`~peer.datasync.records.seeders_key`,
refreshed every third of its TTL until :meth:`Seeder.close`.

What it answers (:meth:`Seeder.answer`): chunk ``i`` of a file the manifest names and it holds, or of
``manifest.json`` itself (in :data:`~peer.datasync.protocol.MANIFEST_CHUNK` slices); anything else
(another dataset, a name not in the manifest, a file it lacks, an index past the end) is refused
with a reason. Requests are read with a byte limit and a malformed one gets one error frame
(``peer.network.frames.serve``). Chunks are read from disk per request and not hashed again: a file
that rots on disk after start-up is served as it is, and every fetcher catches it (each chunk is
checked against the manifest on arrival) and drops this seeder.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

from models.errors import DataError
from models.manifest import MANIFEST_FILE, FileLayout, layouts, manifest_hash, sha256_file, shard_files
from peer.datasync.errors import SeedError
from peer.network.dht import own_p2p
from peer.datasync.protocol import CHUNK, MANIFEST_CHUNK, MAX_REQUEST_BYTES, ChunkReply, ChunkRequest, data_prefix, linger
from peer.datasync.records import RECORD_TTL, SeederRecord, seeder_value, seeders_key
from peer.network import refresh_until, unwrap_dht
from peer.network.records import announce_within
from peer.network.records import STORE_TIMEOUT
from peer.network.frames import read_message, serve
from protos import versions

__all__ = ["Seeder", "SeederOptions", "read_local_manifest"]

log = logging.getLogger(__name__)

LINGER = 30.0
"""Seconds a handler waits for the fetcher to close the stream after the chunk was written."""


@dataclass(frozen=True)
class SeederOptions:
    """How a seeder checks its files and announces them."""

    verify: bool = True
    """Hash every file at start and serve only those matching the manifest (False: trust sizes, e.g.
    files this process has just fetched and verified)."""
    record_ttl: float = RECORD_TTL
    """Seconds the DHT record lives unless refreshed (it is refreshed every third of this)."""
    startup_timeout: float = 30.0
    """Seconds to register the handler on the p2p daemon."""
    store_timeout: float = STORE_TIMEOUT
    """Seconds one store of our record may take before that announcement is given up (and retried)."""


def read_local_manifest(directory: Path) -> tuple[bytes, dict]:
    """The raw bytes and the parsed manifest of a dataset directory; a :class:`SeedError` if none."""
    path = Path(directory) / MANIFEST_FILE
    try:
        blob = path.read_bytes()
        manifest = json.loads(blob)
    except FileNotFoundError:
        raise SeedError(f"{directory} is not a prepared dataset (no {MANIFEST_FILE}); run 'hivepath data prepare'") from None
    except (OSError, ValueError) as e:
        raise SeedError(f"{path} is unreadable ({e}); run 'hivepath data prepare' again") from None
    if not isinstance(manifest, dict):
        raise SeedError(f"{path} is not a manifest; run 'hivepath data prepare' again")
    return blob, manifest


class Seeder:
    """Serves one dataset directory's files over this process's p2p daemon (see the module docstring).

    ``dht``: this process's DHT (a :class:`peer.network.PeerDHT` or hivemind's ``DHT``).
    """

    def __init__(self, dht: Any, directory: Union[str, Path], options: SeederOptions = SeederOptions()):
        self.dht = unwrap_dht(dht)
        self.peer_id: str = self.dht.peer_id.to_base58()
        self.dir = Path(directory)
        self.options = options
        self.manifest_bytes, self.manifest = read_local_manifest(self.dir)
        self.manifest_hash = manifest_hash(self.manifest)
        try:
            self.layouts: dict[str, FileLayout] = layouts(self.manifest)
        except DataError as e:
            raise SeedError(f"cannot seed {self.dir}: {e}") from None
        self.names = sorted(self.layouts)
        self.held: frozenset[str] = frozenset()
        self.served: Counter[tuple[str, int]] = Counter()
        """Chunks sent so far, per (file, chunk index)."""
        self.refused = 0
        """Well-formed requests refused so far."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="data-seeder", daemon=True)
        self._stopping = threading.Event()
        self._announcer: Optional[threading.Thread] = None
        self._p2p: Any = None

    # -- life cycle -----------------------------------------------------------------------------

    def start(self) -> "Seeder":
        """Find the files held, register the handler, announce, and keep announcing."""
        self.held = frozenset(self.scan())
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._register(), self._loop).result(self.options.startup_timeout)
        self.announce()
        self._announcer = threading.Thread(target=self._announce_loop, name="data-announce", daemon=True)
        self._announcer.start()
        log.info("seeding dataset %s: %d of %d files from %s", self.manifest_hash, len(self.held), len(self.names),
                 self.dir)
        return self

    async def _register(self) -> None:
        self._p2p = await own_p2p(self.dht)
        await serve(self._p2p, data_prefix(self.manifest_hash), CHUNK, self._handle)

    def close(self) -> None:
        """Stop announcing and serving (the record expires within its TTL)."""
        self._stopping.set()
        if self._loop.is_running():
            try:
                asyncio.run_coroutine_threadsafe(self._p2p.shutdown(), self._loop).result(5.0)
            except Exception as e:  # the daemon may be gone already
                log.debug("stopping the seeder's P2P handle: %r", e)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
        if self._announcer is not None:
            self._announcer.join(timeout=5)

    def __enter__(self) -> "Seeder":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- what it holds ----------------------------------------------------------------------------

    def scan(self) -> set[str]:
        """The manifest's files that are whole on disk (and match their sha256 with ``verify``)."""
        held = set()
        for name, layout in self.layouts.items():
            path = self.dir / name
            if not path.is_file() or path.stat().st_size != layout.size:
                continue
            if self.options.verify and sha256_file(path) != layout.sha256:
                log.warning("not seeding %s: it does not match the manifest (modified or corrupt)", path)
                continue
            held.add(name)
        return held

    def refresh(self) -> None:
        """Look at the directory again (files fetched since) and announce what is held now."""
        self.held = frozenset(self.scan())
        self.announce()

    def add(self, *names: str) -> None:
        """Serve ``names`` too (files of the manifest this process has just put in place, verified) and
        announce at once: a fetching peer seeds each file as soon as it completes."""
        new = frozenset(n for n in names if n in self.layouts) - self.held
        if new:
            self.held = self.held | new
            self.announce()

    def drop(self, *names: str) -> None:
        """Stop serving ``names`` (evicted from disk) and announce it."""
        gone = self.held & frozenset(names)
        if gone:
            self.held = self.held - gone
            self.announce()

    def held_paths(self) -> list[str]:
        """The paths (written ``0-1``) whose train and validation shards this seeder serves whole."""
        held, out = self.held, []
        for name in sorted(self.manifest.get("shards", {})):
            files = [f for f in shard_files(name.split("-")) if f in self.layouts]
            if files and all(f in held for f in files):
                out.append(name)
        return out

    def record(self) -> SeederRecord:
        return SeederRecord.of(self.names, set(self.held))

    def announce(self) -> bool:
        """Store (or refresh) our record on the DHT; False, logged, when the store failed or took too long."""
        return announce_within(self.dht, seeders_key(self.manifest_hash), seeder_value(self.record()),
                               self.options.record_ttl, self.peer_id, f"dataset {self.manifest_hash}",
                               self.options.store_timeout)

    def _announce_loop(self) -> None:
        refresh_until(self._stopping, self.options.record_ttl / 3, self.announce)

    # -- serving --------------------------------------------------------------------------------

    async def _handle(self, stream_info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        from hivemind.p2p import P2P

        request = await read_message(reader, ChunkRequest, MAX_REQUEST_BYTES)
        if request is None:
            return
        reply, data = await asyncio.get_running_loop().run_in_executor(None, self.answer, request)
        await P2P.send_protobuf(reply, writer)
        await P2P.send_raw_data(data, writer)
        await linger(reader, LINGER)

    def answer(self, request: ChunkRequest) -> tuple[ChunkReply, bytes]:
        """The reply to one request and the chunk's bytes (empty when refused)."""
        problem, data, size = self._read(request)
        if problem:
            self.refused += 1
            log.debug("refused chunk %d of %r: %s", request.index, request.file[:80], problem)
            return ChunkReply(ok=False, error=problem), b""
        self.served[(request.file, int(request.index))] += 1
        return ChunkReply(ok=True, payload_len=len(data), file_size=size), data

    def _read(self, request: ChunkRequest) -> tuple[str, bytes, int]:
        name, index = request.file, int(request.index)
        other_major = versions.refusal("data", request.protocol, who="the fetcher", us="this seeder")
        if other_major:
            return other_major, b"", 0
        if request.manifest_hash != self.manifest_hash:
            return f"this seeder serves dataset {self.manifest_hash}, not {request.manifest_hash[:64]}", b"", 0
        if name == MANIFEST_FILE:
            size = len(self.manifest_bytes)
            if index * MANIFEST_CHUNK >= max(size, 1):
                return f"chunk {index} is past the end of {MANIFEST_FILE}", b"", 0
            return "", self.manifest_bytes[index * MANIFEST_CHUNK:(index + 1) * MANIFEST_CHUNK], size
        layout = self.layouts.get(name)
        if layout is None:
            return f"{name[:80]!r} is not a file of dataset {self.manifest_hash}", b"", 0
        if name not in self.held:
            return f"this seeder does not hold {name}", b"", 0
        if index >= layout.n_chunks:
            return f"{name} has {layout.n_chunks} chunks, not {index + 1}", b"", 0
        offset, length = layout.span(index)
        try:
            with open(self.dir / name, "rb") as f:
                f.seek(offset)
                data = f.read(length)
        except OSError as e:
            return f"cannot read {name}: {e.strerror}", b"", 0
        if len(data) != length:
            return f"{name} changed on this seeder's disk", b"", 0
        return "", data, layout.size
