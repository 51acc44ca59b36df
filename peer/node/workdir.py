"""One live process per work dir: ``peer join``'s ``--work-dir`` and ``archive``'s ``--dir``.

Two processes on one directory would write one checkpoints directory (and one identity, one dataset
cache). :func:`lock_work_dir` holds ``.hivepath.lock`` in it for the process's life (a
:mod:`peer.network.pidlock`, released by the kernel when the holder dies); a second process stops
at start-up with :class:`WorkDirInUseError` (exit 6) naming the holder's pid.
"""

from __future__ import annotations

from pathlib import Path

from models.errors import HivepathError
from peer.network.pidlock import LockHeld, release, take

__all__ = ["WorkDirInUseError", "WorkDirLock", "lock_work_dir", "LOCK_FILE"]

LOCK_FILE = ".hivepath.lock"
"""The lock file inside a work dir; it holds the pid of the process that uses the directory."""


class WorkDirInUseError(HivepathError):
    """Another live process uses this work dir."""

    exit_code = 6


class WorkDirLock:
    """A held work-dir lock; :meth:`release` (or leaving the ``with`` block) frees it."""

    def __init__(self, directory: Path, fd: int):
        self.directory = directory
        self._fd: "int | None" = fd

    def release(self) -> None:
        if self._fd is not None:
            release(self._fd)
            self._fd = None

    def __enter__(self) -> "WorkDirLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def lock_work_dir(directory: Path, flag: str = "--work-dir") -> WorkDirLock:
    """Lock ``directory`` (which must exist) for this process. ``flag``: the option that names a
    directory, for the message (``--work-dir``, ``--dir``)."""
    directory = Path(directory).resolve()
    try:
        fd = take(directory / LOCK_FILE)
    except LockHeld as e:
        holder = f"pid {e.pid}" if e.pid else "a process that wrote no pid"
        raise WorkDirInUseError(
            f"{flag} {directory} is in use by a live process ({holder}): two processes on one directory "
            f"would write one checkpoints directory; stop that process or pass this one another {flag}"
        ) from None
    except OSError as e:
        raise HivepathError(f"{flag} {directory}: cannot create {LOCK_FILE} ({e}); pass a writable {flag}") from None
    return WorkDirLock(directory, fd)
