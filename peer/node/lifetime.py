"""Child processes that never outlive the process that started them.

Whatever starts processes (the demo, the benchmarks, the test helpers, a peer with its DHT process
and p2p daemon) must stop them when it is asked to stop, by SIGINT (Ctrl-C), SIGTERM (``timeout``,
``docker stop``, systemd, CI cancellation) or SIGHUP (the terminal or SSH session closed), and they
must stop on their own when it dies without a word (SIGKILL, the OOM killer).

- :func:`stop_on_signals` turns SIGTERM and SIGHUP into ``KeyboardInterrupt`` in the main thread, as
  SIGINT already is, so the ``finally`` blocks and context managers that stop children run for all three.
- :class:`ChildProcesses` starts named children, each in its own session (a signal to the session
  reaches the child's DHT process and p2p daemon too), each with ``PR_SET_PDEATHSIG`` set so the
  kernel sends it SIGTERM when its parent dies, and stops them: SIGTERM (a peer drains), then SIGKILL
  to the whole session.
- :func:`watch_descendants` starts a watchdog process that follows this process's descendants and,
  when this process is gone (whatever killed it), sends them SIGTERM and then SIGKILL. The kernel's parent-death signal covers direct children only; the watchdog covers
  grandchildren such as a peer's p2p daemon, which hivemind starts without one.

- Children get :data:`models.grpc_fork.GRPC_FORK_ENV`, and no ``preexec_fn`` where grpc was imported
  with its fork handlers on (they can abort a forked child: see :mod:`models.grpc_fork`).

- The watchdog also removes what the tree leaves in the temp dirs once it is gone: hivemind's p2p
  sockets and torch's shared-memory manager's (:mod:`peer.node.leftovers`).

Standard library, psutil, :mod:`models.grpc_fork` and :mod:`peer.node.leftovers` only: the spot
supervisor and the test helpers use it too.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator, Optional, Sequence

from models.grpc_fork import GRPC_FORK_ENV, fork_is_safe
from peer.node.leftovers import bound_sockets, remove_dead_sockets, remove_registration

__all__ = ["ChildProcesses", "stop_on_signals", "watch_descendants", "die_with_parent", "STOP_SIGNALS"]

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""The signals on which every process that starts others stops them."""

_PR_SET_PDEATHSIG = 1
WATCH_INTERVAL = 0.5
"""Seconds between the watchdog's looks at the process tree (a protocol poll, not a test wait)."""
REAP_GRACE = 10.0
"""Seconds the watchdog gives orphaned descendants to exit on SIGTERM before it sends SIGKILL."""
SOCKET_SCAN_INTERVAL = WATCH_INTERVAL
"""Seconds between the watchdog's looks at the unix sockets the tree has bound (and at every new process)."""


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Ask the kernel to send ``sig`` to this process when its parent dies (Linux; elsewhere a no-op).

    Meant as a ``preexec_fn``: it runs in the child between fork and exec and survives the exec.
    """
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """Within this block SIGTERM and SIGHUP raise ``KeyboardInterrupt`` in the main thread, like SIGINT.

    A second stop signal while the first is being handled is ignored, so the clean-up is not cut short;
    the previous handlers come back on exit.
    """

    def handler(signum, frame):
        for s in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(s, signal.SIG_IGN)
        raise KeyboardInterrupt(f"stopped by {signal.Signals(signum).name}")

    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


class ChildProcesses:
    """Named child processes, each in its own session, that die with this process.

    ``log_dir``: each child's stdout and stderr go to ``log_dir/NAME.log`` (appended), else to ours.
    The first :meth:`start` also starts a :func:`watch_descendants` watchdog (``watchdog=False`` skips
    it, for a parent that runs one already).
    """

    def __init__(self, log_dir: Optional[Path] = None, watchdog: bool = True):
        self.log_dir = Path(log_dir) if log_dir is not None else None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, subprocess.Popen] = {}
        self._watchdog = watchdog

    def start(self, name: str, cmd: Sequence[str], env: Optional[dict] = None, **popen_kw) -> subprocess.Popen:
        """Start ``cmd`` as child ``name`` (a name already used is replaced: its process must be gone)."""
        if self._watchdog:
            watch_descendants()
            self._watchdog = False
        out = open(self.log_dir / f"{name}.log", "ab") if self.log_dir is not None else None
        try:
            # the kernel's parent-death signal fires when the *thread* that forked exits: main thread only;
            # and a preexec_fn forces a fork, which gRPC's fork handlers can abort (grpc_fork_safe)
            main = threading.current_thread() is threading.main_thread()
            on_death = die_with_parent if main and fork_is_safe() else None
            env = {**(os.environ if env is None else env), **GRPC_FORK_ENV}
            proc = subprocess.Popen(list(cmd), stdout=out, stderr=subprocess.STDOUT if out else None, env=env,
                                    start_new_session=True, preexec_fn=on_death, **popen_kw)
        finally:
            if out is not None:
                out.close()
        self.procs[name] = proc
        return proc

    def signal(self, names: Sequence[str], sig: int, group: bool = False) -> None:
        """Send ``sig`` to each child, or to its whole session with ``group`` (SIGKILL always is)."""
        for n in names:
            p = self.procs.get(n)
            if p is None or p.poll() is not None:
                continue
            with contextlib.suppress(ProcessLookupError, PermissionError):
                if group or sig == signal.SIGKILL:
                    os.killpg(p.pid, sig)
                else:
                    p.send_signal(sig)

    def wait(self, names: Sequence[str], timeout: float) -> dict[str, Optional[int]]:
        """Exit codes by name, ``None`` for a child still running after ``timeout`` seconds in all."""
        deadline = time.monotonic() + timeout
        codes: dict[str, Optional[int]] = {}
        for n in names:
            try:
                codes[n] = self.procs[n].wait(timeout=max(0.05, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                codes[n] = None
        return codes

    def stop(self, names: Optional[Sequence[str]] = None, timeout: float = 30.0) -> dict[str, Optional[int]]:
        """SIGTERM (a peer drains and checkpoints), then SIGKILL to the session of whatever is still
        running after ``timeout``; finally SIGKILL to every session, which reaps p2p daemons left in it."""
        names = list(self.procs) if names is None else list(names)
        self.signal(names, signal.SIGTERM)
        codes = self.wait(names, timeout)
        stuck = [n for n, c in codes.items() if c is None]
        if stuck:
            log.warning("killing %s: they did not stop within %.0fs of SIGTERM", ", ".join(stuck), timeout)
            self.signal(stuck, signal.SIGKILL)
            codes.update(self.wait(stuck, 10.0))
        for n in names:
            p = self.procs[n]
            if p.poll() is not None and _leader_start(p.pid) is not None:
                continue  # reaped, and its pid handed to a stranger: that group is not ours to kill
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
        return codes

    def kill(self, name: str) -> Optional[int]:
        """``kill -9`` child ``name`` and its session; its exit code."""
        self.signal([name], signal.SIGKILL)
        return self.wait([name], 10.0)[name]

    def close(self) -> None:
        self.stop(timeout=10.0)



_watchdog: Optional[subprocess.Popen] = None


def watch_descendants() -> None:
    """Start (once per process) a watchdog that stops this process's descendants when it is gone.

    The watchdog runs in its own session (so Ctrl-C at a terminal does not reach it) and every
    :data:`WATCH_INTERVAL` notes this process's descendants. Once this process is gone, however it
    died, the watchdog sends SIGTERM to the descendants it knew that still run (the same processes:
    psutil checks their start times, so a reused pid is left alone) and to every process in the
    sessions of those that run in a session of their own (a child of :class:`ChildProcesses`), and
    in this process's session if it leads it: so a p2p daemon started since its last look goes too.
    SIGKILL follows after :data:`REAP_GRACE` seconds; then it removes the unix sockets the tree had
    bound in the temp dirs that nobody listens at any more (:mod:`peer.node.leftovers`) and exits. (No pipe: a child forked by multiprocessing would inherit its write end and
    keep it open.)
    """
    global _watchdog
    if _watchdog is not None and _watchdog.poll() is None:
        return
    _watchdog = subprocess.Popen(
        [sys.executable, "-m", "peer.node.lifetime", "--watch", str(os.getpid())], stdin=subprocess.DEVNULL,
        start_new_session=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[2]),
                                                                      os.environ.get("PYTHONPATH")]))},
    )


def _sid(pid: int) -> int:
    try:
        return os.getsid(pid)
    except OSError:
        return -1


def _leader_start(sid: int) -> Optional[float]:
    """When the leader of session ``sid`` (the process whose pid is ``sid``) started; None once it is gone."""
    import psutil

    try:
        return psutil.Process(sid).create_time()
    except psutil.Error:
        return None


def _same_session(sid: int, leader_started: Optional[float]) -> bool:
    """Whether session ``sid`` is still the one seen when its leader had started at ``leader_started``
    (None: its leader was gone by then). A session id is its leader's pid, which the kernel hands out
    again once every process of the session has exited: a live leader that started at another time
    leads a new, unrelated session (any other process's, a later test's), never to be swept. While any
    process of the old session lives, its id is not reused, so a session without a live leader is the
    one we saw."""
    now = _leader_start(sid)
    return now is None or now == leader_started


def _watch(parent_pid: int) -> int:
    import psutil

    for s in STOP_SIGNALS:
        signal.signal(s, signal.SIG_IGN)
    try:
        parent = psutil.Process(parent_pid)
    except psutil.NoSuchProcess:
        return 0
    # the parent's own session is swept too when the parent leads it (started in a session of its own,
    # as ChildProcesses starts every child): all that is left in it then descends from the parent. A
    # parent that does not lead its session shares it with others (a terminal's shell): never swept.
    me = os.getpid()
    own_sessions = {os.getsid(0)} | (set() if _sid(parent_pid) == parent_pid else {_sid(parent_pid)})
    known: dict[int, psutil.Process] = {}
    # session id -> when its leader started, as first seen (None: the leader was gone by then)
    sessions: dict[int, Optional[float]] = {parent_pid: parent.create_time()} if _sid(parent_pid) == parent_pid else {}
    sockets: set[str] = set()  # unix sockets the tree bound in the temp dirs (peer.node.leftovers)
    scanned_at, scanned_pids = float("-inf"), frozenset()
    while _alive(parent):
        with contextlib.suppress(psutil.NoSuchProcess):
            for child in parent.children(recursive=True):
                if child.pid != me:
                    known.setdefault(child.pid, child)
                    sid = _sid(child.pid)
                    if sid > 0 and sid not in sessions:  # (-1: the child is gone already)
                        sessions[sid] = _leader_start(sid)
        known = {pid: p for pid, p in known.items() if p.is_running()}
        if frozenset(known) != scanned_pids or time.monotonic() - scanned_at >= SOCKET_SCAN_INTERVAL:
            sockets |= bound_sockets([parent, *known.values()])
            scanned_at, scanned_pids = time.monotonic(), frozenset(known)
        # a session that ended frees its id for reuse: forget it rather than sweep a stranger's later
        sessions = {sid: t for sid, t in sessions.items() if _same_session(sid, t)}
        time.sleep(WATCH_INTERVAL)
    # The descendants we saw, and everything in the sessions of the children that were started in their
    # own (ChildProcesses) that are still the sessions we saw: that also catches a p2p daemon started
    # after our last look.
    sweep = {sid for sid, t in sessions.items() if sid not in own_sessions and _same_session(sid, t)}
    orphans = [p for p in known.values() if p.is_running() and not _is_watchdog(p)]
    seen = {p.pid for p in orphans}
    for p in psutil.process_iter():
        if p.pid not in seen and p.pid != me and _sid(p.pid) in sweep and not _is_watchdog(p):
            orphans.append(p)
    for p in orphans:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.terminate()
    _, alive = psutil.wait_procs(orphans, timeout=REAP_GRACE)
    for p in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(alive, timeout=5.0)
    remove_dead_sockets(sockets)
    remove_registration(parent_pid)
    return 0


def _is_watchdog(p) -> bool:
    """Whether ``p`` is the watchdog of a descendant (a peer the demo started): it ends on its own once
    its process is gone, after removing what that one left, which a SIGKILL of ours would cut short."""
    import psutil

    try:
        cmd = p.cmdline()
    except psutil.Error:
        return False
    return "peer.node.lifetime" in cmd and "--watch" in cmd


def _alive(p) -> bool:
    import psutil

    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m peer.node.lifetime", description=__doc__.splitlines()[0])
    parser.add_argument("--watch", type=int, metavar="PID", required=True,
                        help="watch PID's descendants; stop them once PID is gone")
    return _watch(parser.parse_args(argv).watch)


if __name__ == "__main__":
    sys.exit(main())
