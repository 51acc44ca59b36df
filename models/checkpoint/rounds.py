"""Crash-safe, round-numbered snapshots of module states: what a peer or the archive keeps on disk.

A snapshot is written into a staged directory, fsync'd, renamed into place, and only then named in
``LATEST``; so a crash or a full disk at any point leaves the previous snapshot intact and loadable.
A failed save (``ENOSPC``, ``EDQUOT``, ``EIO``, permissions) removes whatever it wrote, leaves
``LATEST`` naming the previous snapshot and raises one :class:`CheckpointError` whose message names
the directory, the free space and the fix; callers log it once and keep training. Older snapshots
beyond ``keep`` (and staged directories a crash left behind) are pruned after a successful save. A
snapshot that fails to load (truncated, corrupt) is reported and the next older one is used.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors import SafetensorError

from models.checkpoint.files import CheckpointError, PathLike, atomic_write_bytes, load_tensors, write_tensors
from models.checkpoint.layout import (
    LATEST_FILE, RUN_FILE, group_file, install_directory, module_group, module_tensors, read_latest, read_summary,
    stage_directory, write_summary,
)

__all__ = ["CheckpointDir", "Snapshot", "snapshot_name"]

log = logging.getLogger(__name__)

_PREFIX = "round-"
_GROUP_RE = re.compile(r"^[A-Za-z0-9_-]+(/[A-Za-z0-9_-]+)?$")
_LATEST_TEMP = f".{LATEST_FILE}.tmp"


def snapshot_name(round_no: int) -> str:
    """The directory name of the snapshot of round ``round_no``: ``round-000042``."""
    return f"{_PREFIX}{round_no:06d}"


@dataclass
class Snapshot:
    """One loaded snapshot: named groups of tensors and its ``run.json``."""

    path: Path
    round_no: int
    groups: dict[str, dict[str, torch.Tensor]]
    meta: dict[str, Any]

    def module_round(self, module_id: str) -> int:
        """The round this snapshot holds ``module_id`` at, or -1 when it does not hold it."""
        if module_group(module_id) not in self.groups:
            return -1
        return int(self.meta.get("rounds", {}).get(module_id, -1))

    def module_state(self, module_id: str, names: list[str]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """``(params, momentum)`` of ``module_id`` in the order of its parameter ``names``."""
        return module_tensors(self.groups, module_id, names)


class CheckpointDir:
    """A directory of round-numbered snapshots, newest named in ``LATEST``.

    ``keep_flag`` is the command-line flag that sets ``keep``, named in the fix of a disk-full error
    (``--keep-checkpoints`` for a peer, ``--keep`` for the archive).
    """

    def __init__(self, root: PathLike, keep: int = 2, keep_flag: str = "--keep-checkpoints"):
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

        ``groups`` maps a relative name (``modules/L0M1``, see :func:`models.checkpoint.module_groups`)
        to its tensors; ``group_metadata`` gives the safetensors string metadata of a group; ``meta`` is
        written as ``run.json`` with the round and the group names added.
        """
        group_metadata = group_metadata or {}
        name = snapshot_name(round_no)
        final = self.root / name
        staged: Optional[Path] = None
        displaced: Optional[Path] = None  # an older snapshot of the same round, restored on failure
        installed = False
        try:
            staged = stage_directory(final)
            for group, tensors in groups.items():
                if not _GROUP_RE.match(group):
                    raise ValueError(f"bad group name {group!r}: use letters, digits, _ and at most one '/'")
                write_tensors(group_file(staged, group), tensors, group_metadata.get(group))
            write_summary(staged, {**meta, "round": round_no, "groups": sorted(groups)})
            displaced = install_directory(staged, final)
            staged, installed = None, True
            atomic_write_bytes(self.root / LATEST_FILE, name.encode(), temp_name=_LATEST_TEMP)
        except (OSError, SafetensorError) as e:
            code = _errno_of(e)
            if installed:  # complete but not named in LATEST: remove it, LATEST keeps naming the previous one
                shutil.rmtree(final, ignore_errors=True)
            if displaced is not None:
                try:
                    install_directory(displaced, final)
                    displaced = None
                except OSError as restore:
                    log.error("could not put snapshot %s back in place (%s); it is in %s", final, restore, displaced)
            raise CheckpointError(self._failure_message(name, e, code), errno=code) from None
        finally:
            if staged is not None:
                shutil.rmtree(staged, ignore_errors=True)
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
        previous = read_latest(self.root)
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
        latest = read_latest(self.root)
        if latest and (self.root / latest / RUN_FILE).exists():
            return self.root / latest
        found = self.snapshots()
        return found[0] if found else None

    def snapshots(self) -> list[Path]:
        """Complete snapshots, newest first."""
        if not self.root.is_dir():
            return []
        found = [p for p in self.root.iterdir()
                 if p.is_dir() and p.name.startswith(_PREFIX) and (p / RUN_FILE).exists()]
        return sorted(found, key=lambda p: p.name, reverse=True)

    def load_latest(self) -> Optional[Snapshot]:
        """The newest snapshot that loads cleanly, or None; corrupt ones are logged and skipped."""
        latest = read_latest(self.root)
        candidates = sorted(self.snapshots(), key=lambda p: p.name != latest)  # stable: newest first otherwise
        for path in candidates:
            try:
                return self.load(path)
            except CheckpointError as e:
                log.warning("%s; trying an older one", e)
        return None

    def load(self, path: Path) -> Snapshot:
        """Read the snapshot at ``path``; :class:`CheckpointError` when any part of it is unreadable."""
        try:
            meta = read_summary(path)
            groups = {g: load_tensors(group_file(path, g))[0] for g in meta["groups"]}
            return Snapshot(path=path, round_no=int(meta["round"]), groups=groups, meta=meta)
        except (CheckpointError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"checkpoint {path} is corrupt or incomplete ({type(e).__name__}: {e})") from None

    def _prune(self) -> None:
        """Drop snapshots beyond ``keep`` and staged directories a crash left behind (only after a
        successful save: no save of ours is in flight then)."""
        for old in self.snapshots()[self.keep :]:
            shutil.rmtree(old, ignore_errors=True)
        for stale in self.root.glob(f".{_PREFIX}*"):
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
    """A free-space figure for the error message: ``512 B``, ``3.4 MiB``, ``12.0 GiB``."""
    units = ("B", "KiB", "MiB", "GiB")
    i = 0
    while n >= 1024 and i < len(units) - 1:
        n, i = n / 1024, i + 1
    return f"{n:.0f} B" if i == 0 else f"{n:.1f} {units[i]}"
