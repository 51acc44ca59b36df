"""Network namespaces for a local network with real links: N participants joined through a Linux
bridge, egress rate-limited (the benchmarks and the tests across hosts use it).

Layout (needs root and ``iproute2``)::

    [hpb4242-p0: eth0 10.77.0.1/24, tbf] --veth--+
    [hpb4242-p1: eth0 10.77.0.2/24, tbf] --veth--+-- br0 (bridge, in namespace hpb4242-sw)
    ...                                          |

Namespace names are the ``prefix``, the creating process's id, then ``-p{i}``, ``-h{i}`` or ``-sw``
(``{tag}`` below): two runs of one benchmark, or a benchmark and a test that runs it, never share
one, and a run removes only the leftovers of runs whose process is gone.

A participant ``i`` listed in ``nat`` sits behind a home router: ``{tag}-p{i}`` is then the router
(its ``eth0`` on the bridge, masquerading with iptables) and the participant runs in
``{tag}-h{i}`` at ``192.168.{100 + i}.2`` behind it, with no route in: a real NAT, as a volunteer's
home router is. :meth:`NetnsBridge.where` and :meth:`NetnsBridge.local_address` say where a
participant runs and listens; :meth:`NetnsBridge.address` is its address on the bridge (a NATed
participant's public one, its router's).

Each peer's egress is shaped with ``tc qdisc add dev eth0 root tbf rate RATE burst 64kb limit 4mb``
(a queue of a few MB: small queues drop packets at low rates): one ``rate`` for all, or one per
participant (``rates``), changed during a run with :meth:`NetnsBridge.set_rate`. Only the upload is
shaped: a participant's download is limited by its senders' egress (and the sum of what they send). The bridge lives in its own
namespace, so nothing is added to the host's network; traffic only goes between the addresses of
the namespaces created here (a private range, never 198.18.0.0/15 where libp2p does not route).
Everything is removed on :meth:`NetnsBridge.close` (also on failure: use it as a context manager).
"""

from __future__ import annotations

import bisect
import logging
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Optional, Sequence

import psutil

from models.durable import atomic_write_text

__all__ = ["NetnsBridge", "link_idle", "netns_available", "read_samples", "sample_tx", "tx_bytes"]

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


def nat_available() -> str:
    """'' if namespaces behind masquerading routers can be made here (:func:`netns_available` and
    ``iptables``), else why not."""
    why = netns_available()
    if not why and shutil.which("iptables") is None:
        why = "needs iptables (apt-get install iptables)"
    return why


def _sh(*args: str) -> None:
    subprocess.run(list(args), check=True, capture_output=True, text=True)


def _leftovers(prefix: str, existing: str) -> list[str]:
    """The namespaces in ``existing`` (``ip netns list``'s output) that a :class:`NetnsBridge` of
    ``prefix`` made in a process that is gone (one killed before its clean-up ran)."""
    gone = []
    for line in existing.splitlines():
        name = line.split()[0] if line.strip() else ""
        tag, dash, _ = name.partition("-")
        pid = tag[len(prefix):]
        if dash and tag.startswith(prefix) and pid.isdigit() and not psutil.pid_exists(int(pid)):
            gone.append(name)
    return gone


class NetnsBridge:
    """``n`` namespaces ``{prefix}{pid}-p{i}`` with address ``{subnet}.{i + 1}`` behind one bridge.

    ``rate``: every participant's egress (tc rate, e.g. ``100mbit``); ``rates``: one per participant
    instead (``n`` of them)."""

    def __init__(self, n: int, rate: str = "100mbit", subnet: str = "10.77.0", prefix: str = "hpb",
                 burst: str = "64kb", limit: str = "4mb", nat: Sequence[int] = (),
                 rates: Optional[Sequence[str]] = None):
        if not subnet.startswith(("10.", "192.168.")) and not subnet.startswith("172."):
            raise ValueError(f"use a private subnet, not {subnet}")
        if rates is not None and len(rates) != n:
            raise ValueError(f"rates must name one rate per participant ({n}), got {len(rates)}")
        self.n, self.rate, self.subnet, self.prefix = n, rate, subnet, prefix
        self.rates = list(rates) if rates is not None else [rate] * n
        """Each participant's egress rate now (:meth:`set_rate` changes one)."""
        self.burst, self.limit = burst, limit
        self.tag = f"{prefix}{os.getpid()}"
        """The start of this bridge's namespace names: the prefix and this process's id."""
        self.switch = f"{self.tag}-sw"
        self.names = [f"{self.tag}-p{i}" for i in range(n)]
        self.nat = frozenset(nat)
        if not self.nat <= set(range(n)) or (self.nat and shutil.which("iptables") is None):
            raise ValueError(f"nat must name participants 0..{n - 1} and needs iptables, got {sorted(self.nat)}")
        self.homes = {i: f"{self.tag}-h{i}" for i in sorted(self.nat)}
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
        existing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        for ns in _leftovers(self.prefix, existing):  # of a run killed before its clean-up
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.close()
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
            _sh(*inside, "tc", "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", self.rates[i],
                "burst", self.burst, "limit", self.limit)
            _sh(*sw, "ip", "link", "set", f"{self.prefix}s{i}", "master", "br0")
            _sh(*sw, "ip", "link", "set", f"{self.prefix}s{i}", "up")
            if i in self.nat:
                self._home(i)
        log.info("namespaces %s up behind a bridge, egress %s%s", ", ".join(self.names),
                 f"{self.rate} each" if len(set(self.rates)) == 1 else ", ".join(self.rates),
                 f"; {', '.join(self.homes.values())} behind NAT" if self.nat else "")

    def set_rate(self, i: int, rate: str) -> None:
        """Change participant ``i``'s egress to ``rate`` now (``tc qdisc change``; packets queued stay)."""
        _sh("ip", "netns", "exec", self.names[i], "tc", "qdisc", "change", "dev", "eth0", "root", "tbf",
            "rate", rate, "burst", self.burst, "limit", self.limit)
        self.rates[i] = rate
        log.info("%s: egress now %s", self.names[i], rate)

    def tx_bytes(self, i: int) -> int:
        """Bytes sent so far on participant ``i``'s link (its ``eth0``; a NATed one's router's), read
        from its namespace (the caller may be in another)."""
        got = subprocess.run(["ip", "netns", "exec", self.names[i], "cat", "/sys/class/net/eth0/statistics/tx_bytes"],
                             capture_output=True, text=True)
        return int(got.stdout.strip() or 0)

    def _home(self, i: int) -> None:
        """Participant ``i``'s home namespace behind ``{tag}-p{i}``, which masquerades for it."""
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


SAMPLE_INTERVAL = 0.01
"""Seconds between two readings of a link's counter by :func:`sample_tx` (a reading costs a few
microseconds: a pread of the sysfs file)."""


def sample_tx(path: str, interface: str = "eth0", interval: float = SAMPLE_INTERVAL) -> None:
    """Read ``interface``'s sent-bytes counter every ``interval`` seconds until SIGTERM or SIGINT,
    then write the readings to ``path``, one ``monotonic_seconds bytes`` line each. The clock is
    ``time.monotonic()``, one clock for every namespace of the host, as the benchmark peers' own
    marks are. Run beside a peer in its namespace (``python -m peer.localnet.netns --sample-tx PATH``): its
    CPU is not the peer's, and the counter is what the ``tbf`` let out, so the readings show when
    the peer's link carried bytes and when it idled. Prints ``sampling`` once it read the counter."""
    stop = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.append(True))
    readings: list[tuple[float, int]] = []
    fd = os.open(f"/sys/class/net/{interface}/statistics/tx_bytes", os.O_RDONLY)
    try:
        readings.append((time.monotonic(), int(os.pread(fd, 32, 0))))
        print("sampling", flush=True)  # whoever started us may go on: the counter is being read
        while not stop:
            time.sleep(interval)
            readings.append((time.monotonic(), int(os.pread(fd, 32, 0))))
        # one reading after the signal, always: it may come before the loop's first test, and then
        # the loop takes none (the last reading must come after the caller's last byte)
        readings.append((time.monotonic(), int(os.pread(fd, 32, 0))))
    finally:
        os.close(fd)
    atomic_write_text(path, "".join(f"{t:.6f} {b}\n" for t, b in readings), temp_name=f"{Path(path).name}.tmp")


def read_samples(path: str) -> list[tuple[float, int]]:
    """:func:`sample_tx`'s readings in ``path``: ``(monotonic_seconds, bytes)``, in time order."""
    out = []
    for line in Path(path).read_text().splitlines():
        t, b = line.split()
        out.append((float(t), int(b)))
    return out


def link_idle(samples: Sequence[tuple[float, int]], start: float, end: float, rate: float,
              busy: float = 0.5, step: float = 0.02) -> dict[str, float]:
    """Where a link idled between ``start`` and ``end`` (monotonic seconds), from a counter's
    ``samples`` (:func:`read_samples`) and its ``rate`` in bytes/s. The window is cut into ``step``
    slices; a slice is busy where the link carried at least ``busy`` of its rate in it (the counter
    read between samples as growing evenly). ``idle_s`` is the window's length less the time its bytes
    took at ``rate``; it is split into ``start_s`` (until the first busy slice), ``tail_s`` (after the
    last one) and ``middle_s`` (the rest, between them: the link waiting within the round)."""
    times = [t for t, _ in samples]
    counts = [b for _, b in samples]

    def at(t: float) -> float:
        i = bisect.bisect_right(times, t)
        if i == 0:
            return float(counts[0])
        if i == len(times):
            return float(counts[-1])
        t0, t1, b0, b1 = times[i - 1], times[i], counts[i - 1], counts[i]
        return b0 + (b1 - b0) * (t - t0) / (t1 - t0) if t1 > t0 else float(b1)

    span = max(0.0, end - start)
    carried = max(0.0, at(end) - at(start))
    idle = max(0.0, span - carried / rate)
    slices = max(1, int(round(span / step)))
    width = span / slices if span else 0.0
    busy_slices = [k for k in range(slices)
                   if width and at(start + (k + 1) * width) - at(start + k * width) >= busy * rate * width]
    if not busy_slices:
        return dict(span_s=span, idle_s=idle, start_s=idle, middle_s=0.0, tail_s=0.0)
    head = min(idle, busy_slices[0] * width)
    tail = min(idle - head, (slices - 1 - busy_slices[-1]) * width)
    return dict(span_s=span, idle_s=idle, start_s=head, middle_s=max(0.0, idle - head - tail), tail_s=tail)


def main(argv: Optional[Sequence[str]] = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description="sample this namespace's link counter (see sample_tx)")
    parser.add_argument("--sample-tx", required=True, metavar="PATH", help="where the readings go on SIGTERM")
    parser.add_argument("--interface", default="eth0")
    parser.add_argument("--interval", type=float, default=SAMPLE_INTERVAL)
    args = parser.parse_args(argv)
    sample_tx(args.sample_tx, args.interface, args.interval)


if __name__ == "__main__":
    main()
