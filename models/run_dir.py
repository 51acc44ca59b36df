"""The one loader of run directories: what a trained run left on disk, ready to use.

A run directory (written by ``hivepath train-local``, and later by peers and the archive) holds::

    run.json                       summary: config, modules present, paths trained, dense, data
    modules/{module_id}.safetensors  one module's weights

(the layout is :mod:`models.checkpoint`'s, which reads and writes these files; a checkpoint root of
a peer or the archive resolves to its newest snapshot, itself a run directory).

Its dataset directory (recorded in ``run.json`` as ``data.dir``) holds the tokenizer and the DiPaCo
prefix router (Douillard et al. 2024, section 2.2) that ``generate`` needs to pick a path for a prompt.
Every problem (missing directory, torn ``run.json``, a module file that is absent, corrupt or of another
lattice, a dataset that moved or changed) raises a :class:`~models.errors.HivepathError` naming the fix.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

from models.checkpoint import RUN_FILE, CheckpointError, load_module, module_file, read_summary, resolve_snapshot
from models.checkpoint.summary import SnapshotSummary, SummaryError
from models.config import Path_, RunConfig, format_path, parse_path
from models.errors import ConfigError, DataError

__all__ = ["RunDir", "load_run_dir", "no_snapshot_yet"]

log = logging.getLogger(__name__)

@dataclass
class RunDir:
    """A loaded run directory: its summary, config, the modules present, and (optionally) its data.

    ``model`` is a :class:`models.lattice.ModularLM` on CPU holding exactly the modules present in
    ``modules/``. ``router`` and ``tokenizer`` come from the run's dataset; they are ``None`` when the
    run was loaded with ``with_data=False``. A dense run (1x1 lattice) has no use for a router.
    """

    dir: Path
    summary: dict[str, Any]
    cfg: RunConfig
    model: Any  # models.lattice.ModularLM (kept lazy so this module's annotations import no torch)
    trained_paths: list[Path_]
    dense: bool
    data_dir: Path
    manifest_hash: str
    router: Any = None  # Optional[models.routing.Router]
    tokenizer: Any = None  # Optional[models.tokenizer.Tokenizer]

    @property
    def lattice(self):
        """The run's :class:`~models.config.LatticeConfig`."""
        return self.cfg.lattice

    @property
    def module_ids(self) -> list[str]:
        """Ids of the modules present, in lattice order."""
        return list(self.model.mods.keys())

    def as_tuple(self) -> tuple[dict[str, Any], RunConfig, Any]:
        """``(summary, cfg, model)``: what ``hivepath.cmd_eval.load_run`` returns."""
        return self.summary, self.cfg, self.model

    def available_paths(self) -> list[Path_]:
        """Every path of the lattice whose modules are all present here, in lexicographic order."""
        present = set(self.module_ids)
        return [p for p in self.lattice.paths() if all(m in present for m in self.lattice.path_modules(p))]

    def missing_modules(self, path: Path_) -> list[str]:
        """Modules of ``path`` that this run directory does not hold."""
        present = set(self.module_ids)
        return [m for m in self.lattice.path_modules(self.lattice.check_path(path)) if m not in present]

    def path_model(self, path: Path_):
        """The path as a :class:`models.lattice.PathModel` sharing this run's weights.

        Raises :class:`DataError` when a module of the path is absent (the run never trained it).
        """
        path = self.lattice.check_path(tuple(path))
        missing = self.missing_modules(path)
        if missing:
            have = ", ".join(format_path(p) for p in self.available_paths()) or "none"
            raise DataError(
                f"path {format_path(path)} needs module(s) {', '.join(missing)} that {self.dir} does not hold; "
                f"choose one of the complete paths: {have}"
            )
        return self.model.path_model(path)


def no_snapshot_yet(directory: Path) -> str:
    """What to say when ``directory`` is an archive's or a peer's directory (its identity key is there)
    that holds no snapshot yet, else ''."""
    if not (Path(directory) / "identity.key").exists():
        return ""
    return (f"{directory} is an archive or peer directory that holds no snapshot yet: one is written once a "
            "module's round has been fetched from its holders (the archive logs 'archived MODULE at round R'); "
            "try again then")


def _read_summary(run_dir: Path) -> dict[str, Any]:
    if not run_dir.exists():
        raise DataError(f"run directory {run_dir} does not exist; pass --from DIR written by 'hivepath train-local'")
    if not run_dir.is_dir():
        raise DataError(f"{run_dir} is not a directory; pass --from DIR written by 'hivepath train-local'")
    path = run_dir / RUN_FILE
    try:
        summary = read_summary(run_dir)
    except CheckpointError as e:
        if not path.exists():
            raise DataError(no_snapshot_yet(run_dir) or f"{e}; pass a directory written by 'hivepath train-local'") from None
        raise DataError(f"{e}; restore it or re-run training") from None
    try:
        return SnapshotSummary.from_dict(summary).to_dict()
    except SummaryError as e:
        raise DataError(f"{path} {e}; restore it or re-run training") from None


def _load_config(summary: dict[str, Any], path: Path) -> RunConfig:
    try:
        return RunConfig.from_dict(summary["config"])
    except ConfigError as e:
        raise DataError(f"{path} holds an invalid run config ({e}); it was written by another version (re-run training)") from None


def load_run_dir(
    run_dir: Union[str, Path], data_dir: Union[str, Path, None] = None, with_data: bool = True
) -> RunDir:
    """Load a run directory: summary, :class:`RunConfig`, a CPU ``ModularLM`` of the modules present.

    ``data_dir`` overrides the dataset directory recorded in ``run.json`` (a run moved to another
    machine). With ``with_data`` the dataset is opened for its tokenizer and router, and its manifest
    hash must equal the run's (:class:`models.data.DatasetMismatch` otherwise, exit code 4).
    """
    from models.lattice import ModularLM

    run_dir = resolve_snapshot(Path(run_dir))
    summary = _read_summary(run_dir)
    run_file = run_dir / RUN_FILE
    cfg = _load_config(summary, run_file)
    L = cfg.lattice
    modules = [str(m) for m in summary["modules"]]
    unknown = [m for m in modules if m not in set(L.module_ids())]
    if unknown:
        raise DataError(f"{run_file} lists module(s) {', '.join(unknown)} that are not in its lattice; restore run.json")
    absent = [m for m in modules if not module_file(run_dir, m).exists()]
    if absent:
        raise DataError(
            f"{run_dir} lacks the checkpoint(s) of {', '.join(absent)} listed in {RUN_FILE} "
            f"(expected {module_file(run_dir, absent[0])}); restore the modules/ directory or re-run training"
        )
    try:
        trained = [L.check_path(parse_path(str(p), L.levels)) for p in summary["paths"]]
    except ConfigError as e:
        raise DataError(f"{run_file} lists a path that does not fit its lattice ({e}); restore run.json") from None
    model = ModularLM(L, seed=cfg.seed, module_ids=modules)
    lattice_hash = L.content_hash()
    for mid in modules:
        try:
            model.load_module_state(mid, load_module(run_dir, mid, lattice_hash))
        except RuntimeError as e:  # load_state_dict: names or shapes differ
            raise DataError(f"{module_file(run_dir, mid)} does not fit module {mid} ({e}); restore it or re-run training") from None
    model.eval()
    data = summary["data"]
    rd = RunDir(
        dir=run_dir,
        summary=summary,
        cfg=cfg,
        model=model,
        trained_paths=trained,
        dense=bool(summary["dense"]),
        data_dir=Path(data_dir) if data_dir is not None else Path(str(data["dir"])),
        manifest_hash=str(data["manifest_hash"]),
    )
    if with_data:
        _attach_data(rd, explicit=data_dir is not None)
    log.info("loaded %s: %d module(s), %d complete path(s)", run_dir, len(modules), len(rd.available_paths()))
    return rd


def _attach_data(rd: RunDir, explicit: bool) -> None:
    """Open the run's dataset for its tokenizer and router, refusing one with another manifest."""
    from models.data import Dataset, DatasetMismatch

    if not explicit and not str(rd.summary["data"].get("dir") or ""):
        which = f"manifest {rd.manifest_hash}" if rd.manifest_hash else "its manifest hash is not recorded either"
        raise DataError(f"{rd.dir / RUN_FILE} names no dataset directory (a run or archive started without --data); "
                        f"pass --data DIR with the dataset the run trained on ({which}) for its tokenizer and router")
    if not rd.data_dir.exists():
        how = "pass --data DIR" if not explicit else "check --data"
        raise DataError(
            f"the run's dataset {rd.data_dir} does not exist; {how} with the dataset the run trained on "
            f"(manifest {rd.manifest_hash}) for its tokenizer and router"
        )
    ds = Dataset(rd.data_dir)
    if not rd.manifest_hash:  # an old snapshot of a run that pinned no dataset: the one given is trusted
        log.warning("%s records no manifest hash; using %s (manifest %s) as the run's dataset", rd.dir / RUN_FILE,
                    rd.data_dir, ds.manifest_hash)
        rd.manifest_hash = ds.manifest_hash
    if ds.manifest_hash != rd.manifest_hash:
        raise DatasetMismatch(
            f"dataset {rd.data_dir} has manifest {ds.manifest_hash} but the run trained on {rd.manifest_hash}; "
            "pass --data DIR with the run's dataset"
        )
    if ds.manifest.get("vocab_size") != rd.lattice.vocab_size:
        raise DatasetMismatch(
            f"dataset {rd.data_dir} has {ds.manifest.get('vocab_size')} token ids but the run's model has "
            f"{rd.lattice.vocab_size}; pass --data DIR with the run's dataset"
        )
    rd.tokenizer = ds.tokenizer
    rd.router = None if rd.dense else ds.router
    if rd.router is not None and (rd.router.levels, rd.router.modules) != (rd.lattice.levels, rd.lattice.modules_per_level):
        raise DatasetMismatch(
            f"the router of {rd.data_dir} is for a {rd.router.levels}x{rd.router.modules} lattice but the run is "
            f"{rd.lattice.levels}x{rd.lattice.modules_per_level}; pass --data DIR with the run's dataset"
        )

