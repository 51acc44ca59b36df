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

Bytes are not all a round's exchanges cost: matchmaking, round trips between parts and waiting for
the group's other members block training too, whatever the codec, and on short rounds or long round
trips they are most of it. :attr:`LinkRates.overhead_s` is that part: the seconds a round's
exchanges block training when it waits for them (:attr:`peer.diloco.RoundReport.blocking_seconds`:
the wait, or for a round whose exchanges ran behind the next one, their length) beyond its bytes at
the rates above, from rounds whose every module was applied. A round in overlap mode counts what its
exchanges would have blocked, not the nothing they did: the planner asks what a plan costs, and were
overlap to read as free, it would leave overlap for the plan it left, back and forth. The planner
adds it to each candidate's byte time (:mod:`coordinator.planner`): a longer round amortises it, a
smaller codec does not.

A peer's first :data:`WARMUP_ROUNDS` rounds count for neither: they wait for the others to arrive,
dial the group's members for the first time and open lanes, and a plan made from them would be a
plan for the start-up.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

from peer.averaging.contract import LinkTimes

__all__ = ["LinkRates", "MIN_MEASURED_BYTES", "MIN_MEASURED_SECONDS", "SMOOTHING", "WARMUP_ROUNDS", "best_rate"]

MIN_MEASURED_BYTES = 256 * 1024
"""A direction of a round that moved fewer bytes is not a measurement of bandwidth."""
MIN_MEASURED_SECONDS = 0.05
"""A moment this soon after the round's start is not a measurement of bandwidth."""
SMOOTHING = 0.3
"""Weight of the newest round in the estimate (the rest is the estimate before it)."""
WARMUP_ROUNDS = 2
"""A peer's first rounds, which count towards nothing (:meth:`LinkRates.observe_round`)."""


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
    overhead_s: float = 0.0
    """Seconds a round's exchanges block training beyond their bytes at the rates above (0: not yet)."""
    overhead_rounds: int = 0
    """Rounds that counted towards ``overhead_s``."""
    rounds_seen: int = 0
    """Rounds given to :meth:`observe_round`, the warm-up ones included."""

    def observe_round(self, report) -> bool:
        """Take one outer round (:class:`peer.diloco.RoundReport`) after the first
        :data:`WARMUP_ROUNDS`: its rates, and, when every module was applied, its overhead. True when
        the rates counted."""
        self.rounds_seen += 1
        if self.rounds_seen <= WARMUP_ROUNDS:
            return False
        counted = self.observe(report.modules.values())
        if report.applied:
            self.observe_overhead(report.modules.values(), report.blocking_seconds)
        return counted

    def observe_overhead(self, modules: Iterable, blocked_seconds: float) -> None:
        """One applied round's modules and the seconds its exchanges blocked training: the part of
        them its bytes at the current rates do not explain."""
        modules = list(modules)
        sent = sum(m.bytes_sent for m in modules)
        received = sum(m.bytes_received for m in modules)
        bytes_s = ((sent / self.upload_bps if self.upload_bps > 0 else 0.0)
                   + (received / self.download_bps if self.download_bps > 0 else 0.0))
        self.overhead_s = _smoothed(self.overhead_s, max(0.0, blocked_seconds - bytes_s), self.overhead_rounds)
        self.overhead_rounds += 1

    def observe(self, modules: Iterable) -> bool:
        """Take one round's module reports (:class:`peer.diloco.ModuleReport`, all exchanged at once);
        returns True when it counted in either direction. Reports with part-by-part times
        (``link_times``) give the measurement; where none has them, the totals over the longest
        all-reduce do."""
        modules = list(modules)
        timed = [m.link_times for m in modules if m.link_times is not None]
        if any(t.up or t.down for t in timed):
            times = functools.reduce(LinkTimes.merge, timed)
            return self.observe_rates(best_rate(times.up_from, times.up), best_rate(times.down_from, times.down))
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
