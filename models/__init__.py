"""The model side of hivepath: pure PyTorch, no networking.

- ``models.config``: typed, torch-free run and lattice config (the coordinator imports only this).
- ``models.errors``: user-fixable errors shared by every package.

Heavier parts (the lattice ``ModularLM``, tokenizers, data shards, routing, evaluation) are
imported from their own modules; this package's import pulls in no torch.
"""

from models.config import LatticeConfig, RunConfig
from models.errors import ConfigError, DataError, HivepathError

__all__ = ["LatticeConfig", "RunConfig", "ConfigError", "DataError", "HivepathError"]
