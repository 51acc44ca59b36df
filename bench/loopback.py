"""A hivepath network of real processes on loopback, for benchmarks: a coordinator and ``hivepath
peer join`` peers, each the installed command in its own session, stopped with the benchmark however
it ends (:class:`peer.node.lifetime.ChildProcesses`; :func:`bench.common.run_main` turns SIGTERM and
SIGHUP into the ``KeyboardInterrupt`` that runs :meth:`LoopbackNetwork.close`).

The peers print ``--progress json`` events, read back by :meth:`LoopbackNetwork.events`; the
coordinator's ``/status.json`` is read by :meth:`LoopbackNetwork.status`.
"""

from __future__ import annotations

import json
import os
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable, Optional, TypeVar

__all__ = ["LoopbackNetwork", "wait_until", "prepared_corpus"]

T = TypeVar("T")

TOKEN = "bench-token-0123456789"


def wait_until(condition: Callable[[], T], timeout: float, what: str, interval: float = 0.5) -> T:
    """Poll ``condition`` until it returns something truthy; ``TimeoutError`` naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def prepared_corpus(out: Path, levels: int = 2, modules: int = 2):
    """The built-in corpus prepared for a ``levels x modules`` lattice (byte tokenizer), kept in ``out``."""
    from models.data import prepared

    return prepared(out, levels, modules, "bytes")


class LoopbackNetwork:
    """A coordinator on ``127.0.0.1`` and peers joining it, one thread of torch each
    (``HIVEPATH_THREADS=1``), their DHTs on loopback with ephemeral ports."""

    def __init__(self, root: Path, run_toml: str, data_dir: Path):
        from peer.demo.launcher import _free_port
        from peer.node.lifetime import ChildProcesses

        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "token").write_text(TOKEN)
        (self.root / "run.toml").write_text(run_toml)
        self.data_dir = Path(data_dir)
        self.port, self.http_port = _free_port(), _free_port()
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", "HIVEPATH_THREADS": "1",
                    "HIVEMIND_MEMORY_SHARING_STRATEGY": "file_descriptor"}
        self.procs = ChildProcesses(self.root / "logs")
        self.peers: list[str] = []

    def start_coordinator(self, timeout: float = 120.0) -> None:
        from peer.demo.launcher import _hivepath

        self.procs.start("coordinator", [
            *_hivepath(), "coordinator", "serve", "--run-config", str(self.root / "run.toml"),
            "--db", str(self.root / "state.db"), "--host", "127.0.0.1", "--port", str(self.port),
            "--http-port", str(self.http_port), "--token-file", str(self.root / "token")], env=self.env)
        wait_until(lambda: self.status() is not None, timeout, "the coordinator to answer")

    def start_peer(self, name: str, *extra: str) -> None:
        """``hivepath peer join`` as ``name``, with ``extra`` flags after the network's own."""
        from peer.demo.launcher import _hivepath

        self.procs.start(name, [
            *_hivepath(), "peer", "join", "--work-dir", str(self.root / name), "--progress", "json",
            "--measure-seconds", "0.3", "--coordinator", f"127.0.0.1:{self.port}",
            "--token-file", str(self.root / "token"), "--data", str(self.data_dir),
            "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--status-port", "0", *extra], env=self.env)
        self.peers.append(name)

    def exited(self) -> list[str]:
        """Names of the processes that have exited."""
        return [n for n, p in self.procs.procs.items() if p.poll() is not None]

    def log(self, name: str) -> str:
        path = self.root / "logs" / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def events(self, name: str, kind: Optional[str] = None) -> list[dict]:
        """The JSON objects ``name`` printed one per line (``kind``: only events of that kind)."""
        out = []
        for line in self.log(name).splitlines():
            if line.startswith("{"):
                try:
                    obj = json.loads(line)
                except ValueError:  # a line cut short
                    continue
                if kind is None or obj.get("event") == kind:
                    out.append(obj)
        return out

    def status(self) -> Optional[dict[str, Any]]:
        """The coordinator's ``/status.json``, or None when it does not answer."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/status.json", timeout=5) as r:
                return json.loads(r.read())
        except (OSError, ValueError):
            return None

    def close(self, timeout: float = 30.0) -> dict[str, Optional[int]]:
        """Stop the peers (SIGTERM: a drain), then the coordinator; SIGKILL whatever is left."""
        codes = self.procs.stop(self.peers, timeout=timeout)
        codes.update(self.procs.stop(None, timeout=10.0))
        return codes
