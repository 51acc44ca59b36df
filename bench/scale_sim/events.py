"""A discrete-event loop: callbacks at simulated times, in time order (ties: scheduling order).

Its :meth:`EventLoop.now` is the clock handed to :class:`coordinator.Coordinator`, so leases, drains
and rebalancing run on simulated seconds while nothing sleeps."""

from __future__ import annotations

import heapq
import itertools
from typing import Any, Callable

__all__ = ["EventLoop"]


class EventLoop:
    """Run ``callback(*args)`` at simulated time ``at``; :meth:`run` advances until ``end``."""

    def __init__(self, start: float = 0.0):
        self._now = start
        self._queue: list[tuple[float, int, Callable[..., Any], tuple]] = []
        self._seq = itertools.count()
        self.events = 0

    def now(self) -> float:
        """Simulated seconds (the coordinator's clock)."""
        return self._now

    def at(self, when: float, callback: Callable[..., Any], *args: Any) -> None:
        heapq.heappush(self._queue, (max(when, self._now), next(self._seq), callback, args))

    def after(self, delay: float, callback: Callable[..., Any], *args: Any) -> None:
        self.at(self._now + delay, callback, *args)

    def run(self, end: float) -> None:
        """Process every event due before ``end``; the clock then reads ``end``."""
        queue = self._queue
        while queue and queue[0][0] < end:
            when, _, callback, args = heapq.heappop(queue)
            self._now = when
            self.events += 1
            callback(*args)
        self._now = end
