"""bench.comm's CPU breakdown of a round (issue 24): the phases, the loop thread and the rest add up."""

from __future__ import annotations

import pytest

from bench.comm import _breakdown


def _snap(cpu: float, system: float, loop: float, minflt: int, children: dict, **phases: float) -> dict:
    base = dict.fromkeys(("encode", "entropy", "decode", "reduce", "copy"), 0.0)
    return dict(cpu=cpu, system=system, loop=loop, minflt=minflt, children=children, phases={**base, **phases})


def test_breakdown_splits_a_round_into_phases_loop_daemon_and_the_rest():
    before = _snap(10.0, 2.0, 3.0, 100, {"p2pd": 1.0, "python": 0.5}, encode=1.0, decode=0.5)
    after = _snap(12.0, 2.5, 3.4, 400, {"p2pd": 1.6, "python": 0.7, "torch_shm_manager": 0.0},
                  encode=1.5, entropy=0.2, decode=0.8, reduce=0.1, copy=0.1)
    b = _breakdown(before, after)
    assert b["encode"] == pytest.approx(0.5) and b["entropy"] == pytest.approx(0.2)
    assert b["io_loop"] == pytest.approx(0.4)
    assert b["other_python"] == pytest.approx(2.0 - 0.4 - (0.5 + 0.2 + 0.3 + 0.1 + 0.1))
    assert b["daemon"] == pytest.approx(0.6) and b["dht_process"] == pytest.approx(0.2)
    assert b["python_system"] == pytest.approx(0.5) and b["minor_page_faults"] == 300
    assert b["peer_and_daemon"] == pytest.approx(2.0 + 0.6 + 0.2)  # the process and all its children
