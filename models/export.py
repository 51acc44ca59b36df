"""One path of the lattice as a standalone model directory, and its loader.

A DiPaCo path (Douillard et al. 2024) is a plain transformer LM once its modules are chosen: the
embedding, one module per level, the head. ``export_path`` writes it as::

    model.safetensors   every tensor of the path's modules, keyed ``{module_id}.{name}``
    config.json         format, the lattice config and hash, the path, its module ids, the tokenizer
    tokenizer.json      the BPE tokenizer when the run uses one (byte-level needs no file)

The files are written and read by :mod:`models.checkpoint` (the one owner of the layout on disk): the
directory is built under a temporary name beside ``out`` and renamed at the end, so a crash leaves
either the earlier export or a complete new one. :func:`load_export` reads it back as a
:class:`~models.generate.PathSource`, so ``hivepath generate --from`` accepts an export too.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

from models.checkpoint import EXPORT_CONFIG_FILE as CONFIG_FILE
from models.checkpoint import EXPORT_MODEL_FILE as MODEL_FILE
from models.checkpoint import CheckpointError, read_export, read_export_config, write_export
from models.config import LatticeConfig, Path_, format_path, parse_path
from models.errors import ConfigError, DataError
from models.tokenizer import TOKENIZER_FILE, load_tokenizer, parse_tokenizer_spec

__all__ = ["EXPORT_FORMAT", "MODEL_FILE", "CONFIG_FILE", "ExportedModel", "export_path", "load_export", "is_export"]

log = logging.getLogger(__name__)

EXPORT_FORMAT = "hivepath-path/1"


def is_export(directory: Union[str, Path]) -> bool:
    """True when ``directory`` looks like an export (a ``config.json`` of this format)."""
    try:
        return read_export_config(directory).get("format") == EXPORT_FORMAT
    except (CheckpointError, AttributeError):
        return False


def export_path(run, path: Path_, out: Union[str, Path]) -> Path:
    """Write path ``path`` of ``run`` (a :class:`models.run_dir.RunDir` loaded with its data) to ``out``.

    Refuses a path outside the lattice (:class:`ConfigError`), a path whose modules the run lacks, and an
    ``out`` that exists and is not an earlier export (:class:`DataError`). Returns ``out``.
    """
    L: LatticeConfig = run.lattice
    path = L.check_path(tuple(path))
    path_model = run.path_model(path)  # DataError naming the complete paths when a module is absent
    out = Path(out)
    if out.exists() and not (out.is_dir() and (not any(out.iterdir()) or is_export(out))):
        raise DataError(f"{out} exists and is not a hivepath export; choose another --out")
    modules = {mid: module.state_dict() for mid, module in path_model.modules_by_id().items()}
    spec = run.cfg.data.tokenizer
    config = {
        "format": EXPORT_FORMAT,
        "lattice": L.to_dict(),
        "lattice_hash": L.content_hash(),
        "path": format_path(path),
        "module_ids": L.path_modules(path),
        "tokenizer": spec,
        "tokenizer_files": [] if parse_tokenizer_spec(spec)[0] == "bytes" else [TOKENIZER_FILE],
        "source": {"run_id": run.cfg.run_id, "config_hash": run.cfg.content_hash(), "seed": run.cfg.seed,
                   "manifest_hash": run.manifest_hash},
    }
    files = {name: Path(run.data_dir) / name for name in config["tokenizer_files"]}
    for src in files.values():
        if not src.exists():
            raise DataError(f"{src} is missing; pass --data DIR with the run's dataset (it holds the tokenizer)")
    write_export(out, modules, {"format": EXPORT_FORMAT, "path": config["path"], "lattice_hash": config["lattice_hash"]},
                 config, files)
    tensors = [t for state in modules.values() for t in state.values()]
    log.info("exported path %s (%d tensors, %s parameters) to %s", config["path"], len(tensors),
             f"{sum(t.numel() for t in tensors):,}", out)
    return out


@dataclass
class ExportedModel:
    """An exported path loaded for inference: one path, no router (it needs none)."""

    dir: Path
    config: dict[str, Any]
    lattice: LatticeConfig
    path: Path_
    model: Any  # models.lattice.ModularLM holding the path's modules
    tokenizer: Any
    router: Optional[Any] = None

    def available_paths(self) -> list[Path_]:
        return [self.path]

    def path_model(self, path: Path_):
        """The exported path's :class:`models.lattice.PathModel`; any other path is refused."""
        path = self.lattice.check_path(tuple(path))
        if path != self.path:
            raise DataError(
                f"{self.dir} is an export of path {format_path(self.path)} only; drop --path or pass "
                f"--path {format_path(self.path)}"
            )
        return self.model.path_model(path)


def _read_config(directory: Path) -> dict[str, Any]:
    path = directory / CONFIG_FILE
    try:
        config = read_export_config(directory)
    except CheckpointError as e:
        if not path.exists():
            raise DataError(f"{e}; pass a directory written by 'hivepath export'") from None
        raise DataError(f"{e}; export the path again") from None
    if not isinstance(config, dict) or config.get("format") != EXPORT_FORMAT:
        raise DataError(f"{path} is not a {EXPORT_FORMAT} export; export the path again with 'hivepath export'")
    missing = [k for k in ("lattice", "path", "module_ids", "tokenizer") if k not in config]
    if missing:
        raise DataError(f"{path} lacks {', '.join(missing)}; export the path again")
    return config


def load_export(directory: Union[str, Path]) -> ExportedModel:
    """Read an export written by :func:`export_path` (CPU weights, tokenizer from the directory)."""
    from models.lattice import ModularLM

    directory = Path(directory)
    if not directory.is_dir():
        raise DataError(f"{directory} does not exist or is not a directory; pass a directory written by 'hivepath export'")
    config = _read_config(directory)
    try:
        lattice = LatticeConfig(**config["lattice"])
        path = lattice.check_path(parse_path(str(config["path"]), lattice.levels))
    except (ConfigError, TypeError) as e:
        raise DataError(f"{directory / CONFIG_FILE} does not describe a valid path ({e}); export it again") from None
    module_ids = lattice.path_modules(path)
    if list(config["module_ids"]) != module_ids:
        raise DataError(f"{directory / CONFIG_FILE} lists modules {config['module_ids']}, not {module_ids}; export it again")
    by_module, meta = read_export(directory)
    if meta.get("lattice_hash") != lattice.content_hash():
        raise CheckpointError(f"{directory / MODEL_FILE} belongs to lattice {meta.get('lattice_hash')}, not "
                              f"{lattice.content_hash()}; export the path again")
    model = ModularLM(lattice, module_ids=module_ids)
    foreign = sorted(set(by_module) - set(module_ids))
    if foreign:
        raise DataError(f"{directory / MODEL_FILE} holds tensors of {', '.join(foreign)}, no module on the path; "
                        "export it again")
    for mid in module_ids:
        try:
            model.load_module_state(mid, by_module.get(mid, {}))
        except RuntimeError as e:
            raise DataError(f"{directory / MODEL_FILE} does not fit module {mid} ({e}); export it again") from None
    model.eval()
    for name in config.get("tokenizer_files", []):
        if not (directory / str(name)).exists():
            raise DataError(f"{directory / str(name)} is missing (the tokenizer); export the path again")
    tokenizer = load_tokenizer(str(config["tokenizer"]), directory)
    if tokenizer.vocab_size != lattice.vocab_size:
        raise DataError(f"{directory}'s tokenizer has {tokenizer.vocab_size} ids but the model {lattice.vocab_size}; "
                        "export the path again")
    return ExportedModel(directory, config, lattice, path, model, tokenizer)
