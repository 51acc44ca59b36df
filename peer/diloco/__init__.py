"""DiLoCo per module as an optimizer-like wrapper, so training loops stay plain PyTorch.

- ``optimizer``: :class:`DiLoCoOptimizer` (H inner steps, then one outer round per module, optionally
  overlapped with the next round's compute); it resolves the run's codec once and passes it down,
  and ramps a newcomer's weight in its groups up over its first rounds (:func:`ramp_factor`).
- ``held_module``: one held module's state and the arithmetic of its outer round (delta, error
  feedback, outer step, adopting another peer's state).
- ``reports``: :class:`RoundReport` and :class:`ModuleReport`, what a round returns.
- ``link_rates``: :class:`LinkRates`, the peer's upload and download rates measured from its rounds.
- ``plans``: :class:`PlanBook`, the coordinator's exchange plans (per module, H and codec from an
  agreed round on) that the optimizer follows.
- ``resync``: bringing a module back in line with its group after a missed round or a lost fork
  (:func:`install_resync`, :func:`resync_after_round`).

Imports ``peer.averaging``, ``peer.compression`` and ``peer.outer``.
"""

from peer.diloco.link_rates import LinkRates
from peer.diloco.optimizer import JOIN_RAMP_ROUNDS, DiLoCoOptimizer, ramp_factor
from peer.diloco.plans import PlanBook
from peer.diloco.reports import ModuleReport, RoundReport
from peer.diloco.resync import FetchState, install_resync, resync_after_round, resync_module

__all__ = [
    "DiLoCoOptimizer", "JOIN_RAMP_ROUNDS", "ramp_factor", "LinkRates", "PlanBook", "ModuleReport", "RoundReport",
    "FetchState", "install_resync", "resync_after_round", "resync_module",
]
