"""Several peers on one machine share its cores, its memory and its GPUs instead of each taking all.

torch starts as many threads as the machine has cores; two peers on a 16-core box then run 32 busy
threads and both slow down (a multi-GPU box with a peer per GPU, a test rig, a volunteer who starts a
second peer). Each ``peer join`` registers itself in a directory of this user shared by the peers of
the machine (:func:`registry_dir`): a file named after its pid and host name (:func:`registration`:
containers of one host that share the directory have pids of their own), holding the device it trains on,
under an exclusive ``fcntl`` lock for as long as the process lives. The kernel drops the lock when
the process dies however it dies, so a file whose lock can be taken belongs to a dead peer and is
removed.

- **Cores**: a peer without ``--threads`` uses ``max(1, cores // peers)`` threads and looks again
  after every round, so peers that start or stop later are accounted for. ``--threads N`` (or
  ``HIVEPATH_THREADS``) opts out: that peer keeps its threads (and is counted by the others).
- **Devices**: :meth:`MachineShare.claim_device` chooses this peer's device under a lock of the
  directory, knowing which devices the others train on, and records it: ``--device auto`` takes a
  GPU no other peer uses (:func:`choose_device`).
- **Memory**: :meth:`MachineShare.peers_on` counts the peers on one device; a peer reports the
  device's free memory divided by it at join (``--max-memory`` says otherwise).

The cores are this process's CPU affinity (``taskset``, cgroup cpusets), not the whole machine.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import socket
import tempfile
from pathlib import Path
from typing import Callable, Optional

__all__ = ["MachineShare", "registry_dir", "registration", "usable_cores", "choose_device"]

log = logging.getLogger(__name__)


def usable_cores() -> int:
    """Cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


def choose_device(choice: str, others: dict[str, str], gpus: int) -> str:
    """The device (``cpu``, ``cuda:N``) of ``--device choice`` on a machine of ``gpus`` GPUs whose other
    peers train on ``others`` (registration, ``PID@HOST``, -> device).

    ``auto``: the first GPU no other peer uses; on a machine of one GPU, that GPU even when another
    peer has it (they share its memory); on a machine of several whose every GPU has a peer, an error
    naming them; the CPU without a GPU. ``cuda`` is GPU 0, ``cuda:N`` that GPU, shared or not (an
    error when there is none).
    """
    from models.errors import HivepathError

    choice = choice.lower()
    if choice == "auto":
        if gpus == 0:
            return "cpu"
        taken = set(others.values())
        free = [i for i in range(gpus) if f"cuda:{i}" not in taken]
        if free or gpus == 1:
            return f"cuda:{free[0] if free else 0}"
        held = "; ".join(f"cuda:{i} by peer {', '.join(p for p, d in sorted(others.items()) if d == f'cuda:{i}')}"
                         for i in range(gpus))
        raise HivepathError(f"--device auto: every GPU of this machine has a peer already ({held}); pass --device "
                            "cuda:N to share one of them, or --device cpu")
    if choice == "cuda" or re.fullmatch(r"cuda:\d+", choice):
        index = int(choice.partition(":")[2] or 0)
        if gpus == 0:
            raise HivepathError(f"--device {choice} was asked for but this machine has no usable CUDA GPU; use "
                                "--device cpu")
        if index >= gpus:
            raise HivepathError(f"--device {choice}: this machine has {gpus} GPU(s), cuda:0 to cuda:{gpus - 1}")
        return f"cuda:{index}"
    if choice == "cpu":
        return "cpu"
    raise HivepathError(f"--device {choice!r} is not one of auto, cpu, cuda, cuda:N")


_REGISTRATION = re.compile(r"\d+(@[^/]+)?")  # PID alone: a peer of an earlier release


def registration(pid: Optional[int] = None) -> str:
    """The registry file name of process ``pid`` (default: this one) on this host: ``PID@HOST``."""
    return f"{os.getpid() if pid is None else pid}@{socket.gethostname()}"


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
    passes ``torch.set_num_threads``); ``apply=None`` (``--threads``): registered, counted, but the
    threads are left as they are.
    """

    def __init__(self, apply: Optional[Callable[[int], None]], directory: Optional[Path] = None,
                 cores: Optional[int] = None):
        self.directory = Path(directory) if directory is not None else registry_dir()
        self.cores = cores if cores is not None else usable_cores()
        self._apply = apply
        self._file: Optional[int] = None
        self.threads = 0
        self.peers_seen = 0
        self.device = ""
        """The device this peer recorded (:meth:`claim_device`)."""

    def __enter__(self) -> "MachineShare":
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.directory / registration(), os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:  # an unusable directory costs the sharing, not the peer
            log.warning("cannot register in %s to share this machine's cores (%s): torch picks its threads; "
                        "pass --threads N or set HIVEPATH_PEERS_DIR", self.directory, e.strerror or e)
            return self
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # our own pid: nobody else holds it
        os.ftruncate(fd, 0)  # a dead process's file of the same pid may hold its device
        self._file = fd
        self.update()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.directory / registration())
            os.close(self._file)
            self._file = None

    def others(self) -> dict[int, str]:
        """The other live peers registered on this machine: registration (``PID@HOST``) -> the device
        it recorded ('' before it chose one); removes the files of dead ones."""
        live: dict[str, str] = {}
        for path in self.directory.iterdir():
            if not _REGISTRATION.fullmatch(path.name) or path.name == registration():
                continue
            try:
                fd = os.open(path, os.O_RDWR)
            except OSError:  # removed meanwhile
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # held: a live peer
                with contextlib.suppress(OSError):
                    live[path.name] = os.pread(fd, 64, 0).decode("ascii", "replace").strip()
            else:  # its process is gone
                with contextlib.suppress(OSError):
                    path.unlink()
            finally:
                os.close(fd)
        return live

    def peers(self) -> int:
        """Live peers registered on this machine, this one included."""
        return 1 + len(self.others())

    def claim_device(self, choose: Callable[[dict[str, str]], str]) -> str:
        """``choose(others)`` (the other peers' devices by registration) picks this peer's device, which is then
        recorded for the peers that start after; both under the registry's lock, so two peers starting
        together never choose alike from the same view. Unregistered: ``choose({})``."""
        if self._file is None:
            return choose({})
        lock = os.open(self.directory, os.O_RDONLY)  # the directory itself is the lock: no file of its own
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            device = choose(self.others())
            os.ftruncate(self._file, 0)
            os.pwrite(self._file, device.encode("ascii"), 0)
            self.device = device
        finally:
            os.close(lock)  # drops the lock
        return device

    def peers_on(self, device: str) -> int:
        """Live peers training on ``device`` (as recorded), this one included (1 unregistered)."""
        if self._file is None:
            return 1
        return 1 + sum(1 for d in self.others().values() if d == device)

    def update(self) -> int:
        """Recount the peers; apply and return this peer's threads when the share changed (0 when
        this peer could not register, or keeps the threads it was given)."""
        if self._file is None or self._apply is None:
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
