"""The model side of hivepath: pure PyTorch, no networking.

- ``models.config``: typed, torch-free run and lattice config (the coordinator imports this, with
  ``models.presets``, the named presets and the run-config file, and ``models.config_fields``, the
  field checks the config dataclasses run).
- ``models.codec_spec``: the pseudo-gradient codecs' names, block layout and exact sizes, torch-free
  (the run config validates with it, the coordinator estimates exchange bytes with it, and
  ``peer.averaging`` implements it).
- ``models.errors``: user-fixable errors shared by every package.
- ``models.settings``: the ``Setting`` type of every package's ``HIVEPATH_*`` table (stdlib only).
- ``models.strict_json``: the one JSON writer (non-finite floats become null; stdlib only).
- ``models.log_format``: every command's log lines, as text or JSON objects (stdlib only).
- ``models.lattice``: ``ModularLM``, the DiPaCo lattice of modules, and ``PathModel``.
- ``models.tokenizer``, ``models.corpus``, ``models.data``: tokenizers, the built-in corpus, streaming
  ``prepare`` into routed, memory-mapped shards, and ``Dataset``.
- ``models.routing``: prefix features, k-means, the ``Router`` that maps a prompt to a path.
- ``models.training``: the inner step's pieces (AdamW with warm-up, autocast).
- ``models.evaluate``: bits per byte, routed evaluation.
- ``models.checkpoint``: the snapshot layout on disk, its one reader and writer: atomic safetensors
  files, run directories, round snapshots with ``LATEST`` (``CheckpointDir``), exports.
- ``models.run_dir``: the one loader of run directories (train-local outputs, peer and archive snapshots).
- ``models.generate``, ``models.export``: sampling with routing, one path as a standalone model.

Only ``config`` (with ``codec_spec`` and ``config_fields``) and ``errors`` are imported here, so
``import models`` pulls in no torch.
"""

from models.config import LatticeConfig, RunConfig
from models.errors import ConfigError, DataError, HivepathError

__all__ = ["LatticeConfig", "RunConfig", "ConfigError", "DataError", "HivepathError"]
