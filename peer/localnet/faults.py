"""A fault injector for a local network: real processes, faults at chosen moments.

Every fault fires when a *condition* holds (a peer reached a round, a log line appeared), never after
a sleep, and is recorded as a :class:`FaultEvent` with wall-clock timestamps, so a scenario's report
says what fired and when. The injector drives a :class:`peer.localnet.LocalNetwork` (on loopback or in
namespaces): ``kill -9`` and restart of a peer or of the coordinator, a network
partition of a namespace (its link down, then up) and a throttled link (``tbf`` rate changed).
"""

from __future__ import annotations

import logging
import subprocess
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional

from peer.localnet.procs import wait_for

__all__ = ["FaultEvent", "FaultInjector", "peer_round", "rounds_done", "round_reached", "log_seen"]

log = logging.getLogger(__name__)


@dataclass
class FaultEvent:
    """One injected fault: what, on whom, and when it started and ended (unix seconds)."""

    kind: str
    """kill, restart, coordinator_kill, coordinator_restart, partition, heal, throttle, unthrottle."""
    target: str
    started: float
    ended: Optional[float] = None
    detail: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def peer_round(net, name: str) -> int:
    """The highest outer round ``name`` reported in its progress JSON lines (0 before any). The lines
    come every few seconds: use :func:`rounds_done` to know exactly when a round ends."""
    rounds = [p.get("round_no") or 0 for p in net.progress_lines(name)]
    return max(rounds, default=0)


def rounds_done(net, name: str) -> int:
    """Outer rounds ``name`` finished so far, over all its incarnations: the trainer logs one line per
    round (``peer.node.trainer: round N: ...``) the moment it ends (the log is unbuffered)."""
    return net.procs.log(name).count("peer.node.trainer: round ")


def round_reached(net, name: str, n: int) -> Callable[[], bool]:
    """A condition: peer ``name`` reported outer round ``n`` or later."""
    return lambda: peer_round(net, name) >= n


def log_seen(net, name: str, text: str, count: int = 1) -> Callable[[], bool]:
    """A condition: ``text`` appears at least ``count`` times in process ``name``'s log."""
    return lambda: net.procs.log(name).count(text) >= count


class FaultInjector:
    """Inject faults into a running network and keep a timeline of them.

    ``net`` is a :class:`peer.localnet.LocalNetwork`; faults on namespaces need ``bridge`` (a
    :class:`peer.localnet.netns.NetnsBridge`). Process names follow the network's (``peer0``, ...); a
    restarted process keeps its name, its work directory and its identity, and its log goes on in the
    same file.
    """

    def __init__(self, net, bridge=None):
        self.net = net
        self.bridge = bridge
        self.events: list[FaultEvent] = []
        self.incarnations: dict[str, int] = {}
        """How many times each process was restarted by the injector."""

    # -- moments ------------------------------------------------------------------------------

    def when(self, condition: Callable[[], Any], timeout: float, what: str) -> Any:
        """Block until ``condition()`` holds (a round, a log line): the moment the next fault fires."""
        return wait_for(condition, timeout, what, interval=0.1)

    def _record(self, kind: str, target: str, **detail: Any) -> FaultEvent:
        event = FaultEvent(kind, target, round(time.time(), 3), detail=detail)
        self.events.append(event)
        log.info("fault: %s %s %s", kind, target, detail or "")
        return event

    # -- processes ----------------------------------------------------------------------------

    def kill(self, name: str) -> FaultEvent:
        """``kill -9`` process ``name`` and its whole session (its p2p daemon too)."""
        event = self._record("kill", name, pid=self.net.procs.procs[name].pid)
        self.net.procs.kill(name)
        event.ended = round(time.time(), 3)
        return event

    def restart(self, name: str) -> FaultEvent:
        """Start ``name`` again with the same command line (same work dir and identity)."""
        old = self.net.procs.procs[name]
        if old.poll() is None:
            raise RuntimeError(f"{name} is still running; kill it before restarting it")
        event = self._record("restart", name)
        self.net.procs.start(name, old.args, env=self.net.env)
        self.incarnations[name] = self.incarnations.get(name, 0) + 1
        event.ended = round(time.time(), 3)
        event.detail["pid"] = self.net.procs.procs[name].pid
        return event

    def kill_coordinator(self) -> FaultEvent:
        """``kill -9`` the coordinator (its SQLite store stays on disk)."""
        event = self._record("coordinator_kill", "coordinator")
        self.net.procs.kill("coordinator")
        event.ended = round(time.time(), 3)
        return event

    def restart_coordinator(self, answer_timeout: float = 60.0) -> FaultEvent:
        """Restart the coordinator on the same ``--db`` and wait until it answers again."""
        event = self._record("coordinator_restart", "coordinator")
        old = self.net.procs.procs["coordinator"]
        self.net.procs.start("coordinator", old.args, env=self.net.env)
        wait_for(lambda: self.net.status() is not None, answer_timeout, "the restarted coordinator to answer")
        event.ended = round(time.time(), 3)
        return event

    # -- links (namespaces) -------------------------------------------------------------------

    def _ns(self, index: int) -> list[str]:
        if self.bridge is None:
            raise RuntimeError("link faults need the network namespaces (a NetnsBridge)")
        return ["ip", "netns", "exec", self.bridge.names[index]]

    def _sh(self, index: int, *cmd: str) -> None:
        subprocess.run([*self._ns(index), *cmd], check=True, capture_output=True, text=True)

    def partition(self, index: int) -> FaultEvent:
        """Cut namespace ``index`` off the bridge: its link goes down (nothing in or out)."""
        event = self._record("partition", self.bridge.names[index] if self.bridge else str(index))
        self._sh(index, "ip", "link", "set", "eth0", "down")
        return event

    def heal(self, index: int) -> FaultEvent:
        """Bring namespace ``index``'s link back up; closes the matching partition event."""
        self._sh(index, "ip", "link", "set", "eth0", "up")
        event = self._record("heal", self.bridge.names[index])
        self._close("partition", event.target, event.started)
        return event

    def throttle(self, index: int, rate: str = "1mbit") -> FaultEvent:
        """Shape namespace ``index``'s egress down to ``rate`` (tbf, a 4 MB queue)."""
        event = self._record("throttle", self.bridge.names[index] if self.bridge else str(index), rate=rate)
        self._sh(index, "tc", "qdisc", "change", "dev", "eth0", "root", "tbf", "rate", rate, "burst", "32kb",
                 "limit", "4mb")
        return event

    def unthrottle(self, index: int) -> FaultEvent:
        """Restore the bridge's rate on namespace ``index``; closes the matching throttle event."""
        self._sh(index, "tc", "qdisc", "change", "dev", "eth0", "root", "tbf", "rate", self.bridge.rate,
                 "burst", self.bridge.burst, "limit", self.bridge.limit)
        event = self._record("unthrottle", self.bridge.names[index])
        self._close("throttle", event.target, event.started)
        return event

    def _close(self, kind: str, target: str, at: float) -> None:
        for e in reversed(self.events):
            if e.kind == kind and e.target == target and e.ended is None:
                e.ended = at
                return

    # -- report -------------------------------------------------------------------------------

    def timeline(self) -> list[dict[str, Any]]:
        """Every fault as a dict, in the order they fired."""
        return [e.to_dict() for e in self.events]

    def fired(self, kind: str) -> int:
        """How many faults of ``kind`` fired (a scenario asserts its faults really happened)."""
        return sum(e.kind == kind for e in self.events)
