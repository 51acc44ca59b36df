"""Long-run health signals (coordinator.health): a path whose validation bits per byte rise over several
archive scorings and a peer whose training loss diverges, with the module and round where each began;
the pure rules, then the coordinator core (injected clock) through status.json's snapshot and /metrics."""

from __future__ import annotations

import math

from coordinator.core import Coordinator
from coordinator.health import HealthRules, LossWatch, bpb_rise, suspect_module
from coordinator.metrics import render_metrics
from coordinator.records import Capabilities
from coordinator.results import PathEvaluation, ProgressReport
from coordinator.settings import CoordinatorSettings
from coordinator.status import snapshot
from coordinator.store import MemoryStore
from coordinator.web import render_page
from models.presets import tiny_cpu

RULES = HealthRules(bpb_rises=3, bpb_min_rise=0.005, loss_reports=3, loss_rise=0.10)


def _pts(values):
    return [(float(10 * k), v) for k, v in enumerate(values)]


def test_a_path_is_flagged_after_three_rising_scorings_in_a_row_from_the_first_rise():
    rounds = {10.0 * k: float(100 + k) for k in range(8)}
    r = bpb_rise("0,1", _pts([3.0, 2.5, 2.0, 2.02, 2.05, 2.1]), rounds, RULES)
    assert r is not None and (r.best, r.latest, r.rises, r.since_time, r.since_round) == (2.0, 2.1, 3, 30.0, 103)
    assert math.isclose(r.rise, 0.05)
    assert bpb_rise("0,1", _pts([3.0, 2.5, 2.0, 2.02, 2.05]), rounds, RULES) is None  # two rises only
    assert bpb_rise("0,1", _pts([2.0, 2.02, 2.05, 2.1, 2.08]), rounds, RULES) is None  # the last one fell
    assert bpb_rise("0,1", _pts([2.0, 2.001, 2.002, 2.003]), rounds, RULES) is None  # 0.15% in all: noise
    assert bpb_rise("0,1", _pts([2.0, 2.0, 2.05, 2.1, 2.2]), rounds, RULES).rises == 3  # a flat step ends the run
    assert bpb_rise("0,1", _pts([2.0, 2.1, 2.2, 2.3]), {}, RULES).since_round == -1


def test_the_suspect_module_is_the_one_rising_paths_share_then_the_newest_arrival_before_the_rise():
    path = ["embed", "L0M1", "L1M0", "head"]
    through = {"embed": 4, "head": 4, "L0M0": 2, "L0M1": 2, "L1M0": 2, "L1M1": 2}  # a 2x2 lattice
    others = [path, ["embed", "L0M0", "L1M0", "head"]]
    # both paths through L1M0 rise; only half of those through the embedding and the head do
    assert suspect_module(path, others, {"embed": 99.0}, 100.0, through) == "L1M0"
    alone = [path]
    assert suspect_module(path, alone, {"L0M1": 90.0, "L1M0": 50.0, "embed": 95.0}, 100.0, through) == "L0M1"
    assert suspect_module(path, alone, {"L0M1": 150.0, "L1M0": 50.0}, 100.0, through) == "L1M0"  # L0M1's came after
    assert suspect_module(path, alone, {}, 100.0, through) == "L0M1"  # nothing points further: lattice order


def test_a_peers_loss_diverges_after_three_new_rounds_above_its_best_and_recovers():
    w = LossWatch(RULES)
    for rnd, loss in enumerate([5.0, 4.0, 3.0, 3.2, 3.5, 3.6]):
        w.report("p", "L0M0", rnd, loss, version=1, now=float(rnd))
    assert w.diverging() == []  # 3.2 is within 10% of 3.0: only two reports above
    w.report("p", "L0M0", 5, 9.0, version=1, now=9.0)  # a round already reported changes nothing
    w.report("p", "L0M0", 6, float("nan"), version=1, now=9.0)  # a loss not said neither
    w.report("p", "L0M0", 7, 3.7, version=1, now=7.0)
    [d] = w.diverging()
    assert (d.peer_id, d.module, d.best, d.latest, d.reports, d.since_round) == ("p", "L0M0", 3.0, 3.7, 3, 4)
    w.report("p", "L0M0", 8, 3.1, version=1, now=8.0)
    assert w.diverging() == []
    for rnd in range(9, 12):
        w.report("p", "L0M0", rnd, 4.0, version=1, now=float(rnd))
    assert len(w.diverging()) == 1 and w.diverging({"q"}) == []
    w.report("p", "L0M0", 0, 6.0, version=2, now=20.0)  # moved: another path, another loss level
    assert w.diverging() == []


def test_the_peer_whose_run_began_first_names_its_module():
    w = LossWatch(RULES)
    for mid, start in (("L0M0", 3), ("L1M0", 2)):
        for rnd in range(8):
            w.report("p", mid, rnd, 2.0 if rnd < start else 3.0, version=1, now=float(rnd))
    [d] = w.diverging()
    assert (d.module, d.since_round) == ("L1M0", 2)


class Clock:
    def __init__(self):
        self.t = 1_000_000.0

    def __call__(self):
        return self.t


def test_the_coordinator_shows_a_rising_path_and_a_diverging_peer_on_status_and_metrics():
    clock = Clock()
    coord = Coordinator(tiny_cpu(), CoordinatorSettings(), MemoryStore(), clock=clock)
    archive = coord.join("12D3KooWarchv", b"a", Capabilities("cpu", 0, 0.0), archive=True)
    old = coord.join("12D3KooWoldie", b"o", Capabilities("cpu", 8 << 30, 1000.0))
    clock.t += 5
    new = coord.join("12D3KooWnewbe", b"n", Capabilities("cpu", 8 << 30, 1000.0))
    path = new.assignment.path
    name = ",".join(map(str, path))
    clean = snapshot(coord)
    assert clean["health"] == {"paths": [], "peers": []}
    assert "no path's validation bpb rising" in render_page(clean)
    for k, (bpb, loss) in enumerate(zip([2.5, 2.0, 2.1, 2.2, 2.3], [2.0, 2.1, 2.5, 2.8, 3.0])):
        clock.t += 10
        coord.heartbeat(archive.lease.lease_id, "12D3KooWarchv", evaluations=[PathEvaluation(path, bpb, 40 + k)])
        for pid, j, mine in (("12D3KooWoldie", old, 2.0), ("12D3KooWnewbe", new, loss)):
            coord.heartbeat(j.lease.lease_id, pid, [ProgressReport(m, 40 + k, 100 * k, mine)
                                                    for m in j.assignment.module_ids])
    snap = snapshot(coord)
    [rise] = snap["health"]["paths"]
    assert rise["path"] == name and rise["since_round"] == 42 and rise["scorings_rising"] == 3
    # one rising path of the 2x2: its blocks have the largest share of their paths rising, and the newest
    # holder of both is the newcomer: lattice order picks the first
    assert math.isclose(rise["rise"], 0.15) and rise["module"] == new.assignment.module_ids[1]
    [div] = snap["health"]["peers"]
    assert div["peer_id"] == "12D3KooWnewbe" and div["since_round"] == 42 and div["reports_above"] == 3
    assert div["module"] == min(new.assignment.module_ids)
    metrics = render_metrics(lambda: snap).decode()
    assert (f'hivepath_coordinator_path_bpb_rise{{module="{rise["module"]}",path="{name}",since_round="42"}}'
            in metrics)
    assert f'hivepath_coordinator_peer_loss_divergence{{module="{div["module"]}",peer="12D3KooWnewbe",since_round="42"}}' \
        in metrics
    page = render_page(snap)
    assert "class='bpb-rise'" in page and "12D3KooWnewbe" in page.split("id='health'")[1].split("</ul>")[0]
    coord.leave(new.lease.lease_id, "12D3KooWnewbe")
    assert snapshot(coord)["health"]["peers"] == []  # only active peers are shown
