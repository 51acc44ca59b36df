"""Replacing a file atomically and durably: the one way every file hivepath replaces is written.

A machine may vanish mid-write (a spot instance, a full disk, a kill): the new content goes to a
temporary file in the same directory (so the rename stays on one filesystem), which is fsync'd, renamed
onto its name, and the directory fsync'd, so the name holds the old file or the complete new one, never
a torn mix, and the rename itself survives a power loss. On failure the temporary file is removed and
the old file is untouched.

Stdlib only and torch-free: the peer's data sync, the checkpoints (``models.checkpoint``) and the
benchmarks' hand-off files all write through it.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Callable, Optional, Union

__all__ = ["PathLike", "fsync_path", "fsync_dir", "atomic_write", "atomic_write_bytes", "atomic_write_text"]

PathLike = Union[str, "os.PathLike[str]"]


def fsync_path(path: PathLike) -> None:
    """Flush a file (or a directory's entries) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: PathLike) -> None:
    """Flush a directory's entries where the filesystem allows it (some refuse fsync on directories)."""
    try:
        fsync_path(path)
    except OSError:
        pass


def atomic_write(path: PathLike, write: Callable[[str], None], temp_name: Optional[str] = None) -> None:
    """Call ``write(tmp)`` on a temporary file beside ``path`` (a fresh name, or ``temp_name``), fsync
    it and rename it onto ``path``, then fsync the directory; on failure the temporary file is removed
    and ``path`` untouched. ``path``'s directory is created when missing."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if temp_name is None:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.close(fd)
    else:
        tmp = str(path.parent / temp_name)
    try:
        write(tmp)
        fsync_path(tmp)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:  # never written, or not a file: the original error is the one to report
            pass
        raise
    fsync_dir(path.parent)


def atomic_write_bytes(path: PathLike, data: bytes, temp_name: Optional[str] = None) -> None:
    """Replace ``path`` with ``data`` (see :func:`atomic_write`)."""
    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            f.write(data)

    atomic_write(path, write, temp_name)


def atomic_write_text(path: PathLike, text: str, temp_name: Optional[str] = None) -> None:
    """Replace ``path`` with ``text`` in UTF-8 (see :func:`atomic_write`)."""
    atomic_write_bytes(path, text.encode("utf-8"), temp_name)
