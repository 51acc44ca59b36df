"""Crash-safe checkpoints of a peer's (or the archive's) module states.

Layout under the checkpoint root::

    round-000042/            one snapshot: run.json + one safetensors file per group of tensors
        run.json             metadata (for a peer: the run config, modules, rounds)
        modules/L0M1.safetensors
        outer/L0M1.safetensors
    round-000043/
    LATEST                   the name of the newest complete snapshot (written last, atomically)

A snapshot of a peer or of the archive is a run directory (``run.json`` + ``modules/``), so
``hivepath eval``, ``generate`` and ``export`` can read it directly.

A snapshot is written into a temporary directory, fsync'd, renamed into place, and only then named
in ``LATEST``; so a crash or a full disk at any point leaves the previous snapshot intact and
loadable. A failed save (``ENOSPC``, ``EDQUOT``, ``EIO``, permissions) removes whatever it wrote,
leaves ``LATEST`` naming the previous snapshot and raises one :class:`CheckpointError` whose message
names the directory, the free space and the fix; callers log it once and keep training. Older
snapshots beyond ``keep`` (and temporary directories a crash left behind) are pruned after a
successful save. A snapshot that fails to load (truncated, corrupt) is reported and the next older
one is used.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from models.errors import HivepathError

__all__ = ["CheckpointDir", "Snapshot", "CheckpointError"]

log = logging.getLogger(__name__)

_META = "run.json"
_LATEST = "LATEST"
_GROUP_RE = re.compile(r"^[A-Za-z0-9_-]+(/[A-Za-z0-9_-]+)?$")


class CheckpointError(HivepathError):
    """A checkpoint could not be written (disk full, permissions) or read; the previous one is intact.

    ``errno`` is the operating system's error number when one caused it (``errno.ENOSPC`` for a full
    disk), else None.
    """

    def __init__(self, message: str, errno: Optional[int] = None):
        super().__init__(message)
        self.errno = errno


@dataclass
class Snapshot:
    """One loaded snapshot: named groups of tensors and the JSON metadata saved with them."""

    path: Path
    round_no: int
    groups: dict[str, dict[str, torch.Tensor]]
    meta: dict[str, Any]


class CheckpointDir:
    """A directory of round-numbered snapshots, newest named in ``LATEST``.

    ``keep_flag`` is the command-line flag that sets ``keep``, named in the fix of a disk-full error
    (``--keep-checkpoints`` for a peer, ``--keep`` for the archive).
    """

    def __init__(self, root: os.PathLike | str, keep: int = 2, keep_flag: str = "--keep-checkpoints"):
        if keep < 1:
            raise ValueError("keep must be >= 1")
        self.root = Path(root)
        self.keep = keep
        self.keep_flag = keep_flag

    def save(
        self,
        round_no: int,
        groups: dict[str, dict[str, torch.Tensor]],
        meta: dict[str, Any],
        group_metadata: Optional[dict[str, dict[str, str]]] = None,
    ) -> Path:
        """Write a snapshot atomically; raise :class:`CheckpointError` and keep the old one on failure.

        ``groups`` maps a relative name (``modules/L0M1``) to its tensors; ``group_metadata`` gives
        the safetensors string metadata of a group; ``meta`` is written as ``run.json``.
        """
        group_metadata = group_metadata or {}
        name = f"round-{round_no:06d}"
        final = self.root / name
        tmp: Optional[Path] = None
        displaced: Optional[Path] = None  # an older snapshot of the same round, restored on failure
        installed = False
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=self.root))
            for group, tensors in groups.items():
                if not _GROUP_RE.match(group):
                    raise ValueError(f"bad group name {group!r}: use letters, digits, _ and at most one '/'")
                file = tmp / f"{group}.safetensors"
                file.parent.mkdir(exist_ok=True)
                tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
                save_file(tensors, str(file), metadata=group_metadata.get(group))
                _fsync(file)
            meta_file = tmp / _META
            meta_file.write_text(json.dumps({**meta, "round": round_no, "groups": sorted(groups)}, indent=1, sort_keys=True))
            _fsync(meta_file)
            if final.exists():
                displaced = Path(f"{tmp}.replaced")
                os.replace(final, displaced)  # a rename: needs no space
            os.replace(tmp, final)
            tmp, installed = None, True
            self._write_latest(name)
        except (OSError, SafetensorError) as e:
            code = _errno_of(e)
            if installed:  # complete but not named in LATEST: remove it, LATEST keeps naming the previous one
                shutil.rmtree(final, ignore_errors=True)
            if displaced is not None:
                try:
                    os.replace(displaced, final)
                    displaced = None
                except OSError as restore:
                    log.error("could not put snapshot %s back in place (%s); it is in %s", final, restore, displaced)
            raise CheckpointError(self._failure_message(name, e, code), errno=code) from None
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
        if displaced is not None:
            shutil.rmtree(displaced, ignore_errors=True)
        self._prune()
        log.debug("checkpoint round %d written to %s", round_no, final)
        return final

    def _failure_message(self, name: str, e: BaseException, code: Optional[int]) -> str:
        """One line: what failed where, why, the free space, what survives, and the fix."""
        reason = f"{os.strerror(code)} ({errno.errorcode.get(code, code)})" if code else str(e)
        try:
            free = f", {_fmt_bytes(shutil.disk_usage(self.root).free)} free"
        except OSError:
            free = ""
        previous = self._read_latest()
        kept = f"the previous checkpoint {previous} is kept" if previous else "no previous checkpoint exists"
        if code in (errno.ENOSPC, errno.EDQUOT) and self.keep > 1:
            fix = f"free space on that disk or keep fewer snapshots with {self.keep_flag} (now {self.keep})"
        elif code in (errno.ENOSPC, errno.EDQUOT):
            fix = f"free space on that disk (it keeps a single snapshot already: {self.keep_flag} 1)"
        elif code == errno.EIO:
            fix = "the disk reported an I/O error: check it (dmesg) or put the checkpoints on another disk"
        elif code in (errno.EACCES, errno.EPERM, errno.EROFS):
            fix = "make the directory writable by this user or choose another one"
        else:
            fix = "check the directory and the disk"
        return f"could not write checkpoint {name} in {self.root}: {reason}{free}; {kept}; {fix}"

    def latest_path(self) -> Optional[Path]:
        """The snapshot named in ``LATEST`` (or the newest complete one), without loading it."""
        latest = self._read_latest()
        if latest and (self.root / latest / _META).exists():
            return self.root / latest
        found = self.snapshots()
        return found[0] if found else None

    def snapshots(self) -> list[Path]:
        """Complete snapshots, newest first."""
        if not self.root.is_dir():
            return []
        found = [p for p in self.root.iterdir() if p.is_dir() and p.name.startswith("round-") and (p / _META).exists()]
        return sorted(found, key=lambda p: p.name, reverse=True)

    def load_latest(self) -> Optional[Snapshot]:
        """The newest snapshot that loads cleanly, or None; corrupt ones are logged and skipped."""
        latest = self._read_latest()
        candidates = sorted(self.snapshots(), key=lambda p: p.name != latest)  # stable: newest first otherwise
        for path in candidates:
            try:
                return self.load(path)
            except CheckpointError as e:
                log.warning("%s; trying an older one", e)
        return None

    def load(self, path: Path) -> Snapshot:
        try:
            meta = json.loads((path / _META).read_text())
            groups = {g: load_file(str(path / f"{g}.safetensors")) for g in meta["groups"]}
            return Snapshot(path=path, round_no=int(meta["round"]), groups=groups, meta=meta)
        except (OSError, ValueError, KeyError, TypeError, SafetensorError) as e:
            raise CheckpointError(f"checkpoint {path} is corrupt or incomplete ({type(e).__name__}: {e})") from None

    def _write_latest(self, name: str) -> None:
        tmp = self.root / f".{_LATEST}.tmp"
        try:
            tmp.write_text(name)
            _fsync(tmp)
            os.replace(tmp, self.root / _LATEST)
        except OSError:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
            raise
        _fsync_dir(self.root)

    def _read_latest(self) -> Optional[str]:
        try:
            return (self.root / _LATEST).read_text().strip() or None
        except OSError:
            return None

    def _prune(self) -> None:
        """Drop snapshots beyond ``keep`` and temporary directories a crash left behind (only after a
        successful save: no save of ours is in flight then)."""
        for old in self.snapshots()[self.keep :]:
            shutil.rmtree(old, ignore_errors=True)
        for stale in self.root.glob(".round-*"):
            if stale.is_dir():
                shutil.rmtree(stale, ignore_errors=True)


_OS_ERROR_RE = re.compile(r"os error (\d+)")


def _errno_of(e: BaseException) -> Optional[int]:
    """The OS error number behind ``e``: ``OSError.errno``, or parsed from safetensors' message
    (``I/O error: No space left on device (os error 28)``), which carries no errno attribute."""
    code = getattr(e, "errno", None)
    if isinstance(code, int):
        return code
    match = _OS_ERROR_RE.search(str(e))
    return int(match.group(1)) if match else None


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    try:
        _fsync(path)
    except OSError:  # some filesystems refuse fsync on directories
        pass
