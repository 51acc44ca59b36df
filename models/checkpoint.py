"""Durable tensor files: safetensors written atomically (temp file, fsync, rename).

Spot machines vanish mid-write; a checkpoint is therefore either the old file or the complete new
one, never a torn mix. A file that cannot be parsed raises :class:`CheckpointError`.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Union

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from models.errors import HivepathError

__all__ = ["CheckpointError", "save_tensors", "load_tensors", "atomic_write_bytes", "module_file", "save_module", "load_module"]


class CheckpointError(HivepathError):
    """A checkpoint file is missing, truncated or not safetensors."""


def atomic_write_bytes(path: Union[str, Path], data: bytes) -> None:
    """Write ``data`` to ``path`` via a temporary file in the same directory, fsync'd, then renamed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def save_tensors(path: Union[str, Path], tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """Save named tensors (moved to CPU, made contiguous) with string metadata, atomically."""
    cpu = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    bad = [k for k, v in metadata.items() if not isinstance(k, str) or not isinstance(v, str)]
    if bad:
        raise TypeError(f"checkpoint metadata must map str to str; offending keys: {bad}")
    atomic_write_bytes(path, st_save(cpu, metadata=dict(metadata)))


def load_tensors(path: Union[str, Path]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Read a file written by :func:`save_tensors`: ``(tensors, metadata)`` on CPU."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} does not exist; check the path or re-run training") from None
    except OSError as e:
        raise CheckpointError(f"cannot read checkpoint {path}: {e}") from None
    try:
        tensors = st_load(data)
        header_len = int.from_bytes(data[:8], "little")  # safetensors: u64 header length, JSON header
        header = json.loads(data[8 : 8 + header_len])
        metadata = header.get("__metadata__", {}) or {}
    except (SafetensorError, ValueError, UnicodeDecodeError, OverflowError) as e:
        raise CheckpointError(
            f"checkpoint {path} is corrupt or not safetensors ({e}); delete it and restore from a peer or archive"
        ) from None
    return tensors, dict(metadata)


def module_file(directory: Union[str, Path], module_id: str) -> Path:
    """Where a run directory keeps one module's checkpoint: ``DIR/modules/{module_id}.safetensors``."""
    return Path(directory) / "modules" / f"{module_id}.safetensors"


def save_module(directory: Union[str, Path], module_id: str, state: dict[str, torch.Tensor],
                lattice_hash: str, **metadata: str) -> Path:
    """Write one module's state under ``directory`` with its id and the lattice hash as metadata."""
    path = module_file(directory, module_id)
    save_tensors(path, state, {"module_id": module_id, "lattice_hash": lattice_hash, **metadata})
    return path


def load_module(directory: Union[str, Path], module_id: str, lattice_hash: str) -> dict[str, torch.Tensor]:
    """Read one module's state, refusing a checkpoint of another module or another lattice."""
    path = module_file(directory, module_id)
    tensors, meta = load_tensors(path)
    if meta.get("module_id") != module_id:
        raise CheckpointError(f"{path} holds module '{meta.get('module_id')}', not '{module_id}'; restore the right file")
    if meta.get("lattice_hash") != lattice_hash:
        raise CheckpointError(
            f"{path} was trained with lattice {meta.get('lattice_hash')}, not {lattice_hash}; use the run's config"
        )
    return tensors
