"""A whole hivepath network of real processes on this machine: a coordinator, archives and peers, each
the installed ``hivepath`` command a user would run, on loopback or each in a network namespace of a
:class:`peer.localnet.netns.NetnsBridge` (real links, rate-limited, optionally behind NAT).

``hivepath demo``, the benchmarks and the tests start their networks with :class:`LocalNetwork`; the
caller only starts, signals and reads the processes. The run config is written from a
:class:`models.config.RunConfig` (:meth:`RunConfig.to_toml`), with the coordinator's own table.
"""

from __future__ import annotations

import json
import secrets
import signal
import subprocess
import urllib.request
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from models.config import RunConfig
from models.errors import HivepathError
from peer.localnet.procs import ProcessGroup, free_port, hivepath_cmd, wait_for

__all__ = ["LocalNetwork", "SHORT_RUN_ARCHIVE_FLAGS", "SHORT_RUN_COORDINATOR", "SHORT_RUN_ENV", "SHORT_RUN_PEER_FLAGS",
           "preset_network"]

SHORT_RUN_ENV = {"HIVEMIND_MEMORY_SHARING_STRATEGY": "file_descriptor", "HIVEPATH_PROGRESS_INTERVAL": "0.5"}
"""Environment of a network that lives minutes (tests, benchmarks): tensors shared between a process's
workers by file descriptor (no files left in /dev/shm by a killed process) and a progress event every
half second."""
SHORT_RUN_PEER_FLAGS = ("--keep-checkpoints", "50", "--measure-seconds", "0.3")
"""``peer join`` flags of such a network: every round's checkpoint kept (runs read them back), and a
0.3 s throughput measurement at join instead of the default."""
SHORT_RUN_ARCHIVE_FLAGS = ("--poll-interval", "0.5", "--keep", "50")
"""``archive`` flags of such a network: snapshots taken every half second, 50 kept."""
SHORT_RUN_COORDINATOR = {"heartbeat_interval": 1.0, "restart_grace": 5.0}
"""``[coordinator]`` settings of such a network (``lease_timeout`` is :func:`preset_network`'s)."""


class LocalNetwork:
    """Start and drive a network in ``root`` (its run config, token, state database and peers' work
    directories); ``procs`` holds its processes (whoever made it stops them).

    - ``config``, ``coordinator``: the run and the ``[coordinator]`` table of its ``run.toml``;
    - ``data_dir``: the prepared dataset every process is given with ``--data``;
    - ``threads``: torch threads of each process (``HIVEPATH_THREADS``), or None: the peers divide the
      cores among themselves, in a registry of this network's own (``peer.node.machine_share``);
    - ``env``: more environment for every process; ``peer_flags``, ``archive_flags``: flags every peer
      (``peer join``) or archive gets after the network's own;
    - ``bridge``: an open :class:`peer.localnet.netns.NetnsBridge`: the coordinator runs in namespace 0
      and each peer in the namespace it is started in; every process listens on (and announces) its
      namespace's address and dials the coordinator at namespace 0's. This process stays where it is
      and reads the coordinator's ``/status.json`` through ``curl`` run in namespace 0.
    """

    def __init__(self, procs: ProcessGroup, root: Path, data_dir: Path, config: RunConfig,
                 coordinator: Mapping[str, Any] = {}, *, threads: Optional[int] = 1, env: Mapping[str, str] = {},
                 peer_flags: Sequence[str] = (), archive_flags: Sequence[str] = (), bridge: Any = None,
                 token: Optional[str] = None):
        self.procs = procs
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.data_dir = Path(data_dir)
        self.token = token or secrets.token_hex(16)
        self.token_file = self.root / "token"
        self.token_file.write_text(self.token)
        self.token_file.chmod(0o600)
        self.run_toml = self.root / "run.toml"
        self.run_toml.write_text(config.to_toml(coordinator=coordinator))
        self.bridge = bridge
        self.port = free_port()
        self.http_port = free_port()
        self.host = bridge.address(0) if bridge is not None else "127.0.0.1"
        self.address = f"{self.host}:{self.port}"
        self.env = {**({"HIVEPATH_THREADS": str(threads)} if threads is not None
                       else {"HIVEPATH_PEERS_DIR": str(self.root / "peers")}), **env}
        self.peer_flags, self.archive_flags = list(peer_flags), list(archive_flags)
        self.where: dict[str, int] = {}
        """Process name -> namespace index (``bridge`` only)."""
        self.peers: list[str] = []
        """Names of the peers and archives started, in order."""
        self._client = None

    # -- processes ----------------------------------------------------------------------------

    def _in(self, index: Optional[int], cmd: list[str]) -> list[str]:
        """``cmd`` run in namespace ``index`` (as is on loopback)."""
        if index is None or self.bridge is None:
            return cmd
        return ["ip", "netns", "exec", self.bridge.where(index), *cmd]

    def start_coordinator(self, timeout: float = 60.0) -> None:
        """``hivepath coordinator serve`` (in namespace 0 with a bridge); returns once it answers, raises
        :class:`HivepathError` naming its log if it exits first."""
        self.where["coordinator"] = 0
        proc = self.procs.start("coordinator", self._in(0, hivepath_cmd(
            "coordinator", "serve", "--run-config", str(self.run_toml), "--db", str(self.root / "state.db"),
            "--host", self.host, "--port", str(self.port), "--http-port", str(self.http_port),
            "--token-file", str(self.token_file))), env=self.env)

        def answers() -> bool:
            if proc.poll() is not None:
                raise HivepathError(f"the coordinator exited with code {proc.returncode} before it answered; "
                                    f"see {self.procs.log_dir / 'coordinator.log'}")
            return self.status() is not None and self.status_json() is not None

        wait_for(answers, timeout, "the coordinator to answer", interval=0.1, retry_on=())

    def common(self, data: bool = True, index: Optional[int] = None, listen: Sequence[str] = (),
               announce: Sequence[str] = ()) -> list[str]:
        """Flags every process gets: the coordinator, the token, ``--data`` (``data=False``: a volunteer
        that fetches its shards), where its DHT listens (on loopback; in namespace ``index``, its
        address there, or ``listen`` multiaddrs announcing ``announce``, e.g. a relay in front of it),
        and no local status page (many processes on one host)."""
        if self.bridge is not None and index is not None:
            hosts = list(listen) or [f"/ip4/{self.bridge.local_address(index)}/tcp/0"]
        else:
            hosts = list(listen) or ["/ip4/127.0.0.1/tcp/0"]
        return ["--coordinator", self.address, "--token-file", str(self.token_file),
                *(["--data", str(self.data_dir)] if data else []), "--host-maddrs", *hosts,
                *(["--announce-maddrs", *announce] if announce else []), "--status-port", "0"]

    def archive_args(self, directory: Path, eval_docs: Optional[int] = 0) -> list[str]:
        """``hivepath archive`` and its flags but the network's (:meth:`common`) for an archive writing to
        ``directory``; ``eval_docs``: validation documents per path it scores for the status page (0:
        none; None: the archive's default)."""
        return ["archive", "--dir", str(directory), *self.archive_flags,
                *(["--eval-docs", str(eval_docs)] if eval_docs is not None else [])]

    def start_archive(self, name: str = "archive", eval_docs: Optional[int] = 0, index: Optional[int] = None,
                      extra: Sequence[str] = ()) -> Path:
        """An archive (:meth:`archive_args`, then ``extra``) in ``root/name``, in namespace ``index`` with a
        bridge. Returns its directory."""
        directory = self.root / name
        if index is not None:
            self.where[name] = index
        self.procs.start(name, self._in(index, hivepath_cmd(*self.archive_args(directory, eval_docs), *extra,
                                                            *self.common(index=index))), env=self.env)
        self.peers.append(name)
        return directory

    def start_archive_in(self, index: int, name: str = "archive") -> Path:
        """An archive in namespace ``index`` that scores snapshots as the archive does by default."""
        return self.start_archive(name, eval_docs=None, index=index)

    def start_peer(self, name: str, *extra: str, data: bool = True, index: Optional[int] = None,
                   listen: Sequence[str] = (), announce: Sequence[str] = ()) -> Path:
        """``hivepath peer join`` as ``name`` (work directory ``root/name``, JSON progress events), with
        ``extra`` flags after the network's; in namespace ``index`` with a bridge (``listen``,
        ``announce``: :meth:`common`). Returns its work directory."""
        work = self.root / name
        if index is not None:
            self.where[name] = index
        self.procs.start(name, self._in(index, hivepath_cmd(
            "peer", "join", "--work-dir", str(work), "--progress", "json", *self.peer_flags,
            *self.common(data, index, listen, announce), *extra)), env=self.env)
        self.peers.append(name)
        return work

    def start_peer_in(self, name: str, index: int, *extra: str, listen: Sequence[str] = (),
                      announce: Sequence[str] = ()) -> Path:
        """:meth:`start_peer` in namespace ``index`` (>= 1: namespace 0 is the coordinator's)."""
        return self.start_peer(name, *extra, index=index, listen=listen, announce=announce)

    def stop(self, name: str, timeout: float = 60.0) -> int:
        """SIGTERM (a peer drains: finishes its round, checkpoints, leaves) and wait for the exit code."""
        self.procs.signal(name, signal.SIGTERM)
        return self.procs.procs[name].wait(timeout=timeout)

    def shutdown(self, timeout: float = 30.0) -> dict[str, Optional[int]]:
        """Drain the peers and archives (SIGTERM, ``timeout`` seconds), then stop everything else;
        whatever is left is killed. Exit codes by name."""
        self.close()
        codes = self.procs.stop(self.peers, timeout=timeout)
        codes.update(self.procs.stop(None, timeout=10.0))
        return codes

    # -- observation --------------------------------------------------------------------------

    def client(self):
        """A gRPC client of the coordinator, made once (loopback only: this process cannot reach a
        namespace's address)."""
        from peer.coordinator_client import CoordinatorClient

        if self.bridge is not None:
            raise RuntimeError("the coordinator lives in a namespace: use status() (its /status.json)")
        if self._client is None:
            self._client = CoordinatorClient(self.address, self.token, retry_timeout=2.0)
        return self._client

    def status_json(self) -> Optional[dict[str, Any]]:
        """The coordinator's ``/status.json`` (what the status page shows), or None when it does not
        answer."""
        url = f"http://{self.host}:{self.http_port}/status.json"
        if self.bridge is None:
            try:
                with urllib.request.urlopen(url, timeout=5) as r:
                    return json.loads(r.read())
            except (OSError, ValueError):
                return None
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

    def status(self) -> Optional[dict[str, Any]]:
        """The coordinator's status over gRPC on loopback (its ``/status.json`` with a bridge), or None."""
        if self.bridge is not None:
            return self.status_json()
        try:
            return self.client().status()
        except Exception:  # not up yet, restarting, or gone: the caller waits or reads None
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

    def progress_lines(self, name: str, event: Optional[str] = None) -> list[dict]:
        """``name``'s JSON progress events (``event``: that kind only)."""
        return self.procs.json_lines(name, event)

    def peer_id(self, name: str) -> str:
        lines = [p for p in self.progress_lines(name) if p.get("peer_id")]
        if not lines:
            raise AssertionError(f"{name} printed no progress yet")
        return lines[-1]["peer_id"]

    def close(self) -> None:
        """Close the gRPC client (the processes are the group's to stop: :meth:`shutdown`)."""
        if self._client is not None:
            self._client.close()
            self._client = None


def preset_network(procs: ProcessGroup, root: Path, data_dir: Path, manifest_hash: str, *, preset: str = "tiny",
                   run_id: Optional[str] = None, inner_steps: Optional[int] = None,
                   round_timeout: Optional[float] = None, corpus: str = "default", lattice: Mapping[str, Any] = {},
                   outer: Mapping[str, Any] = {}, lease_timeout: float = 8.0, coordinator: Mapping[str, Any] = {},
                   share_cores: bool = False, env: Mapping[str, str] = {}, peer_flags: Sequence[str] = SHORT_RUN_PEER_FLAGS,
                   archive_flags: Sequence[str] = SHORT_RUN_ARCHIVE_FLAGS, bridge: Any = None) -> LocalNetwork:
    """A :class:`LocalNetwork` that lives minutes, training ``preset`` (``models.presets``) on the dataset
    ``data_dir`` (``manifest_hash``): ``run_id``, ``inner_steps``, ``round_timeout`` and ``corpus`` set
    the run's fields; ``lattice`` and ``outer`` override more of its sections; ``lease_timeout`` and
    ``coordinator`` (after :data:`SHORT_RUN_COORDINATOR`) make its ``[coordinator]`` table.
    ``share_cores``: peers divide the cores among themselves, else one torch thread each; ``env`` goes
    after :data:`SHORT_RUN_ENV`."""
    from models.presets import PRESETS

    cfg = PRESETS[preset]()
    fields = {k: v for k, v in (("inner_steps", inner_steps), ("round_timeout", round_timeout)) if v is not None}
    cfg = cfg.replace(run_id=run_id or cfg.run_id, lattice=dict(lattice), outer={**fields, **outer},
                      data={"manifest_hash": manifest_hash, "corpus": corpus})
    return LocalNetwork(procs, root, data_dir, cfg, {**SHORT_RUN_COORDINATOR, "lease_timeout": lease_timeout, **coordinator},
                        threads=None if share_cores else 1, env={**SHORT_RUN_ENV, **env}, peer_flags=peer_flags,
                        archive_flags=archive_flags, bridge=bridge)
