"""Network namespaces for benchmarks: N peers joined through a Linux bridge, egress rate-limited.

Layout (needs root and ``iproute2``)::

    [hpb-p0: eth0 10.77.0.1/24, tbf] --veth--+
    [hpb-p1: eth0 10.77.0.2/24, tbf] --veth--+-- hpbbr (bridge, in namespace hpb-sw)
    ...                                      |

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
                 burst: str = "64kb", limit: str = "4mb"):
        if not subnet.startswith(("10.", "192.168.")) and not subnet.startswith("172."):
            raise ValueError(f"use a private subnet, not {subnet}")
        self.n, self.rate, self.subnet, self.prefix = n, rate, subnet, prefix
        self.burst, self.limit = burst, limit
        self.switch = f"{prefix}-sw"
        self.names = [f"{prefix}-p{i}" for i in range(n)]
        self._made: list[str] = []

    def address(self, i: int) -> str:
        return f"{self.subnet}.{i + 1}"

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
        log.info("namespaces %s up behind a bridge, egress %s each", ", ".join(self.names), self.rate)

    def popen(self, i: int, cmd: Sequence[str], env: Optional[dict] = None, **kw) -> subprocess.Popen:
        """Start ``cmd`` inside peer namespace ``i`` (in its own session, so it can be killed as a group)."""
        return subprocess.Popen(["ip", "netns", "exec", self.names[i], *cmd], env=env, start_new_session=True, **kw)

    def close(self) -> None:
        """Delete every namespace made here (their veths and the bridge go with them)."""
        existing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        for ns in [*self.names, self.switch]:
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
