"""Where things lie in a run directory and an export, and how a directory is installed whole.

The names of files and groups, the metadata that ties a module file to its module and lattice, and
the way a checkpoint root or a peer's work directory resolves to its newest snapshot are decided here
and nowhere else (the map is in :mod:`models.checkpoint`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import torch

from models.checkpoint.files import (
    CheckpointError, PathLike, fsync_dir, fsync_path, load_tensors, read_json, save_tensors, write_json,
)

__all__ = [
    "RUN_FILE", "LATEST_FILE", "PEER_CHECKPOINTS", "EXPORT_MODEL_FILE", "EXPORT_CONFIG_FILE",
    "module_group", "outer_group", "group_file", "module_file", "save_module", "load_module", "module_groups",
    "module_tensors", "write_summary", "read_summary", "is_run_dir", "read_latest", "resolve_snapshot",
    "stage_directory", "install_directory", "write_export", "read_export_config", "read_export",
]

RUN_FILE = "run.json"
LATEST_FILE = "LATEST"
PEER_CHECKPOINTS = "checkpoints"
"""The checkpoint root inside a peer's work directory."""
EXPORT_MODEL_FILE = "model.safetensors"
EXPORT_CONFIG_FILE = "config.json"
_SUFFIX = ".safetensors"


# -- run directories --------------------------------------------------------------------------


def module_group(module_id: str) -> str:
    """The group (file stem inside a run directory) of a module's weights: ``modules/{id}``."""
    return f"modules/{module_id}"


def outer_group(module_id: str) -> str:
    """The group of a module's outer momentum in a snapshot: ``outer/{id}``."""
    return f"outer/{module_id}"


def group_file(directory: PathLike, group: str) -> Path:
    """The file of a group: ``DIR/{group}.safetensors``."""
    return Path(directory) / f"{group}{_SUFFIX}"


def module_file(directory: PathLike, module_id: str) -> Path:
    """Where a run directory keeps one module's checkpoint: ``DIR/modules/{module_id}.safetensors``."""
    return group_file(directory, module_group(module_id))


def _module_metadata(module_id: str, lattice_hash: str) -> dict[str, str]:
    return {"module_id": module_id, "lattice_hash": lattice_hash}


def save_module(directory: PathLike, module_id: str, state: Mapping[str, torch.Tensor],
                lattice_hash: str, **metadata: str) -> Path:
    """Write one module's state under ``directory`` with its id and the lattice hash as metadata."""
    path = module_file(directory, module_id)
    save_tensors(path, state, {**_module_metadata(module_id, lattice_hash), **metadata})
    return path


def load_module(directory: PathLike, module_id: str, lattice_hash: str) -> dict[str, torch.Tensor]:
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


def module_groups(module_id: str, names: Sequence[str], params: Sequence[torch.Tensor],
                  momentum: Sequence[torch.Tensor], lattice_hash: str
                  ) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, dict[str, str]]]:
    """A module's global weights (by parameter name) and outer momentum (``momentum.{i}`` in parameter
    order) as snapshot groups, with the weights' metadata: ``(groups, group_metadata)``."""
    groups = {module_group(module_id): dict(zip(names, params)),
              outer_group(module_id): {f"momentum.{i}": m for i, m in enumerate(momentum)}}
    return groups, {module_group(module_id): _module_metadata(module_id, lattice_hash)}


def module_tensors(groups: Mapping[str, Mapping[str, torch.Tensor]], module_id: str, names: Sequence[str]
                   ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """A module's ``(params, momentum)`` in parameter order from the groups :func:`module_groups` made."""
    weights, outer = groups[module_group(module_id)], groups[outer_group(module_id)]
    return [weights[n] for n in names], [outer[f"momentum.{i}"] for i in range(len(names))]


def write_summary(directory: PathLike, summary: Mapping[str, Any]) -> None:
    """Write ``run.json``; written last, since a directory without it is not a finished run."""
    write_json(Path(directory) / RUN_FILE, dict(summary))


def read_summary(directory: PathLike) -> Any:
    """The parsed ``run.json`` of a run directory (its content is the caller's to check)."""
    return read_json(Path(directory) / RUN_FILE)


def is_run_dir(directory: PathLike) -> bool:
    """True when ``directory`` holds a ``run.json`` (a run directory or one snapshot)."""
    return (Path(directory) / RUN_FILE).exists()


def read_latest(root: PathLike) -> Optional[str]:
    """The snapshot name a checkpoint root's ``LATEST`` holds, or None."""
    try:
        return (Path(root) / LATEST_FILE).read_text().strip() or None
    except OSError:
        return None


def resolve_snapshot(directory: PathLike) -> Path:
    """A checkpoint root of a peer or an archive (``LATEST`` naming its newest snapshot), or a peer's
    work directory holding one, resolves to that snapshot, itself a run directory; any other directory
    is returned as it is."""
    directory = Path(directory)
    if is_run_dir(directory):
        return directory
    name = read_latest(directory)
    if name and is_run_dir(directory / name):
        return directory / name
    if (directory / PEER_CHECKPOINTS / LATEST_FILE).is_file():
        return resolve_snapshot(directory / PEER_CHECKPOINTS)
    return directory


# -- directories written whole ------------------------------------------------------------------


def stage_directory(final: PathLike) -> Path:
    """A fresh temporary directory beside ``final`` (``.{name}-*``) to build ``final`` in."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))


def install_directory(staged: PathLike, final: PathLike) -> Optional[Path]:
    """Rename the complete ``staged`` directory onto ``final`` (renames need no space).

    An existing ``final`` is moved aside first and returned, for the caller to delete once the change
    is committed or to put back; None when there was none. On failure ``final`` is as it was.
    """
    staged, final = Path(staged), Path(final)
    displaced = None
    if final.exists():
        displaced = Path(f"{staged}.replaced")
        os.replace(final, displaced)
    try:
        os.replace(staged, final)
    except BaseException:
        if displaced is not None:
            os.replace(displaced, final)
        raise
    fsync_dir(final.parent)
    return displaced


# -- exports ----------------------------------------------------------------------------------


def write_export(out: PathLike, modules: Mapping[str, Mapping[str, torch.Tensor]], metadata: Mapping[str, str],
                 config: Mapping[str, Any], files: Mapping[str, PathLike]) -> Path:
    """Write an export to ``out``: ``modules``' tensors keyed ``{module_id}.{name}`` with ``metadata``
    in ``model.safetensors``, ``config`` as ``config.json`` and ``files`` (name -> source) copied beside
    them; built in a staged directory and installed whole, replacing ``out`` (the caller checks it may)."""
    out = Path(out)
    tensors = {f"{mid}.{name}": t for mid, state in modules.items() for name, t in state.items()}
    staged = stage_directory(out)
    try:
        save_tensors(staged / EXPORT_MODEL_FILE, tensors, metadata)
        for name, src in files.items():
            shutil.copyfile(src, staged / name)
            fsync_path(staged / name)
        write_json(staged / EXPORT_CONFIG_FILE, dict(config))
        displaced = install_directory(staged, out)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    if displaced is not None:
        shutil.rmtree(displaced, ignore_errors=True)
    return out


def read_export_config(directory: PathLike) -> Any:
    """The parsed ``config.json`` of an export (its content is the caller's to check)."""
    return read_json(Path(directory) / EXPORT_CONFIG_FILE)


def read_export(directory: PathLike) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, str]]:
    """An export's tensors by module (``{module_id: {name: tensor}}``) and the file's metadata."""
    path = Path(directory) / EXPORT_MODEL_FILE
    tensors, metadata = load_tensors(path)
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        mid, _, name = key.partition(".")
        if not name:
            raise CheckpointError(f"{path} holds tensor '{key}' of no module; export the path again")
        modules.setdefault(mid, {})[name] = tensor
    return modules, metadata
