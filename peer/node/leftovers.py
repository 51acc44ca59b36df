"""The files a stopped process tree would leave in the temp directories, and their removal.

A peer's processes bind unix sockets that nothing removes when a process dies before it closes them:

- hivemind's p2p daemon listens at ``/tmp/hivemind-p2pd-*.sock``, and every P2P handle of a process
  (the DHT's, and each replica a process asks for) at ``/tmp/hivemind-p2pclient-*.sock``, which only
  an explicit shutdown of that handle removes (hivemind fixes ``/tmp``, whatever ``TMPDIR`` says);
- torch's shared-memory manager (hivemind shares tensors between its processes through it) listens at
  ``TMPDIR/torch-shm-dir-*/manager.sock`` and removes both when it exits on its own, not when a
  signal ends it;
- Python's multiprocessing listens at ``TMPDIR/pymp-*/listener-*`` to hand file descriptors between
  processes, and removes the directory at a clean exit only.

A peer also registers on the machine (:mod:`peer.node.machine_share`) with a file named after its pid
that only its own clean exit, or the recount of a peer that runs later, removes.

The watchdog of :mod:`peer.node.lifetime`, which outlives the process it watches however that one
died, notes the sockets the process and its descendants bind (:func:`bound_sockets`) and, once they
are gone, removes each that no process listens at any more (:func:`remove_dead_sockets`), with its
``torch-shm-dir-*`` or ``pymp-*`` directory once empty, and the process's registration (:func:`remove_registration`). Only
paths it saw this tree bind are touched: other users' and other runs' files are left alone.

Standard library and psutil only (the watchdog imports it).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import stat
import tempfile
from pathlib import Path
from typing import Iterable

__all__ = ["TEMP_ROOTS", "bound_sockets", "remove_dead_sockets", "remove_registration", "SHM_DIR_PREFIX"]

log = logging.getLogger(__name__)

TEMP_ROOTS = tuple(sorted({"/tmp", os.path.realpath(tempfile.gettempdir())}))
"""Where the sockets that are removed live: ``/tmp`` (hivemind's) and this process's temp dir."""

SHM_DIR_PREFIX = "torch-shm-dir-"
"""The directory torch's shared-memory manager makes for its socket (removed with it, once empty)."""
SOCKET_DIR_PREFIXES = (SHM_DIR_PREFIX, "pymp-")
"""Directories made to hold such a socket: removed with it, once empty (multiprocessing's too)."""


def _in_temp(path: str) -> bool:
    real = os.path.realpath(os.path.dirname(path))
    return any(real == root or real.startswith(root + os.sep) for root in TEMP_ROOTS)


def bound_sockets(processes: Iterable) -> set[str]:
    """The paths of the unix sockets the psutil ``processes`` have bound in the temp directories."""
    import psutil

    paths: set[str] = set()
    for p in processes:
        with contextlib.suppress(psutil.Error, OSError):
            for conn in p.net_connections(kind="unix"):
                if isinstance(conn.laddr, str) and conn.laddr.startswith("/") and _in_temp(conn.laddr):
                    paths.add(conn.laddr)
    return paths


def _listening(path: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        try:
            s.connect(path)
        except OSError as e:
            return e.errno not in (errno.ECONNREFUSED, errno.ENOENT)
        return True


def remove_dead_sockets(paths: Iterable[str]) -> list[str]:
    """Remove each of ``paths`` that is still a unix socket nobody listens at, and its
    ``torch-shm-dir-*`` or ``pymp-*`` directory once empty; returns what was removed."""
    removed = []
    for path in sorted(paths):
        try:
            if not stat.S_ISSOCK(os.lstat(path).st_mode) or _listening(path):
                continue
            os.unlink(path)
            removed.append(path)
        except OSError as e:
            log.debug("leaving %s: %s", path, e)
            continue
        parent = Path(path).parent
        if parent.name.startswith(SOCKET_DIR_PREFIXES):
            with contextlib.suppress(OSError):
                parent.rmdir()
                removed.append(str(parent))
    return removed


def remove_registration(pid: int) -> bool:
    """Remove the machine-share registration of process ``pid`` once nothing holds its lock (the
    process is gone); whether a file was removed."""
    import fcntl

    from peer.node.machine_share import registration, registry_dir

    path = registry_dir() / registration(pid)
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # held: a live process of that pid
        return False
    else:
        with contextlib.suppress(OSError):
            path.unlink()
            return True
        return False
    finally:
        os.close(fd)
