"""An exclusive lock on a file that names its holder: one live process per identity file or work dir.

:func:`take` holds an ``flock`` on a lock file and writes our pid into it; a second process is told
the holder's pid (:class:`LockHeld`). The kernel drops the lock when the holder exits, however it
died, so a crashed process never leaves a stale lock. Standard library only.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import Optional

__all__ = ["LockHeld", "take", "release"]


class LockHeld(Exception):
    """Another live process holds the lock; :attr:`pid` is its pid when it wrote one."""

    def __init__(self, path: Path, pid: Optional[int]):
        super().__init__(f"{path} is held by pid {pid}")
        self.path = path
        self.pid = pid


def take(lock_path: Path) -> int:
    """Lock ``lock_path`` (created if missing) and write our pid in it; the open descriptor, for
    :func:`release`. Raises :class:`LockHeld` when a live process holds it, ``OSError`` when the file
    cannot be created."""
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _read_pid(fd)
        os.close(fd)
        raise LockHeld(Path(lock_path), holder) from None
    try:
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
    except BaseException:
        release(fd)
        raise
    return fd


def release(fd: int) -> None:
    """Unlock and close what :func:`take` returned."""
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


def _read_pid(fd: int) -> Optional[int]:
    try:
        raw = os.pread(fd, 32, 0).decode().strip()
        return int(raw) if raw else None
    except (OSError, ValueError):
        return None
