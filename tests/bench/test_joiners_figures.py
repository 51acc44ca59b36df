"""``bench.joiners.event_figures``: what one event's window of scores says (no training here)."""

import pytest

from bench.joiners import event_figures

A, B, C, D = (0, 0), (0, 1), (1, 0), (1, 1)


def test_a_move_s_left_path_is_reported_apart_from_the_sharers():
    before = {A: 2.0, B: 2.0, C: 2.5}
    window = [{A: 2.06, B: 2.01, C: 2.4, D: 3.0}, {A: 2.08, B: 1.98, C: 2.3, D: 2.4}]
    f = event_figures(before, window, D, [A, B, C], A, {"0,0": 2.0, "0,1": 2.0, "1,0": 2.5, "1,1": 3.5})
    assert f["sharer_bpb_rise_max"] == pytest.approx(0.005)  # B's first round; A is not a sharer
    assert f["left_path_bpb_rise_max"] == pytest.approx(0.04)
    assert f["joiner_rounds_to_network_bpb"] is None  # 2.4 > 1.05 * mean(2.08, 1.98, 2.3)
    assert f["network_bpb_change"] == pytest.approx((2.19 - 2.5) / 2.5)


def test_a_join_has_no_left_path_and_counts_every_other_trained_path():
    before = {A: 2.0, B: 2.0}
    window = [{A: 2.03, B: 1.9, C: 2.2}, {A: 1.99, B: 1.9, C: 2.0}]
    f = event_figures(before, window, C, [A, B], None, {"0,0": 2.0, "0,1": 2.0})
    assert f["sharer_bpb_rise_max"] == pytest.approx(0.015)
    assert f["left_path_bpb_rise_max"] is None
    assert f["joiner_rounds_to_network_bpb"] == 2  # 2.0 <= 1.05 * 1.945
    assert f["network_bpb_change"] == pytest.approx((1.945 - 2.0) / 2.0)  # the new path is left out
