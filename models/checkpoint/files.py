"""Durable files: safetensors and JSON written atomically, read back with one error type.

Spot machines vanish mid-write: every file is written through :func:`models.durable.atomic_write`
(a temporary name in its own directory, fsync'd, renamed onto its name and the directory fsync'd), so
a crash or a full disk leaves the old file or the complete new one, never a torn mix. Anything that
cannot be read raises :class:`CheckpointError`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Optional

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from safetensors.torch import save_file

from models import strict_json
from models.durable import PathLike, atomic_write, atomic_write_bytes, fsync_dir, fsync_path
from models.errors import HivepathError

__all__ = [
    "CheckpointError", "fsync_path", "fsync_dir", "atomic_write_bytes", "write_json", "read_json",
    "write_tensors", "save_tensors", "load_tensors", "pack_tensors", "unpack_tensors",
]

class CheckpointError(HivepathError):
    """A checkpoint is missing, truncated or foreign, or could not be written (disk full, permissions).

    ``errno`` is the operating system's error number when one caused it (``errno.ENOSPC`` for a full
    disk), else None.
    """

    def __init__(self, message: str, errno: Optional[int] = None):
        super().__init__(message)
        self.errno = errno


def write_json(path: PathLike, obj: Any) -> None:
    """Write ``obj`` as indented, key-sorted JSON with a final newline, atomically."""
    atomic_write_bytes(path, (strict_json.dumps(obj, indent=1, sort_keys=True) + "\n").encode())


def read_json(path: PathLike) -> Any:
    """The parsed JSON file ``path`` (its content is the caller's to check); :class:`CheckpointError`
    naming the file when it is absent or not JSON."""
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path.parent} has no {path.name}") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{path} is corrupt ({e})") from None


def write_tensors(path: PathLike, tensors: Mapping[str, torch.Tensor], metadata: Optional[dict[str, str]]) -> None:
    """Stream ``tensors`` (moved to CPU, made contiguous) to a safetensors file, atomically.

    ``metadata`` None writes no metadata block; ``{}`` writes an empty one (the files differ by those
    bytes, and each writer keeps the bytes it always wrote). A full disk raises ``OSError`` or
    safetensors' ``SafetensorError`` (whose message carries the OS error number).
    """
    cpu = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    atomic_write(path, lambda tmp: save_file(cpu, tmp, metadata=metadata))


def save_tensors(path: PathLike, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> None:
    """Save named tensors (moved to CPU, made contiguous) with string metadata, atomically."""
    bad = [k for k, v in metadata.items() if not isinstance(k, str) or not isinstance(v, str)]
    if bad:
        raise TypeError(f"checkpoint metadata must map str to str; offending keys: {bad}")
    write_tensors(path, tensors, dict(metadata))


def load_tensors(path: PathLike) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Read a safetensors file: ``(tensors, metadata)`` on CPU; :class:`CheckpointError` when it cannot."""
    path = Path(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} does not exist; check the path or re-run training") from None
    except (SafetensorError, ValueError, RuntimeError, OSError) as e:
        if not path.is_file():
            raise CheckpointError(f"cannot read checkpoint {path}: {e}") from None
        raise CheckpointError(
            f"checkpoint {path} is corrupt or not safetensors ({e}); delete it and restore from a peer or archive"
        ) from None
    return tensors, dict(metadata)


def pack_tensors(tensors: Mapping[str, torch.Tensor]) -> bytes:
    """Named tensors as one safetensors blob without a metadata block (a module's state on the wire)."""
    return st_save({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()})


def unpack_tensors(blob: bytes) -> dict[str, torch.Tensor]:
    """The tensors of a :func:`pack_tensors` blob; :class:`CheckpointError` for bytes that are not one."""
    try:
        return st_load(blob)
    except (SafetensorError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"not a safetensors blob ({e})") from None
