"""Network namespaces for benchmarks: N peers joined through a Linux bridge, egress rate-limited.

Layout (needs root and ``iproute2``)::

    [hpb-p0: eth0 10.77.0.1/24, tbf] --veth--+
    [hpb-p1: eth0 10.77.0.2/24, tbf] --veth--+-- hpbbr (bridge, in namespace hpb-sw)
    ...                                      |

A participant ``i`` listed in ``nat`` sits behind a home router: ``{prefix}-p{i}`` is then the router
(its ``eth0`` on the bridge, masquerading with iptables) and the participant runs in
``{prefix}-h{i}`` at ``192.168.{100 + i}.2`` behind it, with no route in: a real NAT, as a volunteer's
home router is. :meth:`NetnsBridge.where` and :meth:`NetnsBridge.local_address` say where a
participant runs and listens; :meth:`NetnsBridge.address` is its address on the bridge (a NATed
participant's public one, its router's).

Each peer's egress is shaped with ``tc qdisc add dev eth0 root tbf rate RATE burst 64kb limit 4mb``
(a queue of a few MB: small queues drop packets at low rates). The bridge lives in its own
namespace, so nothing is added to the host's network; traffic only goes between the addresses of
the namespaces created here (a private range, never 198.18.0.0/15 where libp2p does not route).
Everything is removed on :meth:`NetnsBridge.close` (also on failure: use it as a context manager).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from pathlib import Path
from typing import Optional, Sequence

__all__ = ["NetnsBridge", "netns_available", "tx_bytes"]

log = logging.getLogger(__name__)


def netns_available() -> str:
    """'' if namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "needs root (ip netns, tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"needs the '{tool}' command (iproute2)"
    probe = f"hpb-probe-{os.getpid()}"  # root in a container may still lack CAP_SYS_ADMIN
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create network namespaces here ({made.stderr.strip() or 'ip netns add failed'})"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return ""


def _sh(*args: str) -> None:
    subprocess.run(list(args), check=True, capture_output=True, text=True)


class NetnsBridge:
    """``n`` namespaces ``{prefix}-p{i}`` with address ``{subnet}.{i + 1}`` behind one bridge."""

    def __init__(self, n: int, rate: str = "100mbit", subnet: str = "10.77.0", prefix: str = "hpb",
                 burst: str = "64kb", limit: str = "4mb", nat: Sequence[int] = ()):
        if not subnet.startswith(("10.", "192.168.")) and not subnet.startswith("172."):
            raise ValueError(f"use a private subnet, not {subnet}")
        self.n, self.rate, self.subnet, self.prefix = n, rate, subnet, prefix
        self.burst, self.limit = burst, limit
        self.switch = f"{prefix}-sw"
        self.names = [f"{prefix}-p{i}" for i in range(n)]
        self.nat = frozenset(nat)
        if not self.nat <= set(range(n)) or (self.nat and shutil.which("iptables") is None):
            raise ValueError(f"nat must name participants 0..{n - 1} and needs iptables, got {sorted(self.nat)}")
        self.homes = {i: f"{prefix}-h{i}" for i in sorted(self.nat)}
        self._made: list[str] = []

    def address(self, i: int) -> str:
        """Participant ``i``'s address on the bridge (for a NATed one, its router's: its public address)."""
        return f"{self.subnet}.{i + 1}"

    def where(self, i: int) -> str:
        """The namespace participant ``i`` runs in (its home, behind the router, when NATed)."""
        return self.homes.get(i, self.names[i])

    def local_address(self, i: int) -> str:
        """The address participant ``i`` listens on (a private home address when NATed)."""
        return f"192.168.{100 + i}.2" if i in self.nat else self.address(i)

    def __enter__(self) -> "NetnsBridge":
        try:
            self.open()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def open(self) -> None:
        """Create the switch namespace with the bridge, and each peer namespace with its shaped link."""
        self.close()  # leftovers of an interrupted run
        _sh("ip", "netns", "add", self.switch)
        self._made.append(self.switch)
        sw = ["ip", "netns", "exec", self.switch]
        _sh(*sw, "ip", "link", "add", "br0", "type", "bridge")
        _sh(*sw, "ip", "link", "set", "br0", "up")
        for i, ns in enumerate(self.names):
            _sh("ip", "netns", "add", ns)
            self._made.append(ns)
            inside = ["ip", "netns", "exec", ns]
            _sh("ip", "link", "add", f"{self.prefix}v{i}", "netns", ns, "type", "veth",
                "peer", "name", f"{self.prefix}s{i}", "netns", self.switch)
            _sh(*inside, "ip", "link", "set", f"{self.prefix}v{i}", "name", "eth0")
            _sh(*inside, "ip", "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
            _sh(*inside, "ip", "link", "set", "eth0", "up")
            _sh(*inside, "ip", "link", "set", "lo", "up")
            _sh(*inside, "tc", "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", self.rate,
                "burst", self.burst, "limit", self.limit)
            _sh(*sw, "ip", "link", "set", f"{self.prefix}s{i}", "master", "br0")
            _sh(*sw, "ip", "link", "set", f"{self.prefix}s{i}", "up")
            if i in self.nat:
                self._home(i)
        log.info("namespaces %s up behind a bridge, egress %s each%s", ", ".join(self.names), self.rate,
                 f"; {', '.join(self.homes.values())} behind NAT" if self.nat else "")

    def _home(self, i: int) -> None:
        """Participant ``i``'s home namespace behind ``{prefix}-p{i}``, which masquerades for it."""
        home, router = self.homes[i], self.names[i]
        inside, rtr = ["ip", "netns", "exec", home], ["ip", "netns", "exec", router]
        lan = f"192.168.{100 + i}"
        _sh("ip", "netns", "add", home)
        self._made.append(home)
        _sh("ip", "link", "add", f"{self.prefix}h{i}", "netns", home, "type", "veth",
            "peer", "name", f"{self.prefix}r{i}", "netns", router)
        _sh(*inside, "ip", "link", "set", f"{self.prefix}h{i}", "name", "eth0")
        _sh(*inside, "ip", "addr", "add", f"{lan}.2/24", "dev", "eth0")
        _sh(*inside, "ip", "link", "set", "eth0", "up")
        _sh(*inside, "ip", "link", "set", "lo", "up")
        _sh(*inside, "ip", "route", "add", "default", "via", f"{lan}.1")
        _sh(*rtr, "ip", "link", "set", f"{self.prefix}r{i}", "name", "lan0")
        _sh(*rtr, "ip", "addr", "add", f"{lan}.1/24", "dev", "lan0")
        _sh(*rtr, "ip", "link", "set", "lan0", "up")
        _sh(*rtr, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        _sh(*rtr, "iptables", "-t", "nat", "-A", "POSTROUTING", "-o", "eth0", "-j", "MASQUERADE")

    def popen(self, i: int, cmd: Sequence[str], env: Optional[dict] = None, **kw) -> subprocess.Popen:
        """Start ``cmd`` where participant ``i`` runs (in its own session, so it can be killed as a group)."""
        return subprocess.Popen(["ip", "netns", "exec", self.where(i), *cmd], env=env, start_new_session=True, **kw)

    def close(self) -> None:
        """Delete every namespace made here (their veths and the bridge go with them)."""
        existing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        for ns in [*self.homes.values(), *self.names, self.switch]:
            if any(line.split()[0] == ns for line in existing.splitlines() if line.strip()):
                subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._made.clear()


def tx_bytes(interface: str = "eth0") -> int:
    """Bytes sent so far on ``interface`` of this network namespace (each benchmark peer's own link),
    or -1 where the counter cannot be read."""
    try:
        return int(Path(f"/sys/class/net/{interface}/statistics/tx_bytes").read_text())
    except OSError:
        return -1
