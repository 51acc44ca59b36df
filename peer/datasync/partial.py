"""A file being fetched, on disk so that a fetch survives a crash or Ctrl-C without fetching again.

For ``OUT/{name}`` the fetcher writes under ``OUT/.fetch/`` (:data:`STATE_DIR`):

- ``{name}.part``: the file's bytes, each verified chunk written at its offset (holes elsewhere);
- ``{name}.done``: the indices of the chunks written and verified, 4 bytes each (little-endian),
  appended only after the chunk's bytes were written.

On resume (:meth:`PartialFile.open`) every index in ``.done`` is checked again against the
manifest's hash of that chunk as read back from ``.part`` (a crash between the two writes, or a
torn append, costs that chunk only). When every chunk is in, :meth:`PartialFile.finish` checks the
whole file's sha256, syncs it and renames it to ``OUT/{name}``: a file at its final name is always
whole and verified, and nothing under ``.fetch`` looks like a dataset file.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from models.durable import atomic_write_bytes, fsync_dir
from models.manifest import FileLayout

__all__ = ["PartialFile", "STATE_DIR"]

STATE_DIR = ".fetch"
"""The directory in a fetch's output that holds partial files (and the fetcher's lock)."""

_INDEX_BYTES = 4


class PartialFile:
    """One file of a fetch (see the module docstring). ``root``: the fetch's output directory."""

    def __init__(self, root: Path, layout: FileLayout):
        self.layout = layout
        self.dest = Path(root) / layout.name
        self.part = Path(root) / STATE_DIR / f"{layout.name}.part"
        self.log = Path(root) / STATE_DIR / f"{layout.name}.done"
        self.verified: set[int] = set()
        self._fd = -1
        self._log_fd = -1

    def open(self) -> set[int]:
        """Open (or create) the partial file; the indices of the chunks already verified."""
        self.part.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.part, os.O_RDWR | os.O_CREAT, 0o644)
        recorded = self._recorded()
        self.verified = {i for i in recorded if self._matches(i)}
        if self.verified != recorded or (self.log.exists() and self.log.stat().st_size % _INDEX_BYTES):
            self._rewrite_log()
        self._log_fd = os.open(self.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        return set(self.verified)

    def _recorded(self) -> set[int]:
        try:
            raw = self.log.read_bytes()
        except FileNotFoundError:
            return set()
        whole = len(raw) - len(raw) % _INDEX_BYTES
        found = {int.from_bytes(raw[i:i + _INDEX_BYTES], "little") for i in range(0, whole, _INDEX_BYTES)}
        return {i for i in found if i < self.layout.n_chunks}

    def _matches(self, index: int) -> bool:
        offset, length = self.layout.span(index)
        return self.layout.check(index, os.pread(self._fd, length, offset))

    def _rewrite_log(self) -> None:
        atomic_write_bytes(self.log, b"".join(i.to_bytes(_INDEX_BYTES, "little") for i in sorted(self.verified)),
                           temp_name=self.log.name + ".tmp")

    @property
    def missing(self) -> list[int]:
        return [i for i in range(self.layout.n_chunks) if i not in self.verified]

    @property
    def complete(self) -> bool:
        return len(self.verified) == self.layout.n_chunks

    def write(self, index: int, data: bytes) -> None:
        """Write a chunk the caller verified, then record it. An ``OSError`` (a full disk) leaves it unrecorded."""
        offset, _ = self.layout.span(index)
        written = os.pwrite(self._fd, data, offset)
        if written != len(data):
            raise OSError(28, f"wrote {written} of {len(data)} bytes")  # ENOSPC: a short write is a full disk
        os.write(self._log_fd, index.to_bytes(_INDEX_BYTES, "little"))
        self.verified.add(index)

    def finish(self) -> None:
        """Check the whole file, sync it and rename it to its final name; remove the partial state."""
        os.ftruncate(self._fd, self.layout.size)  # a file whose last chunks were written first has no holes past them
        os.fsync(self._fd)
        h = hashlib.sha256()
        with open(self.part, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        if h.hexdigest() != self.layout.sha256:  # every chunk matched, so only a manifest at odds with itself
            raise ValueError(f"{self.layout.name}: every chunk matches the manifest but the whole file does not")
        self.close()
        self.dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(self.part, self.dest)  # the file itself is synced above
        fsync_dir(self.dest.parent)
        self.log.unlink(missing_ok=True)

    def close(self) -> None:
        for fd in (self._fd, self._log_fd):
            if fd >= 0:
                os.close(fd)
        self._fd = self._log_fd = -1
