"""bench.comm's CPU breakdown of a round: the phases, the loop thread and the rest add up."""

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


def test_link_idle_splits_a_round_s_idle_time_into_its_start_middle_and_tail():
    """A link at 1000 B/s sampled every 10 ms: idle 0.2 s, busy 0.5 s, idle 0.3 s, busy 0.6 s, idle
    0.4 s within a 2.0 s window."""
    from peer.localnet.netns import link_idle

    rate, samples, count = 1000.0, [], 0.0
    for k in range(201):
        t = k * 0.01
        samples.append((100.0 + t, int(round(count))))
        busy = 0.2 <= t < 0.7 or 1.0 <= t < 1.6
        count += rate * 0.01 if busy else 0.0
    out = link_idle(samples, 100.0, 102.0, rate)
    assert out["span_s"] == pytest.approx(2.0)
    assert out["idle_s"] == pytest.approx(0.9, abs=0.02)  # 2.0 s less the 1.1 s its 1100 bytes took
    assert out["start_s"] == pytest.approx(0.2, abs=0.02)
    assert out["middle_s"] == pytest.approx(0.3, abs=0.02)
    assert out["tail_s"] == pytest.approx(0.4, abs=0.02)
    assert out["start_s"] + out["middle_s"] + out["tail_s"] == pytest.approx(out["idle_s"])
    # a link that carried nothing idled from the start
    quiet = link_idle([(100.0 + k * 0.01, 5) for k in range(101)], 100.0, 101.0, rate)
    assert quiet["idle_s"] == pytest.approx(1.0) and quiet["start_s"] == pytest.approx(1.0)
    assert quiet["middle_s"] == 0.0 and quiet["tail_s"] == 0.0


def test_the_link_sampler_writes_the_counter_it_read_until_told_to_stop(tmp_path):
    """``python -m peer.localnet.netns --sample-tx`` on loopback (here, outside any namespace): its readings
    grow by at least what we sent while it ran, on the shared monotonic clock, and it exits 0 on SIGTERM."""
    import socket
    import subprocess
    import sys
    import time

    from peer.localnet import wait_for

    from peer.localnet.netns import read_samples

    path = tmp_path / "tx.txt"
    proc = subprocess.Popen([sys.executable, "-m", "peer.localnet.netns", "--sample-tx", str(path), "--interface", "lo",
                             "--interval", "0.005"], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "sampling"  # it read the counter once: we may go on
        t0 = time.monotonic()
        server = socket.create_server(("127.0.0.1", 0))
        client = socket.create_connection(server.getsockname())
        conn, _ = server.accept()
        payload = b"x" * (1 << 20)
        for _ in range(8):  # 8 MiB over loopback, read as it comes
            client.sendall(payload)
            got = 0
            while got < len(payload):
                got += len(conn.recv(1 << 20))
        for s in (client, conn, server):
            s.close()
        t1 = time.monotonic()
    finally:  # its last reading comes after the signal: after our last byte
        proc.terminate()
        assert proc.wait(timeout=30) == 0
        proc.stdout.close()
    wait_for(lambda: path.exists(), 60, "the readings written")
    samples = read_samples(str(path))
    times = [t for t, _ in samples]
    counts = [b for _, b in samples]
    assert times == sorted(times) and counts == sorted(counts)
    assert times[0] <= t0 + 5 and times[-1] >= t1  # the same clock as ours
    assert counts[-1] - counts[0] >= 8 << 20


def test_the_link_sampler_reads_once_more_after_a_signal_that_comes_at_once(tmp_path):
    """A signal right after ``sampling`` may land before the sampler's loop ever tests it; its last
    reading must still come after the signal (CI once got a single reading, from before the bytes)."""
    import subprocess
    import sys
    import time

    from peer.localnet.netns import read_samples

    for k in range(5):  # the race is narrow: try it a few times
        path = tmp_path / f"tx{k}.txt"
        proc = subprocess.Popen([sys.executable, "-m", "peer.localnet.netns", "--sample-tx", str(path), "--interface", "lo",
                                 "--interval", "0.5"], stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout.readline().strip() == "sampling"
            t0 = time.monotonic()
        finally:
            proc.terminate()
            assert proc.wait(timeout=30) == 0
            proc.stdout.close()
        times = [t for t, _ in read_samples(str(path))]
        assert len(times) >= 2 and times[-1] >= t0


def test_hivemind_s_baseline_is_run_again_once_after_a_failure_and_says_so(monkeypatch):
    """hivemind's averager now and then fails a round here; bench.comm runs its baseline once more
    (``attempts`` 2) rather than losing the whole run, and gives up after that (the failure is raised)."""
    import argparse

    from bench import comm, comm_hivemind

    calls: list[int] = []

    def flaky(failures: int):
        def run_bench(hm):
            calls.append(1)
            if len(calls) <= failures:
                raise RuntimeError("peer 2 exited 1: MatchmakingException: Unable to run All-Reduce")
            return {"codecs": {"8bit": {"link_efficiency": 0.7}}}
        return run_bench

    args = argparse.Namespace(peers=4, mb=64, rate_mbit=100, timeout=60.0, rounds=3)
    monkeypatch.setattr(comm_hivemind, "run_bench", flaky(1))
    assert comm._hivemind(args) == {"link_efficiency": 0.7, "attempts": 2} and len(calls) == 2
    calls.clear()
    monkeypatch.setattr(comm_hivemind, "run_bench", flaky(0))
    assert comm._hivemind(args) == {"link_efficiency": 0.7, "attempts": 1} and len(calls) == 1
    calls.clear()
    monkeypatch.setattr(comm_hivemind, "run_bench", flaky(comm.HIVEMIND_ATTEMPTS))
    with pytest.raises(RuntimeError, match="Unable to run All-Reduce"):
        comm._hivemind(args)
    assert len(calls) == comm.HIVEMIND_ATTEMPTS
