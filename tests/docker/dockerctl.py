"""Driving a real Docker engine from tests: the ``docker`` and ``docker-compose`` commands, nothing mocked.

Everything a test creates carries the label ``hivepath-test=<session>`` (or a compose project name)
and is removed by :meth:`Docker.cleanup`, whatever happened; what a killed session left behind is
swept by the next one (:meth:`Docker.sweep_stale`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Optional, Sequence

ROOT = Path(__file__).resolve().parents[2]
STALE_AFTER_S = 2 * 3600.0
"""Test resources older than this belong to no running session (CI is killed at 90 minutes)."""


class DockerError(RuntimeError):
    pass


def engine_problem() -> Optional[str]:
    """Why no Docker engine can be used here, or None when one answers."""
    if shutil.which("docker") is None:
        return "no `docker` command on PATH (deploy/ci/docker-setup.sh installs one)"
    try:
        out = subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"], capture_output=True, text=True,
                             timeout=20)
    except subprocess.TimeoutExpired:
        return "`docker info` did not answer within 20 s"
    if out.returncode != 0:
        return f"no Docker engine answers: {out.stderr.strip().splitlines()[-1] if out.stderr.strip() else 'docker info failed'}"
    return None


def compose_command() -> list[str]:
    """``docker-compose`` (1.29 here) or ``docker compose`` (v2), whichever exists."""
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return ["docker", "compose"]


class Docker:
    """A thin wrapper over the docker CLI that remembers what it created."""

    def __init__(self, label: str):
        self.label = label
        self.networks: list[str] = []
        self.volumes: list[str] = []
        self.projects: list[tuple[list[str], dict]] = []

    def __call__(self, *args: str, timeout: float = 120.0, check: bool = True) -> subprocess.CompletedProcess:
        out = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
        if check and out.returncode != 0:
            raise DockerError(f"docker {' '.join(args)} failed ({out.returncode}): {out.stderr.strip()[-2000:]}")
        return out

    # -- objects ------------------------------------------------------------------------------

    def network(self, name: str) -> str:
        self("network", "create", "--label", f"hivepath-test={self.label}", name)
        self.networks.append(name)
        return name

    def volume(self, name: str) -> str:
        self("volume", "create", "--label", f"hivepath-test={self.label}", name)
        self.volumes.append(name)
        return name

    def run(self, name: str, image: str, *cmd: str, env: Optional[dict] = None, network: Optional[str] = None,
            volumes: Sequence[str] = (), publish: Sequence[str] = (), entrypoint: Optional[str] = None,
            init: bool = True, extra: Sequence[str] = ()) -> str:
        """Start a detached container; returns its name."""
        args = ["run", "-d", "--name", name, "--label", f"hivepath-test={self.label}"]
        if init:
            args.append("--init")
        if network:
            args += ["--network", network]
        for k, v in (env or {}).items():
            args += ["-e", f"{k}={v}"]
        for v in volumes:
            args += ["-v", v]
        for p in publish:
            args += ["-p", p]
        if entrypoint is not None:
            args += ["--entrypoint", entrypoint]
        self(*args, *extra, image, *cmd)
        return name

    # -- inspection ---------------------------------------------------------------------------

    def inspect(self, name: str) -> dict:
        return json.loads(self("inspect", name).stdout)[0]

    def health(self, name: str) -> str:
        state = self.inspect(name)["State"]
        return (state.get("Health") or {}).get("Status", "none")

    def exit_code(self, name: str) -> Optional[int]:
        """The container's exit code, or None while it runs."""
        state = self.inspect(name)["State"]
        return None if state["Running"] else int(state["ExitCode"])

    def logs(self, name: str) -> str:
        out = self("logs", name, check=False)
        return out.stdout + out.stderr

    def published(self, name: str, port: int) -> int:
        """The host port that container port ``port`` is published on."""
        text = self("port", name, f"{port}/tcp").stdout.strip().splitlines()[0]
        return int(text.rsplit(":", 1)[1])

    def peer_id(self, name: str) -> Optional[str]:
        """The peer id a hivepath peer container reports in its JSON progress lines."""
        for line in reversed(self.logs(name).splitlines()):
            if line.startswith("{") and '"peer_id"' in line:
                try:
                    pid = json.loads(line).get("peer_id")
                except ValueError:
                    continue
                if pid:
                    return pid
        return None

    # -- compose ------------------------------------------------------------------------------

    def compose(self, project: str, env: dict, *args: str, files: Sequence[Path] = (), timeout: float = 300.0,
                check: bool = True) -> subprocess.CompletedProcess:
        fargs = []
        for f in [ROOT / "deploy" / "compose.yaml", *files]:
            fargs += ["-f", str(f)]
        cmd = [*compose_command(), "-p", project, *fargs, *args]
        if (cmd, env) not in [(c, e) for c, e in self.projects]:
            self.projects.append(([*compose_command(), "-p", project, *fargs], env))
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **env})
        if check and out.returncode != 0:
            raise DockerError(f"{' '.join(cmd)} failed ({out.returncode}): {out.stderr.strip()[-3000:]}")
        return out

    def compose_containers(self, project: str, service: str) -> list[str]:
        """Names of a compose service's containers (running or not), by replica number."""
        out = self("ps", "-a", "--filter", f"label=com.docker.compose.project={project}",
                   "--filter", f"label=com.docker.compose.service={service}", "--format", "{{.Names}}").stdout
        return sorted(out.split(), key=lambda n: int(n.rsplit("_", 1)[-1]) if n.rsplit("_", 1)[-1].isdigit()
                      else int(n.rsplit("-", 1)[-1]))

    # -- teardown -----------------------------------------------------------------------------

    def sweep_stale(self, older_than: float = STALE_AFTER_S) -> list[str]:
        """Remove what interrupted test sessions left behind (a killed run never reaches
        :meth:`cleanup`): containers, networks and volumes labelled ``hivepath-test`` or made by a
        test compose project (``hpt...``), created more than ``older_than`` seconds ago. Each compose
        project holds a network from Docker's small default address pool; a few dozen leftovers exhaust
        it ("could not find an available, non-overlapping IPv4 address pool"). Returns what it removed."""
        removed = []
        for kind, ls in (("container", ["ps", "-aq"]), ("network", ["network", "ls", "-q"]),
                         ("volume", ["volume", "ls", "-q"])):
            ids = set()
            for label in ("hivepath-test", "com.docker.compose.project"):
                ids |= set(self(*ls, "--filter", f"label={label}", check=False).stdout.split())
            for ident in sorted(ids):
                info = self(kind, "inspect", ident, check=False)
                if info.returncode != 0:
                    continue
                obj = json.loads(info.stdout)[0]
                labels = (obj.get("Config") or {}).get("Labels") if kind == "container" else obj.get("Labels")
                labels = labels or {}
                ours = "hivepath-test" in labels or labels.get("com.docker.compose.project", "").startswith("hpt")
                if ours and _age_seconds(obj.get("Created") or obj.get("CreatedAt") or "") > older_than:
                    rm = ["rm", "-f", "-v", ident] if kind == "container" else [kind, "rm", ident]
                    if self(*rm, check=False, timeout=120).returncode == 0:
                        removed.append(f"{kind} {obj.get('Name') or ident}")
        return removed

    def cleanup(self) -> None:
        for base, env in self.projects:
            subprocess.run([*base, "down", "-v", "-t", "5", "--remove-orphans"], capture_output=True, timeout=180,
                           env={**os.environ, **env})
        names = self("ps", "-aq", "--filter", f"label=hivepath-test={self.label}", check=False).stdout.split()
        if names:
            self("rm", "-f", "-v", *names, check=False, timeout=120)
        for n in self.networks:
            self("network", "rm", n, check=False)
        for v in self.volumes:
            self("volume", "rm", "-f", v, check=False)


def _age_seconds(created: str) -> float:
    """Seconds since a Docker ``Created`` timestamp (RFC 3339 with nanoseconds); 0 if unreadable."""
    import datetime as dt

    m = re.match(r"(\d{4}-\d{2}-\d{2})[T ](\d{2}:\d{2}:\d{2})", created)
    if not m:
        return 0.0
    when = dt.datetime.fromisoformat(f"{m.group(1)}T{m.group(2)}+00:00")
    return (dt.datetime.now(dt.timezone.utc) - when).total_seconds()


def http_json(url: str, timeout: float = 3.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


def elapsed(since: float) -> float:
    return time.monotonic() - since
