"""The outer step of DiLoCo, per module: pure torch numerics, identical bits on every replica.

- ``optimizer``: :class:`OuterOptimizer`, Nesterov SGD on a CPU fp32 global copy (Douillard et al. 2023).
- ``state``: :class:`ModuleState`, a module's replicated state (global copy, momentum, round) as
  state transfer serves it, and :func:`state_digest`, its fingerprint that matchmaking compares.

Imports nothing else of ``peer``.
"""

from peer.outer.optimizer import OuterOptimizer
from peer.outer.state import ModuleState, state_digest

__all__ = ["OuterOptimizer", "ModuleState", "state_digest"]
