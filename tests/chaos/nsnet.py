"""A hivepath network whose processes live in network namespaces, for faults that need a real link.

Namespace 0 holds the coordinator; the others hold one peer (or the archive) each, all behind the
bridge of :class:`bench.netns.NetnsBridge`. A process in a namespace reaches only the namespace
addresses, so every peer listens on (and announces) its namespace address and dials the coordinator at
namespace 0's. The test process itself stays in the host namespace: it reads the coordinator's
``/status.json`` with ``curl`` run inside namespace 0, and everything else from the files the
processes write (progress JSON lines, checkpoints).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any, Optional, Sequence

from helpers.network import Network
from helpers.procs import hivepath_cmd, wait_for

__all__ = ["NsNetwork", "CHAOS_PREFIX", "CHAOS_SUBNET"]

CHAOS_PREFIX = "hpc"
"""Namespace names ``hpc-p0``...: distinct from the benchmarks' ``hpb`` so both can run at once."""
CHAOS_SUBNET = "10.78.0"


class NsNetwork(Network):
    """:class:`helpers.network.Network` with the coordinator in namespace 0 and peers in others."""

    def __init__(self, procs, root: Path, data_dir: Path, manifest_hash: str, bridge, **kw: Any):
        super().__init__(procs, root, data_dir, manifest_hash, **kw)
        self.bridge = bridge
        self.address = f"{bridge.address(0)}:{self.port}"
        self.where: dict[str, int] = {}
        """Process name -> namespace index."""

    def _in(self, index: int, cmd: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.bridge.where(index), *cmd]

    def start_coordinator(self) -> None:
        self.where["coordinator"] = 0
        self.procs.start("coordinator", self._in(0, hivepath_cmd(
            "coordinator", "serve", "--run-config", str(self.run_toml), "--db", str(self.root / "state.db"),
            "--host", self.bridge.address(0), "--port", str(self.port), "--http-port", str(self.http_port),
            "--token-file", str(self.root / "token"))), env=self.env)
        wait_for(lambda: self.status() is not None, 60, "the coordinator to answer")

    def common_in(self, index: int, listen: Sequence[str] = (), announce: Sequence[str] = ()) -> list[str]:
        """Flags every process in namespace ``index`` gets: it listens on its namespace address, or on
        ``listen`` (multiaddrs) and announces ``announce`` when given (e.g. a relay in front of it)."""
        return ["--coordinator", self.address, "--token-file", str(self.root / "token"), "--data", str(self.data_dir),
                "--host-maddrs", *(listen or [f"/ip4/{self.bridge.local_address(index)}/tcp/0"]),
                *(["--announce-maddrs", *announce] if announce else []), "--status-port", "0"]

    def start_peer_in(self, name: str, index: int, *extra: str, listen: Sequence[str] = (),
                      announce: Sequence[str] = ()) -> Path:
        """Start peer ``name`` in namespace ``index`` (>= 1); ``listen``, ``announce``: :meth:`common_in`."""
        work = self.root / name
        self.where[name] = index
        self.procs.start(name, self._in(index, hivepath_cmd(
            "peer", "join", "--work-dir", str(work), "--progress", "json", "--keep-checkpoints", "50",
            "--measure-seconds", "0.3", *self.common_in(index, listen, announce), *extra)), env=self.env)
        return work

    def start_archive_in(self, index: int, name: str = "archive") -> Path:
        """An archive in namespace ``index`` that scores snapshots as the archive does by default
        (``bench.chaos``'s set-up, measured so)."""
        directory = self.root / name
        self.where[name] = index
        self.procs.start(name, self._in(index, hivepath_cmd(*self.archive_args(directory, eval_docs=None),
                                                            *self.common_in(index))), env=self.env)
        return directory

    def status(self) -> Optional[dict[str, Any]]:
        """The coordinator's ``/status.json`` (fetched from inside namespace 0), or None."""
        url = f"http://{self.bridge.address(0)}:{self.http_port}/status.json"
        try:
            out = subprocess.run(self._in(0, ["curl", "-sf", "-m", "3", url]), capture_output=True, text=True,
                                 timeout=10)
        except subprocess.TimeoutExpired:
            return None
        if out.returncode != 0 or not out.stdout.strip():
            return None
        try:
            return json.loads(out.stdout)
        except ValueError:
            return None

    def client(self):
        raise RuntimeError("the coordinator lives in a namespace: use status() (its /status.json)")
