"""A prepared dataset's manifest: its hash, its format, and the per-chunk layout of its files.

The manifest (``manifest.json``, written by :func:`models.data.prepare`) names the dataset: its
**hash** is the first 16 hex digits of the sha256 of its canonical JSON (:func:`manifest_hash`), so
a manifest whose hash a run pins can be fetched from anyone and checked.

Formats:

- **1**: the sha256 of every file (``files``). Still read and trained from, but it cannot be served
  or fetched over the network: a bad byte in a gigabyte shard would only be caught once the whole
  file arrived, so :func:`layouts` refuses it, saying to re-run ``hivepath data prepare``.
- **2** (written now): also ``chunk_size`` and ``chunks``, per file its size in bytes and the sha256
  of each ``chunk_size`` slice (the last one shorter), so a fetcher checks every chunk on arrival and
  knows which seeder sent a bad one (:class:`FileLayout`).

A shard file is ``shards/{path}.{split}.{tokens|docs}`` (path written ``0-1``); every other file
(``router.json``, ``tokenizer.json``) is needed by every path (:func:`path_files`). Stdlib only: the
networking code reads manifests without numpy.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from models import strict_json
from models.errors import DataError

__all__ = ["MANIFEST_FILE", "FORMAT", "READABLE_FORMATS", "CHUNK_SIZE", "MAX_CHUNK_SIZE", "SPLITS", "FileLayout",
           "ManifestMismatch", "manifest_hash", "path_name", "chunk_table", "layouts", "path_files",
           "parse_manifest", "sha256_file", "shard_files"]

MANIFEST_FILE = "manifest.json"
FORMAT = 2
"""The manifest format :func:`models.data.prepare` writes."""
READABLE_FORMATS = (1, 2)
"""Formats :class:`models.data.Dataset` opens and trains from."""
CHUNK_SIZE = 1 << 20
"""Default bytes per hashed chunk: a bad chunk costs one MiB to fetch again."""
MAX_CHUNK_SIZE = 16 << 20
"""The largest chunk a manifest may declare (bounds what a seeder sends in one reply)."""
SPLITS = ("train", "validation")
_SHARD_KINDS = ("tokens", "docs")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_REPREPARE = "re-run 'hivepath data prepare' to write a format-2 manifest with per-chunk hashes"


class ManifestMismatch(DataError):
    """A manifest is not the one expected (its hash differs)."""

    exit_code = 4


def manifest_hash(manifest: dict) -> str:
    """The dataset's name: 16 hex digits of the sha256 of the manifest's canonical JSON."""
    blob = strict_json.dumps(manifest, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def path_name(path: Sequence[int]) -> str:
    """A lattice path as written in file names: ``(0, 1)`` -> ``"0-1"``."""
    return "-".join(str(int(i)) for i in path)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def chunk_table(path: Path, chunk_size: int) -> dict:
    """``{"size": bytes, "sha256": [hash of each chunk_size slice]}`` of one file (an empty file has no chunks)."""
    hashes, size = [], 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(chunk_size), b""):
            hashes.append(hashlib.sha256(block).hexdigest())
            size += len(block)
    return {"size": size, "sha256": hashes}


@dataclass(frozen=True)
class FileLayout:
    """One file of a format-2 dataset as the network carries it: its size and per-chunk hashes."""

    name: str
    """Path relative to the dataset directory, e.g. ``shards/0-1.train.tokens``."""
    size: int
    """Bytes of the whole file."""
    sha256: str
    """sha256 of the whole file."""
    chunk_size: int
    """Bytes per chunk (the last chunk may be shorter)."""
    chunks: tuple[str, ...]
    """sha256 of each chunk, in order."""

    @property
    def n_chunks(self) -> int:
        return len(self.chunks)

    def span(self, index: int) -> tuple[int, int]:
        """``(offset, length)`` of chunk ``index`` in the file."""
        if not 0 <= index < self.n_chunks:
            raise IndexError(f"{self.name} has {self.n_chunks} chunks, not {index + 1}")
        offset = index * self.chunk_size
        return offset, min(self.chunk_size, self.size - offset)

    def check(self, index: int, data: bytes) -> bool:
        """True when ``data`` is exactly chunk ``index``."""
        return len(data) == self.span(index)[1] and hashlib.sha256(data).hexdigest() == self.chunks[index]


def layouts(manifest: dict) -> dict[str, FileLayout]:
    """Every file of a format-2 manifest by name; a :class:`DataError` for format 1 (re-prepare) or a
    malformed table (a manifest fetched from the network is checked here before anything is trusted)."""
    fmt = manifest.get("format")
    if fmt == 1:
        raise DataError(f"the dataset's manifest is format 1, without per-chunk hashes, so it cannot be served or "
                        f"fetched; {_REPREPARE}")
    if fmt != FORMAT:
        raise DataError(f"the dataset's manifest is format {fmt!r}, which this hivepath cannot serve or fetch; "
                        f"{_REPREPARE}")
    size, files, table = manifest.get("chunk_size"), manifest.get("files"), manifest.get("chunks")
    if not isinstance(size, int) or isinstance(size, bool) or not 1 <= size <= MAX_CHUNK_SIZE:
        raise DataError(f"the manifest's chunk_size {size!r} is not an integer from 1 to {MAX_CHUNK_SIZE}")
    if not isinstance(files, dict) or not isinstance(table, dict) or set(files) != set(table):
        raise DataError("the manifest's files and chunks tables differ; " + _REPREPARE)
    out = {}
    for name, entry in sorted(table.items()):
        out[name] = _layout(name, files[name], entry, size)
    return out


def _layout(name: str, digest: object, entry: object, chunk_size: int) -> FileLayout:
    bad = DataError(f"the manifest's entry for {name!r} is malformed; {_REPREPARE}")
    if not _safe_name(name) or not isinstance(digest, str) or not _HEX64.match(digest) or not isinstance(entry, dict):
        raise bad
    n, hashes = entry.get("size"), entry.get("sha256")
    if not isinstance(n, int) or isinstance(n, bool) or n < 0 or not isinstance(hashes, list):
        raise bad
    if len(hashes) != -(-n // chunk_size) or not all(isinstance(h, str) and _HEX64.match(h) for h in hashes):
        raise bad
    return FileLayout(name, n, digest, chunk_size, tuple(hashes))


def _safe_name(name: str) -> bool:
    """A relative path inside the dataset directory: no ``..``, no absolute path, no odd characters."""
    parts = name.split("/")
    return (bool(name) and re.fullmatch(r"[A-Za-z0-9._/-]+", name) is not None and not name.startswith("/")
            and all(p not in ("", ".", "..") for p in parts) and name != MANIFEST_FILE)


def path_files(manifest: dict, paths: Iterable[Sequence[int]], splits: Sequence[str] = SPLITS) -> list[str]:
    """The files a peer training ``paths`` needs: every file that is not a shard (router, tokenizer),
    and the shards of those paths for ``splits`` (train and validation by default). A path not in the
    manifest is a :class:`DataError`."""
    names = manifest.get("files", {})
    wanted = []
    for path in paths:
        p = path_name(path)
        if p not in manifest.get("shards", {}):
            lattice = manifest.get("lattice", {})
            raise DataError(f"path {p} is not in this dataset (a {lattice.get('levels')}x"
                            f"{lattice.get('modules_per_level')} lattice)")
        wanted += [f"shards/{p}.{s}.{k}" for s in splits for k in _SHARD_KINDS]
    meta = [n for n in names if not n.startswith("shards/")]
    return sorted(set(meta)) + [w for w in dict.fromkeys(wanted) if w in names]


def shard_files(path: Sequence[int], splits: Sequence[str] = SPLITS) -> list[str]:
    """The file names of one path's shards for ``splits``."""
    p = path_name(path)
    return [f"shards/{p}.{s}.{k}" for s in splits for k in _SHARD_KINDS]


def parse_manifest(blob: bytes, expected_hash: str) -> dict:
    """The manifest in ``blob`` if its hash is ``expected_hash``; :class:`ManifestMismatch` otherwise."""
    try:
        manifest = json.loads(blob.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise ManifestMismatch(f"the manifest received for {expected_hash} is not JSON") from None
    if not isinstance(manifest, dict):
        raise ManifestMismatch(f"the manifest received for {expected_hash} is not a JSON object")
    got = manifest_hash(manifest)
    if got != expected_hash:
        raise ManifestMismatch(f"the manifest received has hash {got}, not the expected {expected_hash}")
    return manifest
