"""``hivepath train-local``: K DiLoCo workers in one process, no network. Not the volunteer node.

- ``simulator``: :class:`DiLoCoSimulator` runs the lattice's paths as workers, averages each module with
  the same codec and reduction rule as the network (``peer.averaging``) and the same outer step
  (``peer.outer``); the golden fixtures in ``tests/golden`` pin its numerics.

Imports ``peer.averaging`` and ``peer.outer``.
"""

from peer.simulator.simulator import DiLoCoSimulator, RoundStats, SimWorker

__all__ = ["DiLoCoSimulator", "RoundStats", "SimWorker"]
