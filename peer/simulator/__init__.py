"""``hivepath train-local``: K DiLoCo workers in one process, no network. Not the volunteer node.

- ``simulator``: :class:`DiLoCoSimulator` runs the lattice's paths as workers, averages each module with
  the same codec (``peer.compression.resolve_codec``) and reduction rule (``peer.averaging``) as the network and the same outer step
  (``peer.outer``); the golden fixtures in ``tests/golden`` pin its numerics.
- ``local_run``: :func:`train_local`, one ``hivepath train-local`` run (:class:`LocalRun`): train,
  evaluate, write the run directory.

Imports ``peer.averaging``, ``peer.compression`` and ``peer.outer``.
"""

from peer.simulator.local_run import LocalRun, LocalRunResult, train_local
from peer.simulator.simulator import DiLoCoSimulator, RoundStats, SimWorker

__all__ = ["DiLoCoSimulator", "RoundStats", "SimWorker", "LocalRun", "LocalRunResult", "train_local"]
