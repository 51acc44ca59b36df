"""A peer's link rates measured from its own averaging rounds, which the coordinator's planner sizes
exchanges by (the bandwidth probe at join only gives the first figures).

Every module of a round exchanges at once over the same link, so one round gives one measurement per
direction, from when each part of every module's all-reduce crossed the link
(:class:`peer.averaging.contract.LinkTimes`, through direct lanes, the p2p daemon or relays alike):
the rate is the largest ``bytes through by t / (t - start)`` over the moments t a part got through,
``start`` the earliest moment anything of the round could cross. Bytes through by t cannot exceed
what the link carries in ``t - start``, so every such figure is a lower bound of the link, and the
largest is the tightest: the parts to and from fast members, through early, set it, while a slow
member's parts, through late, do not drag it down. A peer grouped with a slow one then still reads
as fast, and the planner charges the slow one's modules alone for its link, not every module of
the fast one's path. An exchange known only by its totals (``LinkTimes`` absent) counts as its bytes
over its all-reduce's time (:attr:`peer.diloco.ModuleReport.transfer_seconds`, from the group's
forming to its end), a bound that includes waiting for the slowest member.

A figure counts only from moments when at least :data:`MIN_MEASURED_BYTES` were through and
:data:`MIN_MEASURED_SECONDS` had passed (before that, latency, not bandwidth, sets the time). The
estimate is an exponentially weighted mean, so a link that changes shows in a few rounds while one
slow round does not swing it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

__all__ = ["LinkRates", "MIN_MEASURED_BYTES", "MIN_MEASURED_SECONDS", "SMOOTHING", "best_rate"]

MIN_MEASURED_BYTES = 256 * 1024
"""A direction of a round that moved fewer bytes is not a measurement of bandwidth."""
MIN_MEASURED_SECONDS = 0.05
"""A moment this soon after the round's start is not a measurement of bandwidth."""
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
        returns True when it counted in either direction. Reports with part-by-part times
        (``link_times``) give the measurement; where none has them, the totals over the longest
        all-reduce do."""
        modules = list(modules)
        timed = [m.link_times for m in modules if getattr(m, "link_times", None) is not None]
        if any(t.up or t.down for t in timed):
            up = best_rate(min(t.up_from for t in timed), [e for t in timed for e in t.up])
            down = best_rate(min(t.down_from for t in timed), [e for t in timed for e in t.down])
            return self.observe_rates(up, down)
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
        return self.observe_rates(sent / seconds if sent >= MIN_MEASURED_BYTES else None,
                                  received / seconds if received >= MIN_MEASURED_BYTES else None)

    def observe_rates(self, up: Optional[float], down: Optional[float]) -> bool:
        """One round's measured rates in bytes/s (None: that direction was not measured); True when
        either counted."""
        if up is not None:
            self.upload_bps = _smoothed(self.upload_bps, up, self.upload_rounds)
            self.upload_rounds += 1
        if down is not None:
            self.download_bps = _smoothed(self.download_bps, down, self.download_rounds)
            self.download_rounds += 1
        return up is not None or down is not None


def best_rate(start: float, through: Sequence[tuple[float, int]]) -> Optional[float]:
    """The largest ``bytes through by t / (t - start)`` over the moments ``t`` of ``through``
    (``(t, bytes)`` as each part got through), counting only moments with at least
    :data:`MIN_MEASURED_BYTES` through and :data:`MIN_MEASURED_SECONDS` after ``start``; None when
    no moment counts."""
    best = None
    total = 0
    for t, n in sorted(through):
        total += n
        elapsed = t - start
        if total >= MIN_MEASURED_BYTES and elapsed >= MIN_MEASURED_SECONDS:
            rate = total / elapsed
            best = rate if best is None or rate > best else best
    return best


def _smoothed(old: float, new: float, seen: int) -> float:
    return new if seen == 0 else old + SMOOTHING * (new - old)
