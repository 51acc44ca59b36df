"""The snapshot layout on disk: the one reader and writer of what training leaves behind.

Checkpoints of peers and of the archive, ``hivepath train-local``'s output, ``eval``, ``generate``
and ``export`` all go through this package, which is where these names are decided. Every file is written
atomically and every directory is built under a temporary name and renamed into place, so a crash or
a full disk leaves the old state or the complete new one. Three shapes:

A **run directory** (``hivepath train-local --out``; every snapshot is one too)::

    run.json                          summary: config, modules, paths, dense, data (a snapshot adds
                                      config_hash, rounds, round and groups)
    modules/{module_id}.safetensors   a module's weights by parameter name (metadata module_id, lattice_hash)
    outer/{module_id}.safetensors     snapshots only: its outer momentum, momentum.{i} in parameter order

A **checkpoint root** (a peer's ``WORK_DIR/checkpoints``, an archive's directory)::

    round-000042/                     one snapshot: a run directory
    LATEST                            the newest complete snapshot's name, written last

An **export** (``hivepath export --out``)::

    model.safetensors                 a path's tensors keyed {module_id}.{name}
    config.json                       the path's description (its keys are models.export's)
    tokenizer.json                    when the run's tokenizer needs a file

Modules:

- ``files``: :class:`CheckpointError`, atomic writes, safetensors and JSON read and written.
- ``layout``: file and group names, module files, ``run.json``, resolving a checkpoint root to its
  newest snapshot, installing a directory whole, exports.
- ``rounds``: :class:`CheckpointDir`, round-numbered snapshots with ``LATEST``, pruning, and one
  clear error for a full disk.
- ``summary``: :class:`SnapshotSummary`, what ``run.json`` holds (versioned), built by every writer and
  read by every reader.

A module's state travels between peers as a :func:`pack_tensors` blob: a message of ``net.proto``
(keys ``p.{i}``, ``m.{i}``, defined by ``peer.averaging.state_transfer``), not a directory.
"""

from models.checkpoint.files import (
    CheckpointError, atomic_write_bytes, fsync_dir, fsync_path, load_tensors, pack_tensors, read_json, save_tensors,
    unpack_tensors, write_json, write_tensors,
)
from models.checkpoint.layout import (
    EXPORT_CONFIG_FILE, EXPORT_MODEL_FILE, LATEST_FILE, PEER_CHECKPOINTS, RUN_FILE, group_file, install_directory,
    is_run_dir, load_module, module_file, module_group, module_groups, module_tensors, outer_group, read_export,
    read_export_config, read_latest, read_summary, resolve_snapshot, save_module, stage_directory, write_export,
    write_summary,
)
from models.checkpoint.rounds import CheckpointDir, Snapshot, snapshot_name
from models.checkpoint.summary import SUMMARY_VERSION, SnapshotSummary, SummaryError

__all__ = [
    "CheckpointError", "atomic_write_bytes", "fsync_dir", "fsync_path", "load_tensors", "pack_tensors", "read_json",
    "save_tensors", "unpack_tensors", "write_json", "write_tensors",
    "EXPORT_CONFIG_FILE", "EXPORT_MODEL_FILE", "LATEST_FILE", "PEER_CHECKPOINTS", "RUN_FILE", "group_file",
    "install_directory", "is_run_dir", "load_module", "module_file", "module_group", "module_groups",
    "module_tensors", "outer_group", "read_export", "read_export_config", "read_latest", "read_summary",
    "resolve_snapshot", "save_module", "stage_directory", "write_export", "write_summary",
    "CheckpointDir", "Snapshot", "snapshot_name", "SUMMARY_VERSION", "SnapshotSummary", "SummaryError",
]
