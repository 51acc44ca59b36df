"""The tests' local network: :func:`peer.localnet.preset_network` on the tiny preset, with the tests'
defaults (a 12 s round deadline, 10 inner steps, run id ``itest``); every process is the installed
``hivepath`` command, and the ``procs`` fixture reaps them at the end of the test."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from peer.localnet import LocalNetwork, ProcessGroup, preset_network

__all__ = ["HISTORY_RUN_TOML", "tiny_network"]


def tiny_network(procs: ProcessGroup, root: Path, data_dir: Path, manifest_hash: str, inner_steps: int = 10,
                 lease_timeout: float = 8.0, run_id: str = "itest", share_cores: bool = False,
                 corpus: str = "default", round_timeout: float = 12.0, lattice: Mapping[str, Any] = {},
                 outer: Mapping[str, Any] = {}, coordinator: Mapping[str, Any] = {}, bridge: Any = None) -> LocalNetwork:
    """A network training the tiny preset on ``data_dir``: ``lattice`` and ``outer`` override the run's
    sections, ``coordinator`` adds to its ``[coordinator]`` table; ``bridge`` places the processes in
    network namespaces (:class:`peer.localnet.LocalNetwork`)."""
    return preset_network(procs, root, data_dir, manifest_hash, preset="tiny", run_id=run_id, inner_steps=inner_steps,
                          round_timeout=round_timeout, corpus=corpus, lattice=lattice, outer=outer,
                          lease_timeout=lease_timeout, coordinator=coordinator, share_cores=share_cores, bridge=bridge)


HISTORY_RUN_TOML = """
preset = "tiny"
[coordinator]
lease_timeout = 30.0
heartbeat_interval = 0.5
flush_interval = 0.2
tick_interval = 0.2
history_interval = 0.2
"""
"""A run config for coordinator-only tests of the status page's history: samples every 0.2 s."""
