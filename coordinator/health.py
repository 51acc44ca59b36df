"""Long-run health signals: a path whose validation bits per byte rise over several archive scorings,
and a peer whose training loss diverges, each with the module and round where it began.

Both read only what the coordinator already has: the archive's scorings (the ``bpb/<path>`` history
series, with the round of each scoring in ``bpb_round/<path>``), the loss and round every heartbeat
reports per module (:class:`coordinator.results.ProgressReport`), and when each holder of a module
arrived on it (its join or its last move). The decisions are pure functions of those
(:func:`bpb_rise`, :func:`suspect_module`); :class:`LossWatch` keeps, per peer and module, the few
numbers a divergence needs (memory only: a restarted coordinator starts watching again).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

__all__ = ["HealthRules", "BpbRise", "LossDivergence", "LossWatch", "bpb_rise", "suspect_module",
           "BPB_ROUND_PREFIX", "bpb_round_series"]

BPB_ROUND_PREFIX = "bpb_round/"
"""The round of each archive scoring of a path, at the same times as its ``bpb/<path>`` points."""


def bpb_round_series(path_name: str) -> str:
    return BPB_ROUND_PREFIX + path_name


@dataclass(frozen=True)
class HealthRules:
    """When the coordinator flags a path or a peer."""

    bpb_rises: int = 3
    """A path is flagged after this many archive scorings in a row each rose over the one before ..."""
    bpb_min_rise: float = 0.005
    """... by at least this fraction of the lowest one in total (scorings of a fixed validation set are
    deterministic: any rise is the model's, and three in a row is a trend, not noise)."""
    loss_reports: int = 3
    """A peer is flagged after this many reports of a module, at rounds after one another ..."""
    loss_rise: float = 0.10
    """... each more than this fraction above the lowest loss it reported for that module in its
    current assignment."""


@dataclass(frozen=True)
class BpbRise:
    """A path's bits per byte rising: from ``best`` (the scoring before the rise) to ``latest``."""

    path: str
    best: float
    latest: float
    rises: int
    since_time: float
    """When the first rising scoring was reported."""
    since_round: int
    """The round of the first rising scoring (its path's lowest module round), -1 when unknown."""
    module: str = ""

    @property
    def rise(self) -> float:
        return (self.latest - self.best) / self.best if self.best > 0 else math.inf


def bpb_rise(path: str, points: Sequence[tuple[float, float]], rounds: Mapping[float, float],
             rules: HealthRules) -> Optional[BpbRise]:
    """The trailing run of rising scorings of ``points`` ((time, bpb), oldest first), when it has at
    least ``rules.bpb_rises`` rises and rose by ``rules.bpb_min_rise`` of its start in total; else None.
    ``rounds``: time -> round of the scoring at that time."""
    if len(points) < 2:
        return None
    start = len(points) - 1
    while start > 0 and points[start - 1][1] < points[start][1]:
        start -= 1
    rises = len(points) - 1 - start
    best, latest = points[start][1], points[-1][1]
    if rises < rules.bpb_rises or not latest - best >= rules.bpb_min_rise * best:
        return None
    t = points[start + 1][0]
    return BpbRise(path, best, latest, rises, t, int(rounds.get(t, -1)))


def suspect_module(modules: Sequence[str], rising_paths: Sequence[Sequence[str]],
                   arrivals: Mapping[str, float], before: float, paths_through: Mapping[str, int]) -> str:
    """The module of a rising path most likely behind it: the one with the largest share of its paths
    rising (a module pulled off course shows in every path through it, a module shared by every path
    only in those it pulls), then the one whose newest holder arrived (joined or was moved onto it)
    latest at or before ``before``, then lattice order. ``modules``: the path's module ids in lattice
    order; ``rising_paths``: every rising path's modules; ``arrivals``: module id -> when its newest
    current holder arrived; ``paths_through``: module id -> how many paths of the lattice hold it."""
    def key(k: int) -> tuple[float, float, int]:
        m = modules[k]
        shared = sum(1 for other in rising_paths if m in other) / max(1, paths_through.get(m, 1))
        arrived = arrivals.get(m, -math.inf)
        return (shared, arrived if arrived <= before else -math.inf, -k)

    return modules[max(range(len(modules)), key=key)] if modules else ""


@dataclass(frozen=True)
class LossDivergence:
    """A peer's loss on one module above its best for ``reports`` reports in a row."""

    peer_id: str
    module: str
    best: float
    latest: float
    reports: int
    since_round: int
    """The round of the first report of the run above the best."""
    since_time: float

    @property
    def rise(self) -> float:
        return (self.latest - self.best) / self.best if self.best > 0 else math.inf


@dataclass
class _Track:
    version: int
    best: float = math.inf
    last_round: int = -1
    latest: float = math.nan
    above: int = 0
    since_round: int = -1
    since_time: float = 0.0


@dataclass
class LossWatch:
    """Per peer and module: the lowest loss reported in the current assignment and the reports above
    it since; not thread-safe (the coordinator's lock)."""

    rules: HealthRules = field(default_factory=HealthRules)
    _tracks: dict[tuple[str, str], _Track] = field(default_factory=dict)

    def report(self, peer_id: str, module_id: str, round_no: int, loss: float, version: int, now: float) -> None:
        """One heartbeat's loss of ``module_id`` at ``round_no``; ``version``: the peer's assignment
        version (a new assignment starts a new track: another path has another loss). A report of a
        round already seen, or a loss not said (NaN), changes nothing."""
        key = (peer_id, module_id)
        tr = self._tracks.get(key)
        if tr is None or tr.version != version:
            tr = self._tracks[key] = _Track(version)
        if round_no <= tr.last_round or math.isnan(loss):
            return
        tr.last_round, tr.latest = round_no, loss
        if loss <= tr.best * (1.0 + self.rules.loss_rise):
            tr.best = min(tr.best, loss)
            tr.above = 0
            return
        if tr.above == 0:
            tr.since_round, tr.since_time = round_no, now
        tr.above += 1

    def forget(self, peer_id: str) -> None:
        for key in [k for k in self._tracks if k[0] == peer_id]:
            del self._tracks[key]

    def diverging(self, peer_ids: Optional[set[str]] = None) -> list[LossDivergence]:
        """Per flagged peer (of ``peer_ids``; None: all), its module whose run above the best began
        first (then the lowest module id), sorted by peer id."""
        first: dict[str, LossDivergence] = {}
        for (peer_id, module_id), tr in sorted(self._tracks.items()):
            if tr.above < self.rules.loss_reports or (peer_ids is not None and peer_id not in peer_ids):
                continue
            d = LossDivergence(peer_id, module_id, tr.best, tr.latest, tr.above, tr.since_round, tr.since_time)
            if peer_id not in first or d.since_round < first[peer_id].since_round:
                first[peer_id] = d
        return [first[p] for p in sorted(first)]
