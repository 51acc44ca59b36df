"""Start real processes for tests and reap them whatever happens."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional, Sequence, TypeVar

from peer.node.lifetime import ChildProcesses

T = TypeVar("T")

ROOT = Path(__file__).resolve().parents[2]


def wait_for(condition: Callable[[], T], timeout: float, what: str = "condition", interval: float = 0.05) -> T:
    """Poll ``condition`` until it returns something truthy; fail with ``what`` after ``timeout`` s.

    This is the only way tests wait: on a condition with a deadline, never a bare sleep.
    """
    deadline = time.monotonic() + timeout
    last_exc: Optional[BaseException] = None
    while True:
        try:
            value = condition()
            if value:
                return value
        except Exception as e:  # the condition may not be checkable yet
            last_exc = e
        if time.monotonic() > deadline:
            detail = f" (last error: {last_exc!r})" if last_exc else ""
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}{detail}")
        time.sleep(interval)


_HANDED: set[int] = set()
"""Ports :func:`free_port` handed out in this process: none is handed out twice (a coordinator under
test once got the same port for its gRPC and its HTTP server, two draws a moment apart)."""


def free_port() -> int:
    """A TCP port on loopback that was free a moment ago and that this process was not handed before,
    drawn below the kernel's ephemeral range: a port from that range (``bind`` to 0) can be handed,
    before the process meant to listen on it starts, to any outgoing connection on the machine as its
    source port (a coordinator under test once found its ``--http-port`` taken so). Each pytest-xdist
    worker draws from its own slice of that range, so two workers never hand out the same port. Falls
    back to an ephemeral one."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    start, stop = 10000, low
    worker, workers = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if worker[2:].isdigit() and workers.isdigit() and int(workers) > 0 and stop > start:
        width = (stop - start) // int(workers)
        start, stop = start + int(worker[2:]) * width, start + (int(worker[2:]) + 1) * width
    rng = random.SystemRandom()  # not the tests' seeded generators: processes must not draw alike
    for _ in range(50 if stop - start > 1000 else 0):
        port = rng.randrange(start, stop)
        if port in _HANDED:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # in use
                continue
        _HANDED.add(port)
        return port
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED:
            _HANDED.add(port)
            return port


def hivepath_cmd(*args: str) -> list[str]:
    """The installed ``hivepath`` command (the console script next to this interpreter)."""
    exe = Path(sys.executable).with_name("hivepath")
    return [str(exe) if exe.exists() else "hivepath", *args]


TEARDOWN_GRACE = 1.0
"""Seconds a test's processes get to exit after SIGTERM at its end before SIGKILL (see :meth:`ProcessGroup.close`)."""


class ProcessGroup(ChildProcesses):
    """Child processes started by a test (each in its own session, with the same parent-death watchdog
    as the demo's and the benchmarks'); :meth:`close` terminates and reaps every one."""

    def __init__(self, log_dir: Path):
        super().__init__(log_dir)

    def start(self, name: str, cmd: Sequence[str], env: Optional[dict] = None, **kw) -> subprocess.Popen:
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        return super().start(name, cmd, env=full_env, cwd=kw.pop("cwd", ROOT), **kw)

    def close(self) -> None:
        """At the end of a test: SIGTERM, :data:`TEARDOWN_GRACE` seconds, then SIGKILL to every session.
        The test has asserted what it needed; a drain (finish the round, checkpoint, leave) would only
        cost each test seconds more on a loaded machine. Tests of the drain itself stop their processes
        themselves, with the drain's own timeout."""
        self.stop(timeout=TEARDOWN_GRACE)

    def log(self, name: str) -> str:
        path = self.log_dir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def json_lines(self, name: str) -> list[dict]:
        """The JSON objects ``name`` printed one per line (``--progress json`` events), in order;
        a line cut short by a kill is skipped."""
        out = []
        for line in self.log(name).splitlines():
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass
        return out

    def signal(self, name, sig: int, group: bool = False) -> None:  # one name, or several as in ChildProcesses
        super().signal([name] if isinstance(name, str) else name, sig, group)
