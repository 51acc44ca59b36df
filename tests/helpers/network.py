"""A whole hivepath network of real processes for tests: coordinator, archive and peers on loopback.

Every process is the installed ``hivepath`` command; the test only starts, signals and reads them.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any, Optional

from helpers.procs import ProcessGroup, free_port, hivepath_cmd, wait_for

__all__ = ["Network", "TINY_RUN", "first_loss", "loss_thirds"]

TINY_RUN = """preset = "tiny"
run_id = "{run_id}"
[outer]
inner_steps = {inner_steps}
round_timeout = {round_timeout}
{outer_extra}
[data]
manifest_hash = "{manifest_hash}"
corpus = "{corpus}"
[coordinator]
lease_timeout = {lease_timeout}
heartbeat_interval = 1.0
restart_grace = 5.0
{extra}"""



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

class Network:
    """Start and drive a small network; ``procs`` reaps every process at the end of the test."""

    def __init__(self, procs: ProcessGroup, root: Path, data_dir: Path, manifest_hash: str,
                 inner_steps: int = 10, lease_timeout: float = 8.0, run_id: str = "itest", extra_toml: str = "",
                 share_cores: bool = False, corpus: str = "default", round_timeout: float = 12.0,
                 outer_extra: str = ""):
        """``extra_toml``: more run-config tables appended to the tiny run (e.g. a ``[lattice]``).
        ``share_cores``: peers get no ``HIVEPATH_THREADS`` and divide the cores among themselves, in a
        registry of this network's own (``peer.node.machine_share``); else one thread each.
        ``corpus``: the run's ``[data] corpus`` (a directory no peer has makes peers fetch the data).
        ``round_timeout``: the ``[outer]`` round deadline; ``outer_extra``: more ``[outer]`` lines."""
        self.procs = procs
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.data_dir = data_dir
        self.token = "test-token-0123456789"
        (self.root / "token").write_text(self.token)
        self.run_toml = self.root / "run.toml"
        self.run_toml.write_text(TINY_RUN.format(run_id=run_id, inner_steps=inner_steps, manifest_hash=manifest_hash,
                                                 lease_timeout=lease_timeout, extra=extra_toml, corpus=corpus,
                                                 round_timeout=round_timeout, outer_extra=outer_extra))
        self.port = free_port()
        self.http_port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.env = {"HIVEMIND_MEMORY_SHARING_STRATEGY": "file_descriptor", "HIVEPATH_PROGRESS_INTERVAL": "0.5"}
        self.env.update({"HIVEPATH_PEERS_DIR": str(self.root / "peers")} if share_cores else {"HIVEPATH_THREADS": "1"})
        self._client = None

    # -- processes ----------------------------------------------------------------------------

    def start_coordinator(self) -> None:
        self.procs.start("coordinator", hivepath_cmd(
            "coordinator", "serve", "--run-config", str(self.run_toml), "--db", str(self.root / "state.db"),
            "--host", "127.0.0.1", "--port", str(self.port), "--http-port", str(self.http_port),
            "--token-file", str(self.root / "token")), env=self.env)
        wait_for(lambda: self.status() is not None, 60, "the coordinator to answer")

    def common(self, data: bool = True) -> list[str]:
        """Flags every process gets; ``data=False``: no ``--data`` (a volunteer that fetches its shards)."""
        return ["--coordinator", self.address, "--token-file", str(self.root / "token"),
                *(["--data", str(self.data_dir)] if data else []),
                "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--status-port", "0"]

    def archive_args(self, directory: Path, eval_docs: Optional[int] = 0) -> list[str]:
        """``hivepath archive`` and its flags but the network's (:meth:`common`) for an archive writing to
        ``directory``; ``eval_docs``: validation documents per path it scores for the status page (0:
        none; scoring all four paths of a snapshot takes a core 20-35 s beside three trainers; None:
        the archive's default)."""
        return ["archive", "--dir", str(directory), "--poll-interval", "0.5", "--keep", "50",
                *(["--eval-docs", str(eval_docs)] if eval_docs is not None else [])]

    def start_archive(self, name: str = "archive", eval_docs: int = 0) -> Path:
        """An archive (:meth:`archive_args`) in ``root/name``."""
        directory = self.root / name
        self.procs.start(name, hivepath_cmd(*self.archive_args(directory, eval_docs), *self.common()), env=self.env)
        return directory

    def start_peer(self, name: str, *extra: str, data: bool = True) -> Path:
        work = self.root / name
        self.procs.start(name, hivepath_cmd("peer", "join", "--work-dir", str(work), "--progress", "json",
                                            "--keep-checkpoints", "50", "--measure-seconds", "0.3",
                                            *self.common(data), *extra), env=self.env)
        return work

    def stop(self, name: str, timeout: float = 60.0) -> int:
        """SIGTERM (drain) and wait for the exit code."""
        self.procs.signal(name, signal.SIGTERM)
        return self.procs.procs[name].wait(timeout=timeout)

    # -- observation --------------------------------------------------------------------------

    def client(self):
        from peer.coordinator_client import CoordinatorClient

        if self._client is None:
            self._client = CoordinatorClient(self.address, self.token, retry_timeout=2.0)
        return self._client

    def status_json(self) -> Optional[dict[str, Any]]:
        """The coordinator's ``/status.json`` (what the status page shows, bans and seeders included)."""
        import urllib.request

        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/status.json", timeout=5) as r:
                return json.loads(r.read())
        except (OSError, ValueError):
            return None

    def status(self) -> Optional[dict[str, Any]]:
        try:
            return self.client().status()
        except Exception:
            return None

    def module_rounds(self) -> dict[str, int]:
        """Round of every module that has holders (as heartbeats report it)."""
        status = self.status() or {}
        return {m["module_id"]: m["round"] for m in status.get("modules", []) if m.get("holders")}

    def peer_assignment(self, peer_id: str) -> Optional[dict]:
        for p in (self.status() or {}).get("peers", []):
            if p["peer_id"] == peer_id:
                return p
        return None

    def progress_lines(self, name: str) -> list[dict]:
        return self.procs.json_lines(name)

    def peer_id(self, name: str) -> str:
        lines = [p for p in self.progress_lines(name) if p.get("peer_id")]
        if not lines:
            raise AssertionError(f"{name} printed no progress yet")
        return lines[-1]["peer_id"]

    def close(self) -> None:
        if self._client is not None:
            self._client.close()


def _losses(lines: list[dict]) -> list[float]:
    """The loss readings of progress lines, in time order."""
    return [p["loss"] for p in sorted(lines, key=lambda p: p.get("time", 0)) if p.get("loss") is not None]


def first_loss(lines: list[dict]) -> float:
    """The first loss reading of progress lines (NaN without one)."""
    losses = _losses(lines)
    return losses[0] if losses else float("nan")


def loss_thirds(lines: list[dict]) -> tuple[float, float, int]:
    """``(mean loss of the first third, of the last third, number of readings)`` of progress lines."""
    losses = _losses(lines)
    if len(losses) < 3:
        return float("nan"), float("nan"), len(losses)
    k = len(losses) // 3
    return sum(losses[:k]) / k, sum(losses[-k:]) / k, len(losses)
