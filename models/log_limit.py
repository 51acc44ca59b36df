"""At most one log line per key per interval: what every door that refuses bad input logs through.

A refusal logged in full each time lets anyone who can reach a port (the coordinator's gRPC, a peer's
p2p streams) fill the operator's disk for free. :class:`LogLimiter` admits one line per key (a method,
a handler) per ``interval`` seconds and counts what it held back, so the next line can say how many.

Standard library only: the coordinator's image copies this file alone.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

__all__ = ["LogLimiter", "LOG_INTERVAL"]

LOG_INTERVAL = 60.0
"""Seconds between two log lines about the same kind of refusal."""


class LogLimiter:
    """At most one log line per key per ``interval`` seconds; counts what it holds back.

    :meth:`admit` returns how many events of ``key`` were held back since its last line when a line
    may be written now, and None when this one is held back too.
    """

    def __init__(self, interval: float = LOG_INTERVAL, clock: Callable[[], float] = time.monotonic):
        self.interval = interval
        self._clock = clock
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def admit(self, key: str) -> Optional[int]:
        now = self._clock()
        last = self._last.get(key)
        if last is not None and now - last < self.interval:
            self._held[key] = self._held.get(key, 0) + 1
            return None
        self._last[key] = now
        return self._held.pop(key, 0)
