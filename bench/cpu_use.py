"""CPU used over a window by a local network's processes, by role, and by the whole machine.

A real network on one machine shares its cores: how busy they were, and with what, says whether a
measured exchange waited for a core (which volunteers, each on a machine of their own, do not) and
whether anything outside the network ran meanwhile. The load average says neither (it counts
threads that wait for a core or for the disk, over a minute that outlasts a short window).

:class:`CpuWindow` takes a snapshot of the machine's CPU times (``/proc/stat``) and of every process
under a root process (user + system time), and at :meth:`CpuWindow.stop` returns the cores each used
on average in between. Each process gets a role from its command line (:func:`role`). A process that
started within the window counts all its time; one that ended within it counts none of it (windows
are measured once the network is settled, when none start or end).
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any, Optional, Sequence

__all__ = ["CpuWindow", "ROLES", "role", "summarize"]

ROLES = ("peer", "dht", "p2pd", "coordinator", "watchdog", "other")
"""``peer``: a ``hivepath peer join`` process (its training, averaging and coordinator client);
``dht``: a process a ``peer join`` process forked (hivemind's DHT runs in one); ``p2pd``: a p2p daemon;
``coordinator``: ``hivepath coordinator serve``; ``watchdog``: a ``peer.node.lifetime --watch`` process;
``other``: anything else under the root (the benchmark's own process)."""


def role(cmdline: Sequence[str], parent_cmdline: Sequence[str] = ()) -> str:
    """The role (:data:`ROLES`) of a process with ``cmdline`` whose parent has ``parent_cmdline``."""
    words = " ".join(cmdline)
    if cmdline and cmdline[0].rsplit("/", 1)[-1] == "p2pd":
        return "p2pd"
    if "peer.node.lifetime" in words and "--watch" in words:
        return "watchdog"
    if "peer join" in words:
        return "dht" if "peer join" in " ".join(parent_cmdline) else "peer"
    if "coordinator serve" in words:
        return "coordinator"
    return "other"


def _host_busy_seconds() -> float:
    """CPU seconds the machine's cores were busy since boot, all together: all but idle and iowait
    (steal included: a core the hypervisor gave to another machine was not ours to use)."""
    import psutil

    t = psutil.cpu_times()._asdict()
    for counted_in_user in ("guest", "guest_nice"):
        t.pop(counted_in_user, None)
    return sum(t.values()) - t["idle"] - t.get("iowait", 0.0)


def _tree(root: int) -> dict[int, tuple[float, str, float]]:
    """pid -> (create time, role, user + system seconds) of ``root`` and its descendants."""
    import psutil

    try:
        top = psutil.Process(root)
        procs = [top, *top.children(recursive=True)]
    except psutil.NoSuchProcess:
        return {}
    cmdlines: dict[int, list[str]] = {}
    out = {}
    for p in procs:
        try:
            with p.oneshot():
                cmdlines[p.pid] = p.cmdline()
                t = p.cpu_times()
                out[p.pid] = (p.create_time(), p.ppid(), t.user + t.system)
        except psutil.NoSuchProcess:
            continue
    return {pid: (created, role(cmdlines[pid], cmdlines.get(ppid, ())), seconds)
            for pid, (created, ppid, seconds) in out.items()}


class CpuWindow:
    """CPU use between :meth:`start` and :meth:`stop` of ``root``'s process tree and of the machine."""

    def __init__(self, root: int):
        self.root = root
        self._at: Optional[tuple[float, float, dict]] = None

    def start(self) -> None:
        self._at = (time.monotonic(), _host_busy_seconds(), _tree(self.root))

    def stop(self) -> dict[str, Any]:
        """Average cores over the window: ``host_busy_cores`` of ``host_cores``; ``tree_cores`` by role
        and ``tree_processes`` (how many of each role; a role's cores over its count is one process's);
        ``outside_cores``: the machine's busy cores less the tree's (other work on the machine)."""
        import psutil

        if self._at is None:
            raise RuntimeError("CpuWindow.stop() before start()")
        t0, busy0, tree0 = self._at
        wall = max(1e-9, time.monotonic() - t0)
        busy = _host_busy_seconds() - busy0
        return summarize(wall, busy, tree0, _tree(self.root), psutil.cpu_count() or 1)


def summarize(wall: float, host_busy: float, before: dict, after: dict, cores: int) -> dict[str, Any]:
    """:meth:`CpuWindow.stop`'s figures from two :func:`_tree` snapshots ``wall`` seconds apart, between
    which the machine was busy ``host_busy`` CPU seconds."""
    used: Counter[str] = Counter()
    count: Counter[str] = Counter()
    for pid, (created, kind, seconds) in after.items():
        was = before.get(pid)
        used[kind] += seconds - (was[2] if was is not None and was[0] == created else 0.0)
        count[kind] += 1
    tree = sum(used.values())
    return {"host_cores": cores, "host_busy_cores": round(host_busy / wall, 3),
            "tree_cores": {k: round(used[k] / wall, 3) for k in ROLES if count[k]},
            "tree_processes": {k: count[k] for k in ROLES if count[k]},
            "outside_cores": round(max(0.0, host_busy - tree) / wall, 3)}
