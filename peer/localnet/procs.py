"""Processes of a local network: the installed ``hivepath`` command, ports, waiting with a deadline, and
a group of children that are always reaped (:class:`ProcessGroup`)."""

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

__all__ = ["ProcessGroup", "free_port", "hivepath_cmd", "wait_for"]

T = TypeVar("T")


def wait_for(condition: Callable[[], T], timeout: float, what: str = "condition", interval: float = 0.05,
             retry_on: tuple[type[BaseException], ...] = (Exception,)) -> T:
    """Poll ``condition`` until it returns something truthy; ``TimeoutError`` naming ``what`` after
    ``timeout`` seconds. An exception of ``retry_on`` raised by ``condition`` counts as not yet (a file
    not written, a server not listening) and is named in the error if the deadline passes; any other
    propagates at once (``retry_on=()``: a condition that raises to say it never will hold)."""
    deadline = time.monotonic() + timeout
    last_exc: Optional[BaseException] = None
    while True:
        try:
            value = condition()
            if value:
                return value
        except retry_on as e:  # the condition may not be checkable yet
            last_exc = e
        if time.monotonic() > deadline:
            detail = f" (last error: {last_exc!r})" if last_exc else ""
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}{detail}")
        time.sleep(interval)


_HANDED: set[int] = set()
"""Ports :func:`free_port` handed out in this process: none is handed out twice (a coordinator once got
the same port for its gRPC and its HTTP server, two draws a moment apart)."""


def free_port() -> int:
    """A TCP port on loopback that was free a moment ago and that this process was not handed before,
    drawn below the kernel's ephemeral range: a port from that range (``bind`` to 0) can be handed,
    before the process meant to listen on it starts, to any outgoing connection on the machine as its
    source port (a coordinator once found its ``--http-port`` taken so). Each pytest-xdist worker
    draws from its own slice of that range, so two workers never hand out the same port. Falls back to
    an ephemeral one."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    start, stop = 10000, low
    worker, workers = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if worker[2:].isdigit() and workers.isdigit() and int(workers) > 0 and stop > start:
        width = (stop - start) // int(workers)
        start, stop = start + int(worker[2:]) * width, start + (int(worker[2:]) + 1) * width
    rng = random.SystemRandom()  # not a seeded generator: two processes must not draw alike
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
    """``hivepath ARGS``: the console script next to this interpreter, else this interpreter running the
    CLI module (a checkout used without installing)."""
    exe = Path(sys.executable).with_name("hivepath")
    return [str(exe), *args] if exe.exists() else [sys.executable, "-m", "hivepath.cli", *args]


class ProcessGroup(ChildProcesses):
    """Named child processes, each in its own session and dying with this process
    (:class:`peer.node.lifetime.ChildProcesses`), whose output is kept in ``log_dir/NAME.log`` and read
    back by :meth:`log` and :meth:`json_lines`. Each child gets this process's environment, unbuffered
    output, and ``env`` on top; ``cwd``: where children start (default: here)."""

    def __init__(self, log_dir: Path, cwd: Optional[Path] = None):
        super().__init__(log_dir)
        self.cwd = cwd

    def start(self, name: str, cmd: Sequence[str], env: Optional[dict] = None, **kw) -> subprocess.Popen:
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        return super().start(name, cmd, env=full_env, cwd=kw.pop("cwd", self.cwd), **kw)

    def log(self, name: str) -> str:
        """Everything ``name`` printed so far ('' before it printed anything)."""
        path = self.log_dir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def json_lines(self, name: str, event: Optional[str] = None) -> list[dict]:
        """The JSON objects ``name`` printed one per line (``--progress json`` events), in order; with
        ``event``, only events of that kind. A line cut short by a kill is skipped."""
        out = []
        for line in self.log(name).splitlines():
            if line.startswith("{"):
                try:
                    obj = json.loads(line)
                except ValueError:
                    continue
                if event is None or obj.get("event") == event:
                    out.append(obj)
        return out

    def exited(self) -> list[str]:
        """Names of the children that have exited."""
        return [n for n, p in self.procs.items() if p.poll() is not None]

    def none_exited(self, names: Optional[Sequence[str]] = None) -> bool:
        """True while none of the children (of ``names`` only, if given) has exited; else raises
        ``RuntimeError`` naming those that did, with the end of each one's log: a :func:`wait_for` on
        children that must stay up (``retry_on=()``) then ends at once rather than at its deadline."""
        dead = [n for n in self.exited() if names is None or n in names]
        if dead:
            raise RuntimeError(f"exited early: {dead}: {({n: self.log(n)[-1500:] for n in dead})}")
        return True

    def signal(self, name, sig: int, group: bool = False) -> None:  # one name, or several as in ChildProcesses
        super().signal([name] if isinstance(name, str) else name, sig, group)
