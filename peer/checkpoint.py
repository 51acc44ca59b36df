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
loadable. Older snapshots beyond ``keep`` are pruned after a successful save. A snapshot that fails
to load (truncated, corrupt) is reported and the next older one is used.
"""

from __future__ import annotations

import json
import re
import logging
import os
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
    """A checkpoint could not be written (disk full, permissions); the previous one is intact."""


@dataclass
class Snapshot:
    """One loaded snapshot: named groups of tensors and the JSON metadata saved with them."""

    path: Path
    round_no: int
    groups: dict[str, dict[str, torch.Tensor]]
    meta: dict[str, Any]


class CheckpointDir:
    """A directory of round-numbered snapshots, newest named in ``LATEST``."""

    def __init__(self, root: os.PathLike | str, keep: int = 2):
        if keep < 1:
            raise ValueError("keep must be >= 1")
        self.root = Path(root)
        self.keep = keep

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
                shutil.rmtree(final)
            os.replace(tmp, final)
            tmp = None
            self._write_latest(name)
        except (OSError, SafetensorError) as e:
            reason = getattr(e, "strerror", None) or str(e)
            raise CheckpointError(f"could not write checkpoint {final}: {reason}; the previous checkpoint is kept") from None
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
        self._prune()
        log.debug("checkpoint round %d written to %s", round_no, final)
        return final

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
        tmp.write_text(name)
        _fsync(tmp)
        os.replace(tmp, self.root / _LATEST)
        _fsync_dir(self.root)

    def _read_latest(self) -> Optional[str]:
        try:
            return (self.root / _LATEST).read_text().strip() or None
        except OSError:
            return None

    def _prune(self) -> None:
        for old in self.snapshots()[self.keep :]:
            shutil.rmtree(old, ignore_errors=True)


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
