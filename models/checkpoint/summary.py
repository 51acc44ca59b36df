"""A run directory's ``run.json``, as a type: :class:`SnapshotSummary`, its one builder for every
writer (a path peer's and a pipeline trainer's checkpoints, a stage server's, the archive's snapshots,
``hivepath train-local``'s output) and its one reader (``eval``, ``generate``, ``export``, resuming).

The file is versioned (``summary_version``): a reader takes every version up to
:data:`SUMMARY_VERSION` and refuses a newer one by name. What only some writers have is optional and
read with its default: a stage server's snapshot trains no path and names no dataset (``paths`` and
``data`` absent in the files it wrote before they were written by everyone), a file of no version is
version 1. Keys of a writer's own (``peer_id``, ``tokens``, ``eval`` ...) are kept in :attr:`extra`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

__all__ = ["SUMMARY_VERSION", "SnapshotSummary", "SummaryError"]

SUMMARY_VERSION = 1
"""The version of ``run.json`` this release writes, and the newest it reads."""

_KNOWN = ("summary_version", "config", "config_hash", "modules", "dense", "paths", "data")


class SummaryError(ValueError):
    """A ``run.json`` that is not a summary this release reads: the message says what is wrong."""


@dataclass(frozen=True)
class SnapshotSummary:
    """What a run directory holds: the run config, the modules present, the paths trained, the dataset."""

    config: Mapping[str, Any]
    """The run config (:meth:`models.config.RunConfig.to_dict`)."""
    modules: tuple[str, ...]
    """The modules whose files are in ``modules/``."""
    dense: bool
    """A 1x1 lattice: no routing."""
    config_hash: str = ""
    """The run config's content hash ('' in files that did not record it)."""
    paths: tuple[str, ...] = ()
    """The paths trained whole (``0,1``); none for a stage server, which serves one module."""
    data_dir: str = ""
    """The dataset directory the run trained on ('' when it named none)."""
    manifest_hash: str = ""
    """That dataset's manifest hash ('' when not recorded)."""
    extra: Mapping[str, Any] = field(default_factory=dict)
    """The writer's own keys (``round``, ``rounds``, ``peer_id``, ``tokens``, ``eval`` ...), kept as written."""
    version: int = SUMMARY_VERSION

    @classmethod
    def of(cls, cfg: Any, modules: Sequence[str], paths: Sequence[str] = (), data_dir: str = "",
           manifest_hash: str = "", dense: Optional[bool] = None, **extra: Any) -> "SnapshotSummary":
        """The summary of a run ``cfg`` (a :class:`models.config.RunConfig`) holding ``modules``;
        ``dense`` defaults to a lattice of one path."""
        return cls(config=cfg.to_dict(), config_hash=cfg.content_hash(), modules=tuple(modules),
                   dense=cfg.lattice.num_paths == 1 if dense is None else dense, paths=tuple(paths),
                   data_dir=data_dir, manifest_hash=manifest_hash, extra=dict(extra))

    def to_dict(self) -> dict[str, Any]:
        """The JSON object ``run.json`` holds (every writer's keys and this type's)."""
        return {**self.extra, "summary_version": self.version, "config": dict(self.config),
                "config_hash": self.config_hash, "modules": list(self.modules), "dense": self.dense,
                "paths": list(self.paths), "data": {"dir": self.data_dir, "manifest_hash": self.manifest_hash}}

    @classmethod
    def from_dict(cls, raw: Any) -> "SnapshotSummary":
        """Read a parsed ``run.json``; a :class:`SummaryError` saying what is missing or wrong."""
        if not isinstance(raw, Mapping):
            raise SummaryError("is not a JSON object")
        version = raw.get("summary_version", 1)
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise SummaryError(f"has summary_version {version!r}, not a version number")
        if version > SUMMARY_VERSION:
            raise SummaryError(f"is summary version {version}, written by a newer hivepath (this one reads up to "
                               f"{SUMMARY_VERSION}); upgrade hivepath to read it")
        missing = [k for k in ("config", "modules", "dense") if k not in raw]
        if missing:
            raise SummaryError(f"lacks {', '.join(missing)}")
        modules, paths, data = raw["modules"], raw.get("paths", []), raw.get("data", {})
        if not isinstance(modules, list) or not modules:
            raise SummaryError("lists no modules")
        if not isinstance(paths, list):
            raise SummaryError("'paths' must be a list")
        if not isinstance(data, Mapping) or ("data" in raw and ("dir" not in data or "manifest_hash" not in data)):
            raise SummaryError("'data' must hold 'dir' and 'manifest_hash'")
        if not isinstance(raw["config"], Mapping):
            raise SummaryError("'config' must be a JSON object")
        return cls(config=raw["config"], modules=tuple(str(m) for m in modules), dense=bool(raw["dense"]),
                   config_hash=str(raw.get("config_hash") or ""), paths=tuple(str(p) for p in paths),
                   data_dir=str(data.get("dir") or ""), manifest_hash=str(data.get("manifest_hash") or ""),
                   extra={k: v for k, v in raw.items() if k not in _KNOWN}, version=version)
