"""The run's totals and history: how :class:`coordinator.core.Coordinator` remembers the whole run
for the status page. Counters that survive a restart (event counters and each module's highest round,
kept in the store's meta table), the sampled history (:mod:`coordinator.history`), the validation bits
per byte that archive peers report, and the paths whose validation rises.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import threading
from collections import Counter
from typing import Callable, Iterable, Optional, Sequence

from coordinator.errors import InvalidArgument
from coordinator.health import BpbRise, HealthRules, bpb_rise, bpb_round_series, suspect_module
from coordinator.history import BPB_PREFIX, History, bpb_series
from coordinator.records import MODE_ARCHIVE, PeerRecord
from coordinator.results import PathEvaluation
from coordinator.store import WriteBatch
from models import strict_json
from models.config import LatticeConfig, format_path, parse_path

__all__ = ["Story", "COUNTERS_META_KEY", "ROUNDS_META_KEY", "MAX_BPB", "load_totals"]

log = logging.getLogger(__name__)

COUNTERS_META_KEY = "counters"
"""Meta key of the event counters (JSON object), so /metrics counters do not restart from zero."""
ROUNDS_META_KEY = "module_rounds"
"""Meta key of each module's highest reported outer round (JSON object)."""
MAX_BPB = 64.0
"""Largest validation bits per byte accepted (a byte holds 8 bits; an untrained model is near log2 of
the vocabulary per token, far below this)."""


def load_totals(meta: dict[str, str]) -> tuple[Counter, dict[str, int]]:
    """The counters and module rounds a store's meta holds (empty for a new store)."""
    counters = Counter({k: int(v) for k, v in json.loads(meta.get(COUNTERS_META_KEY, "{}")).items()})
    rounds = {k: int(v) for k, v in json.loads(meta.get(ROUNDS_META_KEY, "{}")).items()}
    return counters, rounds


class Story:
    """``sample_history``, ``take_totals``, ``history_series`` and evaluation reports.

    Given the coordinator's lock and clock, the run's lattice, its peer table, ``leased`` (the peers
    holding a lease), and the totals it keeps and persists: the event counters, each module's highest
    round and the history. ``rules``: what makes a path's validation a rise."""

    def __init__(
        self,
        *,
        lock: threading.RLock,
        clock: Callable[[], float],
        lattice: LatticeConfig,
        peers: dict[str, PeerRecord],
        leased: Callable[[], Iterable[str]],
        counters: Counter[str],
        module_rounds: dict[str, int],
        history: History,
        rules: HealthRules,
    ):
        self._lock = lock
        self._clock = clock
        self._lattice = lattice
        self._peers = peers
        self._leased = leased
        self._counters = counters
        self._module_rounds = module_rounds
        self._history = history
        self._rules = rules
        self._points = WriteBatch()
        """History points from reports (evaluations), committed with the next group commit."""
        self._written_totals: tuple[str, str] = ("", "")

    def sample_history(self) -> WriteBatch:
        """Add one point to each run-wide series (tokens/s over the last interval, peers online,
        tokens and bytes exchanged so far) and return the points to commit."""
        batch = WriteBatch()
        with self._lock:
            now = self._clock()
            tokens = sum(p.tokens for p in self._peers.values())
            previous = self._history.last("tokens")
            if previous is not None and now > previous[0]:
                self._history.add("tokens_per_s", now, max(0.0, (tokens - previous[1]) / (now - previous[0])), batch)
            self._history.add("tokens", now, float(tokens), batch)
            self._history.add("peers_online", now, float(sum(1 for p in self._leased()
                                                             if self._peers[p].state == "active")), batch)
            self._history.add("bytes_exchanged", now, float(sum(p.bytes_exchanged for p in self._peers.values())),
                              batch)
        return batch

    def take_totals(self) -> WriteBatch:
        """The counters and module rounds, when they changed since the last call (group commit)."""
        with self._lock:
            written = (strict_json.dumps(dict(self._counters), sort_keys=True),
                       strict_json.dumps(self._module_rounds, sort_keys=True))
            if written == self._written_totals:
                return WriteBatch()
            self._written_totals = written
        return WriteBatch(meta={COUNTERS_META_KEY: written[0], ROUNDS_META_KEY: written[1]})

    def check_evaluations(self, evaluations: Sequence[PathEvaluation]) -> None:
        """:class:`InvalidArgument` for an evaluation of a path outside the lattice, a bits per byte that
        is not finite in [0, :data:`MAX_BPB`], or a path given twice."""
        lat = self._lattice
        if len(evaluations) > min(lat.num_paths, 65536):
            raise InvalidArgument("evaluations", f"{len(evaluations)} entries, more than the lattice's paths")
        seen = set()
        for e in evaluations:
            if len(e.path) != lat.levels or any(i >= lat.modules_per_level for i in e.path):
                raise InvalidArgument("evaluations.path", f"{list(e.path)[:8]} is not a path of this run's lattice")
            if not math.isfinite(e.bpb) or not 0 <= e.bpb <= MAX_BPB:
                raise InvalidArgument("evaluations.bpb", f"{e.bpb} for path {format_path(e.path)} is not in "
                                                         f"[0, {MAX_BPB:g}] bits per byte")
            if e.round > 1 << 62:
                raise InvalidArgument("evaluations.round", f"{e.round} is beyond {1 << 62}")
            if e.path in seen:
                raise InvalidArgument("evaluations.path", f"path {format_path(e.path)} is given twice")
            seen.add(e.path)

    def record_evaluations(self, peer: PeerRecord, evaluations: Sequence[PathEvaluation], now: float) -> None:
        """Add an archive peer's validation results to the history, committed with the next group
        commit (under the lock); any other peer's are refused: the archive evaluates the snapshots
        every run shares, trainers do not."""
        if peer.assignment is None or peer.assignment.mode != MODE_ARCHIVE:
            work = peer.assignment.label() if peer.assignment else "nothing"
            raise InvalidArgument("evaluations", f"only an archive peer reports validation bits per byte; "
                                                 f"{peer.peer_id} holds {work}")
        self.check_evaluations(evaluations)  # the servicer checked them already; direct callers too
        for e in evaluations:
            self._history.add(bpb_series(format_path(e.path)), now, e.bpb, self._points)
            self._history.add(bpb_round_series(format_path(e.path)), now, float(e.round), self._points)
        self._counters["evaluations"] += len(evaluations)

    def count_rounds(self, peer: PeerRecord, previous: dict[str, int], reported: dict[str, int]) -> None:
        """Raise each module's highest round and the peer's rounds from one heartbeat (under the lock):
        ``previous`` are the rounds this peer reported before in its lease, ``reported`` the new ones."""
        advanced = 0
        for module_id, rnd in reported.items():
            if rnd > self._module_rounds.get(module_id, 0):
                self._module_rounds[module_id] = rnd
            before: Optional[int] = previous.get(module_id)
            if before is not None and rnd > before:
                advanced = max(advanced, rnd - before)
        peer.rounds += advanced

    def take_points(self) -> WriteBatch:
        """History points reported since the last call, for a group commit (under the lock)."""
        points, self._points = self._points, WriteBatch()
        return points

    def history_series(self) -> dict[str, list[tuple[float, float]]]:
        """Every history series (:mod:`coordinator.history`), copied under the lock."""
        with self._lock:
            return self._history.series()

    def latest_bpb(self) -> dict[str, tuple[float, float]]:
        """path name -> its latest validation point (time, bits per byte); under the lock."""
        return {name[len(BPB_PREFIX):]: self._history.last(name) for name in self._history.names()
                if name.startswith(BPB_PREFIX)}

    def bpb_rises(self) -> list[BpbRise]:
        """Paths whose validation bits per byte rise, each with its suspect module (under the lock)."""
        lattice = self._lattice
        rising: list[BpbRise] = []
        for name in self._history.names():
            if not name.startswith(BPB_PREFIX):
                continue
            path = name[len(BPB_PREFIX):]
            points = self._history.series([name])[name]
            rounds = dict(self._history.series([bpb_round_series(path)])[bpb_round_series(path)])
            rise = bpb_rise(path, points, rounds, self._rules)
            if rise is not None:
                rising.append(rise)
        if not rising:
            return []
        arrivals: dict[str, float] = {}
        for p in self._peers.values():
            if p.state == "active" and p.assignment is not None:
                arrived = max(p.last_joined, p.last_moved)
                for m in p.assignment.module_ids:
                    arrivals[m] = max(arrivals.get(m, arrived), arrived)
        modules = {r.path: lattice.path_modules(parse_path(r.path, lattice.levels)) for r in rising}
        through = {m: len(lattice.paths_through(m)) for m in {m for ms in modules.values() for m in ms}}
        return [dataclasses.replace(r, module=suspect_module(modules[r.path], list(modules.values()), arrivals,
                                                             r.since_time, through)) for r in rising]
