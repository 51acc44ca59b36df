"""A peer's link rates measured from its own averaging rounds, which the coordinator's planner sizes
exchanges by (the bandwidth probe at join only gives the first figures).

Every module of a round exchanges at once over the same link, so one round gives one measurement:
the bytes all its modules sent (received) over the longest of their all-reduce times
(:attr:`peer.diloco.ModuleReport.transfer_seconds`, from the group's forming to the end of its
all-reduce, through direct lanes, the p2p daemon or relays alike). That time includes waiting for
the group's slowest member, so the figure is a lower bound of the peer's own link, and the rate at
which this peer's exchanges actually go: what the planner needs. Rounds that moved under
:data:`MIN_MEASURED_BYTES` in a direction, or took under :data:`MIN_MEASURED_SECONDS`, are left out
(latency, not bandwidth, sets their time). The estimate is an exponentially weighted mean, so a link
that changes shows in a few rounds while one slow round does not swing it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

__all__ = ["LinkRates", "MIN_MEASURED_BYTES", "MIN_MEASURED_SECONDS", "SMOOTHING"]

MIN_MEASURED_BYTES = 256 * 1024
"""A direction of a round that moved fewer bytes is not a measurement of bandwidth."""
MIN_MEASURED_SECONDS = 0.05
"""A round whose all-reduces took less time is not a measurement of bandwidth."""
SMOOTHING = 0.3
"""Weight of the newest round in the estimate (the rest is the estimate before it)."""


@dataclass
class LinkRates:
    """Upload and download rates in bytes/s from the rounds seen so far (0: not measured yet).
    Plain numbers, so a peer's status (:class:`peer.node.progress.PeerStatus`) carries it as it is:
    rounds are observed on the training thread, and heartbeats read single floats from theirs."""

    upload_bps: float = 0.0
    download_bps: float = 0.0
    upload_rounds: int = 0
    """Rounds that counted towards ``upload_bps``."""
    download_rounds: int = 0

    def observe(self, modules: Iterable) -> bool:
        """Take one round's module reports (:class:`peer.diloco.ModuleReport`, all exchanged at once);
        returns True when it counted in either direction."""
        sent = received = 0
        seconds = 0.0
        for m in modules:
            sent += m.bytes_sent
            received += m.bytes_received
            seconds = max(seconds, m.transfer_seconds)
        return self.observe_exchange(sent, received, seconds)

    def observe_exchange(self, sent: int, received: int, seconds: float) -> bool:
        """One round's bytes each way and the seconds they took; True when it counted."""
        if not seconds >= MIN_MEASURED_SECONDS:
            return False
        counted = False
        if sent >= MIN_MEASURED_BYTES:
            self.upload_bps = _smoothed(self.upload_bps, sent / seconds, self.upload_rounds)
            self.upload_rounds += 1
            counted = True
        if received >= MIN_MEASURED_BYTES:
            self.download_bps = _smoothed(self.download_bps, received / seconds, self.download_rounds)
            self.download_rounds += 1
            counted = True
        return counted


def _smoothed(old: float, new: float, seen: int) -> float:
    return new if seen == 0 else old + SMOOTHING * (new - old)
