"""The run's story for the status page's plots: sampled time series, kept in the store and bounded.

Every ``history_interval`` seconds the coordinator samples the run (:data:`RUN_SERIES`: tokens per
second, peers online, tokens and bytes exchanged so far); every validation an archive peer reports
adds a point to that path's series (``bpb/0,1``). A series holds at most ``history_points`` points:
when one overflows, its older half is thinned to every other point (:func:`thin`), so the latest
points stay at full resolution and the whole run stays visible at a coarser one, in bounded space.

:class:`History` is the in-memory copy the page reads; each change is also written into a
:class:`~coordinator.store.WriteBatch`, so the store holds the same points and a restarted
coordinator continues the same plots.
"""

from __future__ import annotations

import bisect
import math
from typing import Iterable, Optional

from coordinator.store import WriteBatch

__all__ = ["History", "RUN_SERIES", "BPB_PREFIX", "thin", "bpb_series"]

RUN_SERIES = ("tokens_per_s", "peers_online", "tokens", "bytes_exchanged")
"""Run-wide series sampled every ``history_interval``."""
BPB_PREFIX = "bpb/"
"""Validation bits per byte of one path: ``bpb/0,1`` (:func:`models.config.format_path`)."""

Point = tuple[float, float]


def bpb_series(path_name: str) -> str:
    """The series of a path's validation bits per byte."""
    return BPB_PREFIX + path_name


def thin(points: list[Point], max_points: int) -> list[Point]:
    """The points to drop so that ``points`` (oldest first) fits ``max_points``: every other point of
    the older half, oldest kept, until it fits. Dropping only old points keeps the recent ones exact;
    halving their density each time keeps the space bounded whatever the run's length."""
    if max_points < 4:
        raise ValueError(f"max_points must be >= 4, got {max_points}")
    kept, dropped = list(points), []
    while len(kept) > max_points:
        older = len(kept) // 2
        dropped += kept[1:older:2]
        kept = kept[:older:2] + kept[older:]
    return dropped


class History:
    """Time series by name, each bounded to ``max_points`` (not thread-safe: the coordinator's lock)."""

    def __init__(self, loaded: Optional[dict[str, list[Point]]] = None, max_points: int = 2000):
        if max_points < 4:
            raise ValueError(f"max_points must be >= 4, got {max_points}")
        self.max_points = max_points
        self._series: dict[str, list[Point]] = {name: sorted(pts) for name, pts in (loaded or {}).items()}

    def add(self, name: str, t: float, value: float, batch: WriteBatch) -> None:
        """Record ``value`` at time ``t`` in series ``name`` (replacing a point at the same time),
        thinning the series if it overflows; the changes go into ``batch`` as well."""
        if not (math.isfinite(t) and math.isfinite(value)):
            raise ValueError(f"history {name}: a point needs a finite time and value, got ({t}, {value})")
        points = self._series.setdefault(name, [])
        i = bisect.bisect_left(points, (t, -math.inf))
        if i < len(points) and points[i][0] == t:
            points[i] = (t, value)
        else:
            points.insert(i, (t, value))
        batch.history[(name, t)] = value
        if len(points) > self.max_points:
            dropped = thin(points, self.max_points)
            gone = {pt[0] for pt in dropped}
            self._series[name] = [pt for pt in points if pt[0] not in gone]
            for old_t, _ in dropped:
                batch.history.pop((name, old_t), None)
                batch.deleted_history.add((name, old_t))

    def last(self, name: str) -> Optional[Point]:
        """The latest point of ``name`` (None when it has none)."""
        points = self._series.get(name)
        return points[-1] if points else None

    def names(self) -> list[str]:
        return sorted(self._series)

    def series(self, names: Optional[Iterable[str]] = None) -> dict[str, list[Point]]:
        """Copies of the named series (every series when ``names`` is None; unknown names are empty)."""
        wanted = self._series if names is None else names
        return {name: list(self._series.get(name, ())) for name in wanted}
