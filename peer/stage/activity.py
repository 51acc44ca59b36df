"""Whether a stage server or pipeline trainer is doing work: its holds while idle, its served rate.

A stage server that no trainer drives, or a trainer whose pipeline lacks a level, takes no inner
steps, so it would never declare a round of the modules it holds: the path peers sharing those
modules would wait for it every round. :class:`IdleHolds` announces such a peer's modules as idle
(:meth:`peer.averaging.net_averager.NetAverager.pause`: still held, its state still served, but
nobody waits for it) from the start and whenever it has been idle for ``idle_timeout`` seconds, and
holds them in their rounds again at its first work.

:class:`ServedRate` is the tokens/s it served over a recent window: what its heartbeats report, 0
once it has served nothing for a window (never the figure measured at join).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any, Callable, Optional, Sequence

__all__ = ["IdleHolds", "ServedRate"]

log = logging.getLogger(__name__)


class IdleHolds:
    """Pauses ``modules``' holds on ``averager`` while idle (see the module docstring); thread-safe.

    ``round_of(module_id)``: the round to hold a module at when work resumes. ``what``: names the
    peer's role in its log lines. Starts paused (the first :meth:`active` holds the modules) unless
    the averager already holds every one of them (a start-up barrier announced them): then it pauses
    only once idle for ``idle_timeout``.
    """

    def __init__(self, averager: Any, modules: Sequence[str], round_of: Callable[[str], int], idle_timeout: float,
                 what: str, clock: Callable[[], float] = time.monotonic):
        self.averager = averager
        self.modules = list(modules)
        self.round_of = round_of
        self.idle_timeout = idle_timeout
        self.what = what
        self.clock = clock
        self._lock = threading.Lock()
        self._paused = False
        self._last = clock()
        self._stop = threading.Event()
        self._supported = all(hasattr(averager, name) for name in ("pause", "resume", "holding"))
        self._thread: Optional[threading.Thread] = None
        if not (self._supported and all(averager.holding(m) for m in self.modules)):
            self.pause("nothing served yet")
        if self._supported:
            self._thread = threading.Thread(target=self._watch, name="idle-holds", daemon=True)
            self._thread.start()

    @property
    def paused(self) -> bool:
        return self._paused

    def active(self) -> None:
        """Work arrived (a backward, a step through the pipeline): hold the modules again if paused."""
        with self._lock:  # one transition at a time, so the averager's state follows ours
            self._last = self.clock()
            if not self._paused:
                return
            self._paused = False
            if self._supported:
                for mid in self.modules:
                    self.averager.resume(mid, self.round_of(mid))
        log.info("%s is driven again: holding %s in their rounds", self.what, ", ".join(self.modules))

    def pause(self, why: str) -> None:
        """Leave the modules' rounds now (``why``: logged); the averager announces them idle."""
        with self._lock:
            paused = self._pause_locked()
        if paused:
            log.info("%s idle (%s): not holding back the rounds of %s", self.what, why, ", ".join(self.modules))

    def _pause_locked(self) -> bool:
        """Announce the modules idle unless they are already; True when they were not (under the lock)."""
        if self._paused:
            return False
        self._paused = True
        if self._supported:
            for mid in self.modules:
                self.averager.pause(mid)
        return True

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.idle_timeout / 4)):
            try:
                with self._lock:
                    if self.clock() - self._last < self.idle_timeout:
                        continue
                    paused = self._pause_locked()
            except Exception as e:  # a DHT shutting down: the records expire on their own
                log.debug("pausing holds failed: %r", e)
                continue
            if paused:
                log.info("%s idle (no work for %.0fs): not holding back the rounds of %s", self.what,
                         self.idle_timeout, ", ".join(self.modules))

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


class ServedRate:
    """Tokens/s served over the last ``window`` seconds (0 when nothing was served in it)."""

    def __init__(self, window: float = 30.0, clock: Callable[[], float] = time.monotonic):
        self.window = window
        self.clock = clock
        self._started = clock()
        self._samples: collections.deque[tuple[float, int]] = collections.deque()

    def rate(self, total_tokens: int) -> float:
        """Record the running total of tokens served and return the rate over the window."""
        now = self.clock()
        self._samples.append((now, int(total_tokens)))
        while len(self._samples) > 1 and self._samples[1][0] <= now - self.window:
            self._samples.popleft()
        t0, n0 = self._samples[0]
        span = now - t0 if now - t0 >= 1e-6 else now - self._started
        return max(0.0, (total_tokens - n0) / span) if span > 0 else 0.0
