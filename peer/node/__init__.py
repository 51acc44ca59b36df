"""The volunteer node: the long-running peer processes and what keeps them alive.

- ``startup``: the one start-up and teardown of every long-running process (:class:`PeerStartup`:
  identity, status page, coordinator, DHT, averager, join; :func:`run_until_stopped`: drain signals
  and spot notices), and the :class:`NetworkOptions` they share.
- ``join``: :class:`PeerNode` (``hivepath peer join``): run spec, dataset, DHT, join, assignments, drain.
- ``run_data``: the run's dataset in a peer process (:class:`RunData`): found, prepared or fetched
  from seeders (only the assigned path's shards), seeded to others, kept under a disk budget; one
  place for ``peer join``, its stage server and the archive.
- ``trainer``: :class:`PathTrainer`, one path assignment (DiPaCo path mode) with its outer rounds.
- ``stage_runner``: a stage server's life and a stage trainer's loop (SWARM stage mode).
- ``archive``: :class:`ArchivePeer` (``hivepath archive``), follows every module and keeps snapshots.
- ``checkpoint``: module states in snapshots after each round (the layout and :class:`CheckpointDir`
  are ``models.checkpoint``'s, re-exported here).
- ``resources``: the device, usable memory and measured tokens/s a peer reports.
- ``progress``: :class:`PeerStatus` and its views (a rich table or JSON lines).
- ``local_status``: the local ``/status`` and ``/healthz`` page behind container health checks.
- ``spot``: preemption notices (:class:`SpotWatcher`) and ``python -m peer.node.spot -- CMD``.
- ``lifetime``: child processes that never outlive their parent (:class:`ChildProcesses`,
  :func:`watch_descendants`, :func:`stop_on_signals`), used by the start-up, the demo, the benchmarks
  and the test helpers; its watchdog removes what a stopped tree leaves in the temp dirs (``leftovers``:
  hivemind's p2p sockets, torch's shared-memory manager's).

Imports every package below it. Names are resolved on first use (PEP 562): the spot supervisor and the
health check run in the same images and must not pay for torch and hivemind they never use.
"""

from __future__ import annotations

import importlib
from typing import Any

_API = {
    "PeerNode": "join", "PeerOptions": "join", "ensure_dataset": "run_data", "RunData": "run_data", "DataOptions": "run_data", "UnsupportedAssignment": "join",
    "PathTrainer": "trainer", "StageTrainer": "stage_runner", "run_stage_server": "stage_runner",
    "run_stage_trainer": "stage_runner", "ArchiveOptions": "archive", "ArchivePeer": "archive",
    "CheckpointDir": "checkpoint", "CheckpointError": "checkpoint", "Snapshot": "checkpoint",
    "PeerStatus": "progress", "make_view": "progress", "LocalStatusServer": "local_status",
    "start_optional": "local_status", "SpotOptions": "spot", "SpotWatcher": "spot", "supervise": "spot",
    "ChildProcesses": "lifetime", "watch_descendants": "lifetime", "stop_on_signals": "lifetime",
    "NetworkOptions": "startup", "PeerStartup": "startup", "drain_signals": "startup", "run_until_stopped": "startup",
}

__all__ = sorted(_API)


def __getattr__(name: str) -> Any:
    if name not in _API:
        raise AttributeError(f"module 'peer.node' has no attribute {name!r}")
    return getattr(importlib.import_module(f"peer.node.{_API[name]}"), name)
