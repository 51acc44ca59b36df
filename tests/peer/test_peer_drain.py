"""A drain, end to end: real coordinator and peers as processes on loopback.

- ``--drain-timeout`` counts from the drain's start and is enforced: a round still in flight when it
  runs out is abandoned (not applied), the peer checkpoints, leaves and exits 0.
- A drained peer withdraws its holder and matchmaking records at once: the survivors' next rounds
  never wait for it (without the withdrawal its holder record lived on for ``holder_ttl``, 30 s, and
  every survivor round logged it as a holder that did not declare).
"""

from __future__ import annotations

import re
import signal
import time

import pytest

from peer.localnet import LocalNetwork, free_port, wait_for
from helpers.network import tiny_network

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    from models.corpus import default_corpus
    from models.data import Dataset, prepare

    out = tmp_path_factory.mktemp("data") / "default-bytes-1x1"
    prepare(default_corpus(), out, levels=1, modules=1, tokenizer="bytes")
    return Dataset(out)


DENSE = {"levels": 1, "modules_per_level": 1}
"""Every peer holds every module: each round is one group of all of them."""


def _round(net: LocalNetwork, name: str) -> int:
    return max((p.get("round_no", 0) for p in net.progress_lines(name)), default=0)


def _local_state(port: int) -> str:
    import json
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=5) as r:
        return json.loads(r.read())["state"]


def test_drain_timeout_abandons_the_round_in_flight(procs, tmp_path, dataset):
    """With the other holder frozen (SIGSTOP: its holder record stays), a's next round waits for it
    until the gather deadline (0.2 x 60 s); a drain then, with ``--drain-timeout 1``, must not wait
    that out: the round is abandoned after 1 s and the peer leaves."""
    net = tiny_network(procs, tmp_path / "net", dataset.dir, dataset.manifest_hash, inner_steps=5, lease_timeout=600.0,
                  round_timeout=60.0, lattice=DENSE)
    net.start_coordinator()
    status_port = free_port()
    net.start_peer("a", "--drain-timeout", "1", "--status-port", str(status_port))
    net.start_peer("b")
    wait_for(lambda: "averaged by 2" in procs.log("a"), 240, "both peers to average a round together")

    def blocked() -> bool:  # in a round, and still in it 3 s later: waiting for b
        later = time.monotonic() + 3.0
        while time.monotonic() < later:
            if _local_state(status_port) != "averaging":
                return False
        return True

    for _ in range(4):
        mark, rounds = len(procs.log("a")), procs.log("a").count("averaged by 2")
        procs.signal("b", signal.SIGSTOP)
        # Frozen between applying a round and announcing the next, b's holder record lags a's round: a
        # then waits for b to catch up in short rounds instead of one long one. Thaw, average, freeze again.
        lagging = lambda: "waiting for holders behind us" in procs.log("a")[mark:]  # noqa: E731
        try:
            try:
                wait_for(lambda: lagging() or blocked(), 120, "a to wait in a round for the frozen b")
            except TimeoutError as e:  # what a made of b's records after the freeze: its first rounds' reasons
                raise AssertionError(f"{e}; a's log after the freeze began:\n{procs.log('a')[mark:][:6000]}") from None
            if not lagging():
                code = net.stop("a", timeout=120)
                break
        finally:
            procs.signal("b", signal.SIGCONT)
        wait_for(lambda: procs.log("a").count("averaged by 2") > rounds, 240, "a and b to average again")
    else:
        raise AssertionError("b never froze inside a round of a's in 4 tries:\n" + procs.log("a")[-3000:])
    log = procs.log("a")
    assert code == 0, log[-3000:]
    assert "draining took longer than --drain-timeout 1s: abandoning the round in flight" in log
    assert "CancelledError" in log or "not sent: draining past --drain-timeout" in log
    assert "drained in" in log and (net.root / "a" / "checkpoints").is_dir()


def test_a_drained_peer_withdraws_its_records_at_once(procs, tmp_path, dataset):
    net = tiny_network(procs, tmp_path / "net", dataset.dir, dataset.manifest_hash, inner_steps=5, lease_timeout=600.0,
                  lattice=DENSE)
    net.start_coordinator()
    for name in ("a", "b", "c"):
        net.start_peer(name)
    wait_for(lambda: all("averaged by 3" in procs.log(n) for n in ("a", "b", "c")), 300,
             "three peers to average a round together")
    c_id = net.peer_id("c")
    assert net.stop("c", timeout=120) == 0, procs.log("c")[-3000:]
    # --progress json: everything a headless operator needs, in order
    events = [e for e in net.progress_lines("c") if e.get("event") != "progress"]
    kinds = [e["event"] for e in events]
    for kind in ("join", "assignment", "round", "checkpoint", "drain", "leave"):
        assert kind in kinds, (kind, kinds)
    assert kinds.index("join") < kinds.index("assignment") < kinds.index("round")  # a drain may come mid-round
    assert kinds[-1] == "leave" and events[-1]["drain_seconds"] is not None and "error" not in kinds
    done = [e for e in events if e["event"] == "round" and e["status"] == "done" and e["group_size"] == 3]
    assert done and c_id in done[0]["peers"] and done[0]["bytes_sent"] > 0
    marks = {n: len(procs.log(n)) for n in ("a", "b")}
    rounds = {n: _round(net, n) for n in ("a", "b")}
    wait_for(lambda: all(_round(net, n) >= rounds[n] + 3 for n in ("a", "b")), 300, "the survivors' next rounds")
    for n in ("a", "b"):
        # a gather that began before the drain ended may still have read c's record (the round in flight then,
        # rounds[n] + 1 at most): every later round must not wait for it
        after = procs.log(n)[marks[n]:]
        waited = [line for line in after.splitlines() if c_id in line and "did not declare" in line
                  and int(re.search(r"_r(\d+)_group", line).group(1)) > rounds[n] + 1]
        assert not waited, f"{n} waited for the drained peer: {waited}"


def test_release_withdraws_at_once_and_a_new_hold_replaces_the_withdrawal():
    """Two real DHT nodes: after ``release`` the other node reads no holder record at once (not after
    ``holder_ttl``); holding the module again (a reassignment keeping it) is read again."""
    from peer.averaging import NetAverager
    from peer.network import DHTOptions, HolderRecord, holders_key, read_records, start_dht

    host = ["/ip4/127.0.0.1/tcp/0"]
    with start_dht(DHTOptions(host_maddrs=host)) as dht_a, \
            start_dht(DHTOptions(host_maddrs=host, initial_peers=dht_a.maddrs())) as dht_b:
        avg = NetAverager(dht_a, "wd", "aaaa0000aaaa0000", holder_ttl=300.0)
        try:
            def holders():
                return read_records(dht_b.dht, holders_key("wd", "L0M0"), HolderRecord)

            avg.hold("L0M0", 4)
            wait_for(lambda: dht_a.peer_id in holders(), 30, "the holder record")
            avg.release("L0M0")
            assert dht_a.peer_id not in holders()  # at once: the record would live 300 s
            avg.hold("L0M0", 5)
            wait_for(lambda: holders().get(dht_a.peer_id), 30, "the record held again")
            assert holders()[dht_a.peer_id].round_no == 5
        finally:
            avg.shutdown()
        assert dht_a.peer_id not in read_records(dht_b.dht, holders_key("wd", "L0M0"), HolderRecord)
