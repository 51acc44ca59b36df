"""bench.comm's CPU breakdown of a round (issue 24): the phases, the loop thread and the rest add up."""

from __future__ import annotations

import pytest

from bench.comm import _breakdown, _median_round


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
    assert b["encoded_ahead"] == 0.0


def test_the_encoding_done_while_the_group_formed_counts_in_the_round():
    """The vector is encoded while matchmaking runs (``Codec.prepare``): the encode and entropy
    seconds between the round's start and the group forming are added to the round's CPU, in their
    phase and the process's total, and nothing else from before the group formed is."""
    start = _snap(9.0, 1.9, 2.9, 50, {"p2pd": 0.9}, encode=0.7, decode=0.4, reduce=0.05)
    before = _snap(10.0, 2.0, 3.0, 100, {"p2pd": 1.0}, encode=1.0, decode=0.5, reduce=0.1)
    after = _snap(12.0, 2.5, 3.4, 400, {"p2pd": 1.6}, encode=1.5, entropy=0.2, decode=0.8, reduce=0.2)
    plain, ahead = _breakdown(before, after), _breakdown(before, after, ahead=start)
    assert ahead["encoded_ahead"] == pytest.approx(0.3)
    assert ahead["encode"] == pytest.approx(plain["encode"] + 0.3)
    assert ahead["decode"] == pytest.approx(plain["decode"]) and ahead["reduce"] == pytest.approx(plain["reduce"])
    assert ahead["python_total"] == pytest.approx(plain["python_total"] + 0.3)
    assert ahead["peer_and_daemon"] == pytest.approx(plain["peer_and_daemon"] + 0.3)
    assert ahead["other_python"] == pytest.approx(plain["other_python"])


def test_a_codec_s_result_is_its_median_round_with_the_median_cpu():
    rounds = [dict(link_efficiency=e, cpu_s_per_mb=c, allreduce_seconds=s, identical_on_all_peers=same,
                   cpu_breakdown_seconds={"encode": enc, "daemon": d}, group_formed_spread_s=s / 10)
              for e, c, s, same, enc, d in [(0.80, 0.012, 2.3, True, 0.10, 0.30),
                                            (0.90, 0.010, 2.0, True, 0.30, 0.20),
                                            (0.85, 0.011, 2.1, False, 0.20, 0.10)]]
    out = _median_round(rounds)
    assert out["link_efficiency"] == 0.85 and out["allreduce_seconds"] == 2.1  # that round, in full
    assert out["cpu_s_per_mb"] == 0.011 and out["cpu_breakdown_seconds"] == {"encode": 0.2, "daemon": 0.2}
    assert out["link_efficiency_by_round"] == [0.80, 0.90, 0.85] and out["rounds"] == 3
    assert out["group_formed_spread_s_by_round"] == pytest.approx([0.23, 0.2, 0.21])
    assert out["identical_on_all_peers"] is False  # not in every round


def test_bare_tcp_peers_exchange_every_segment_and_time_the_last_average_in_both_schedules():
    """bench.tcp_ceiling's peers on loopback (127.0.0.x): each returns once every part's averages are
    back; a peer that never comes makes the others fail, not report a time."""
    import threading
    import time

    from bench.tcp_ceiling import SCHEDULES, _peer

    addrs = ["127.0.0.11", "127.0.0.12", "127.0.0.13"]
    for schedule in SCHEDULES:
        start_at = time.time() + 0.5
        out: dict[int, float] = {}
        threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, _peer(i, addrs, 3 * 4 * 65536, 4, schedule,
                                                                            start_at)))
                   for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert sorted(out) == [0, 1, 2] and all(0 < s < 60 for s in out.values()), (schedule, out)


def test_a_bare_tcp_peer_whose_partner_never_comes_fails(monkeypatch):
    import time

    import bench.tcp_ceiling as tc

    monkeypatch.setattr(tc, "_IO_TIMEOUT", 1.0)
    with pytest.raises(RuntimeError, match="peer 0"):
        tc._peer(0, ["127.0.0.21", "127.0.0.22"], 2 * 65536, 2, "per_pair", time.time())
