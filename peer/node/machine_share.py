"""Several peers on one machine share its cores instead of each taking all of them.

torch starts as many threads as the machine has cores; two peers on a 16-core box then run 32 busy
threads and both slow down (a multi-GPU box with a peer per GPU, a test rig, a volunteer who starts a
second peer). Each ``peer join`` without ``--threads`` registers itself in a directory of this user
shared by the peers of the machine (:func:`registry_dir`): a file named after its pid, held under
an exclusive ``fcntl`` lock for as long as the process lives. The kernel drops the lock when the
process dies however it dies, so a file whose lock can be taken belongs to a dead peer and is
removed. Each peer then uses ``max(1, cores // peers)`` threads, and looks again after every round,
so peers that start or stop later are accounted for. ``--threads N`` (or ``HIVEPATH_THREADS``) opts
out: that peer neither registers nor changes its threads.

The cores are this process's CPU affinity (``taskset``, cgroup cpusets), not the whole machine.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import tempfile
from pathlib import Path
from typing import Callable, Optional

__all__ = ["MachineShare", "registry_dir", "usable_cores"]

log = logging.getLogger(__name__)


def usable_cores() -> int:
    """Cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


def registry_dir() -> Path:
    """Where the peers of this user on this machine register (``HIVEPATH_PEERS_DIR`` overrides it)."""
    from peer.settings import read

    explicit = read("HIVEPATH_PEERS_DIR")
    if explicit:
        return Path(explicit)
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(runtime) if runtime and os.path.isdir(runtime) else Path(tempfile.gettempdir())
    return base / f"hivepath-{os.getuid()}" / "peers"


class MachineShare:
    """This peer's registration among the peers of the machine, and its share of the cores.

    ``apply(threads)`` is called with the new thread count whenever the share changes (the peer
    passes ``torch.set_num_threads``).
    """

    def __init__(self, apply: Callable[[int], None], directory: Optional[Path] = None,
                 cores: Optional[int] = None):
        self.directory = Path(directory) if directory is not None else registry_dir()
        self.cores = cores if cores is not None else usable_cores()
        self._apply = apply
        self._file: Optional[int] = None
        self.threads = 0
        self.peers_seen = 0

    def __enter__(self) -> "MachineShare":
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.directory / str(os.getpid()), os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:  # an unusable directory costs the sharing, not the peer
            log.warning("cannot register in %s to share this machine's cores (%s): torch picks its threads; "
                        "pass --threads N or set HIVEPATH_PEERS_DIR", self.directory, e.strerror or e)
            return self
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # our own pid: nobody else holds it
        self._file = fd
        self.update()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.directory / str(os.getpid()))
            os.close(self._file)
            self._file = None

    def peers(self) -> int:
        """Live peers registered on this machine, this one included; removes the files of dead ones."""
        live = 0
        for path in self.directory.iterdir():
            if not path.name.isdigit():
                continue
            if int(path.name) == os.getpid():
                live += 1
                continue
            try:
                fd = os.open(path, os.O_RDWR)
            except OSError:  # removed meanwhile
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # held: a live peer
                live += 1
            else:  # its process is gone
                with contextlib.suppress(OSError):
                    path.unlink()
            finally:
                os.close(fd)
        return max(1, live)

    def update(self) -> int:
        """Recount the peers; apply and return this peer's threads when the share changed (0 when
        this peer could not register)."""
        if self._file is None:
            return 0
        peers = self.peers()
        threads = max(1, self.cores // peers)
        if (peers, threads) != (self.peers_seen, self.threads):
            others = f"with {peers - 1} other peer{'s' if peers > 2 else ''} " if peers > 1 else ""
            log.info("sharing this machine's %d cores %sby default: %d torch threads (--threads N to choose)",
                     self.cores, others, threads)
            if threads != self.threads:
                self._apply(threads)
            self.peers_seen, self.threads = peers, threads
        return threads
