"""Strict DHT record schemas: one key builder per record type, validation where records are read."""

from __future__ import annotations

import functools
import logging
import math

import pytest

from peer.network import (
    GroupDeclaration,
    HolderRecord,
    group_key,
    holders_key,
    parse_record,
    read_records,
    to_value,
)
from peer.network.records import is_withdrawal, withdrawal
from protos import versions

PEER = "12D3KooWPbySgUijvGYy1St7ys38Ccfc1ce5RqA2rc5aoSFH4tkJ"
GOOD = {"config_hash": "ab12", "data_hash": "", "round_no": 3, "throughput": 100.0, "bandwidth": 1.25e7}


def test_keys_have_run_and_module_and_no_dots():
    assert holders_key("tiny", "L0M1") == "tiny_L0M1_holders"
    assert group_key("tiny", "embed", 7) == "tiny_embed_r7_group"
    assert group_key("run-2", "head_0_1", 0) == "run-2_head_0_1_r0_group"
    for key in (holders_key("tiny", "L0M1"), group_key("tiny", "L1M0", 12)):
        assert "." not in key
    for run_id, module_id in (("Tiny", "L0M1"), ("a.b", "L0M1"), ("tiny", "L0.M1"), ("tiny", "mlp")):
        with pytest.raises(ValueError):
            holders_key(run_id, module_id)
    with pytest.raises(ValueError):
        group_key("tiny", "L0M1", -1)


def test_valid_record_parses_and_round_trips():
    record = parse_record(HolderRecord, PEER, GOOD)
    assert record == HolderRecord("ab12", "", 3, 100.0, 1.25e7)
    assert to_value(record) == {**GOOD, "v": versions.stated_text("dht")}
    decl = parse_record(GroupDeclaration, PEER, {"config_hash": "ab", "data_hash": "cd", "bandwidth": 0})
    assert decl == GroupDeclaration("ab", "cd", 0.0) and isinstance(decl.bandwidth, float)
    # a paced declaration says so; an unpaced one stores no such field (as peers before it wrote them)
    paced = GroupDeclaration("ab", "cd", 1.0, paced=True)
    assert parse_record(GroupDeclaration, PEER, to_value(paced)) == paced
    assert "paced" not in to_value(GroupDeclaration("ab", "cd", 1.0))
    assert parse_record(GroupDeclaration, PEER, {**to_value(paced), "paced": "yes"}) is None


@pytest.mark.parametrize(
    "subkey, value, why",
    [
        ("not a peer id!", GOOD, "subkey is not a peer id"),
        (PEER, [1, 2], "not a table"),
        (PEER, {k: v for k, v in GOOD.items() if k != "bandwidth"}, "missing ['bandwidth']"),
        (PEER, {**GOOD, "round_no": True}, "round_no=True"),
        (PEER, {**GOOD, "round_no": 2.0}, "round_no=2.0"),
        (PEER, {**GOOD, "round_no": -1}, "round_no=-1"),
        (PEER, {**GOOD, "throughput": math.nan}, "throughput=nan"),
        (PEER, {**GOOD, "bandwidth": math.inf}, "bandwidth=inf"),
        (PEER, {**GOOD, "bandwidth": -5.0}, "bandwidth=-5.0"),
        (PEER, {**GOOD, "bandwidth": "fast"}, "bandwidth='fast'"),
        (PEER, {**GOOD, "config_hash": "ZZ"}, "config_hash='ZZ'"),
        (PEER, {**GOOD, "config_hash": "a" * 65}, "not a hex hash"),
    ],
)
def test_invalid_records_are_ignored_and_logged(caplog, subkey, value, why):
    with caplog.at_level(logging.WARNING, logger="peer.network.records"):
        assert parse_record(HolderRecord, subkey, value) is None
    assert why in caplog.text and "HolderRecord" in caplog.text


def test_a_declaration_lists_the_peers_it_expects_and_only_peer_ids():
    from peer.network import MAX_EXPECTING

    base = {"config_hash": "ab", "data_hash": "", "bandwidth": 1.0}
    decl = parse_record(GroupDeclaration, PEER, {**base, "expecting": [PEER]})  # msgpack gives back a list
    assert decl == GroupDeclaration("ab", "", 1.0, expecting=(PEER,)) and to_value(decl)["expecting"] == (PEER,)
    assert "expecting" not in to_value(GroupDeclaration("ab", "", 1.0))  # the common case stays small
    for bad in ("not-a-list", ["not a peer id!"], [PEER] * (MAX_EXPECTING + 1), [7]):
        assert parse_record(GroupDeclaration, PEER, {**base, "expecting": bad}) is None, bad


@pytest.mark.integration
def test_reading_a_real_dht_keeps_only_valid_records(caplog):
    from hivemind.utils import get_dht_time

    from peer.network import DHTOptions, start_dht

    opts = DHTOptions(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    with start_dht(opts) as a, start_dht(DHTOptions(host_maddrs=opts.host_maddrs, initial_peers=a.maddrs())) as b:
        key = holders_key("tiny", "L0M1")
        exp = get_dht_time() + 30
        assert a.dht.store(key, to_value(HolderRecord("ab12", "", 1, 5.0, 9.0)), exp, subkey=a.peer_id)
        assert b.dht.store(key, {**GOOD, "round_no": "many"}, exp, subkey=b.peer_id)
        assert b.dht.store(key, GOOD, exp, subkey="bogus")
        with caplog.at_level(logging.WARNING, logger="peer.network.records"):
            found = read_records(b.dht, key, HolderRecord)
        assert found == {a.peer_id: HolderRecord("ab12", "", 1, 5.0, 9.0)}
        assert "round_no='many'" in caplog.text and "subkey is not a peer id" in caplog.text
        assert read_records(a.dht, holders_key("tiny", "L1M1"), HolderRecord) == {}


async def _in_routing_table(peer_id, _dht, node) -> bool:
    return peer_id in node.protocol.routing_table


async def _drop_from_routing_table(peer_id, _dht, node) -> None:
    table = node.protocol.routing_table
    del table[table.get(peer_id=peer_id)]


def test_a_peer_cut_off_from_the_coordinator_re_connects_from_the_last_peer_list():
    """``keep_connected`` after a partition: the coordinator's client is still retrying (its answer
    would come long after the heal), so the check dials the peer list the coordinator gave last.
    Without that the two halves stayed apart until the client's backoff ran out (18 s in bench.chaos)."""
    import threading

    from peer.localnet import wait_for
    from peer.network import DHTOptions, start_dht

    opts = DHTOptions(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    answered, stalled = threading.Event(), threading.Event()
    with start_dht(opts) as a, start_dht(opts) as b:
        listed = b.maddrs()

        def source():
            if answered.is_set():  # later asks: a coordinator that does not answer (until the test ends)
                stalled.wait(60)
                raise ConnectionError("coordinator unreachable")
            answered.set()
            return listed

        def knows_b() -> bool:
            return a.dht.run_coroutine(functools.partial(_in_routing_table, b.dht.peer_id))

        def forget_b() -> None:
            a.dht.run_coroutine(functools.partial(_drop_from_routing_table, b.dht.peer_id))

        try:
            a.keep_connected(source, interval=600)  # only pokes wake it
            a.poke()
            wait_for(knows_b, 30, "the first check to connect to b")
            forget_b()  # the partition: a dropped b from its routing table
            assert not knows_b()
            a.poke()  # an isolated round: the check runs while the coordinator stalls
            wait_for(knows_b, 30, "a to find b again from the last list")
        finally:
            stalled.set()


@pytest.mark.integration
def test_a_re_connection_check_through_a_cut_leaves_the_first_check_after_the_heal_free_to_dial():
    """libp2p backs off every dial of a peer after a failed one (5 s, then 5 s + n² s). Re-connection
    checks run through a cut (an isolated peer pokes one a round) must not dial then, or the first
    check after the heal is refused ("dial backoff") and the healed peer stays apart for up to 20 s
    (bench.chaos). Here b is reachable only through a forwarder's port; through the cut the port is
    bound but not listening (it refuses connections, and no other test can take it), for longer
    than a first backoff's 5 s; at the heal the forwarder serves on it, and the first check connects."""
    import socket
    import time

    from hivemind.utils.multiaddr import Multiaddr

    from bench.delay_relay import DelayRelay
    from peer.network import DHTOptions, start_dht

    opts = DHTOptions(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    with start_dht(opts) as a, start_dht(opts) as b:  # two swarms: a knows b only through the forwarder
        target = ("127.0.0.1", int(Multiaddr(b.maddrs()[0])["tcp"]))
        port_socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        port_socket.bind(("127.0.0.1", 0))
        port = port_socket.getsockname()[1]
        via = [f"/ip4/127.0.0.1/tcp/{port}/p2p/{b.peer_id}"]
        cut = time.monotonic()
        while time.monotonic() - cut < 7.0:  # a check a second, as an isolated peer's pokes run them
            assert a.connect(via, timeout=5, only_missing=True) == 0
            time.sleep(1.0)  # the checks' cadence (what is measured is the check after the heal)
        with DelayRelay(("127.0.0.1", port), target, 0.0, sock=port_socket):
            assert a.connect(via, timeout=5, only_missing=True) == 1


@pytest.mark.integration
def test_a_cut_off_peer_probes_the_peers_still_in_its_routing_table_and_dials_them_afresh_at_the_heal():
    """A peer stays in our routing table through a cut when we sent it no RPC meanwhile, and keeps the
    connection that died in the cut: the first DHT lookup after the heal waited 3 s on it (hivemind's
    RPC timeout; bench.chaos, 2 of 3 partitions). Once half the listed peers did not answer, the checks
    probe the peers in the table too, drop those that do not answer (as hivemind drops one that missed
    an RPC), and at the heal close and dial them afresh with the others. Here a knows b and c directly;
    the listed addresses are forwarders' ports, bound but not listening through the cut."""
    import socket

    from bench.delay_relay import DelayRelay
    from hivemind.utils.multiaddr import Multiaddr
    from peer.network import DHTOptions, start_dht

    opts = DHTOptions(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    with start_dht(opts) as a, start_dht(opts) as b, start_dht(opts) as c:
        sockets, via, targets = [], [], []
        for d in (b, c):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
            via.append(f"/ip4/127.0.0.1/tcp/{s.getsockname()[1]}/p2p/{d.peer_id}")
            targets.append(("127.0.0.1", int(Multiaddr(d.maddrs()[0])["tcp"])))
        assert a.connect(b.maddrs() + c.maddrs()) == 2

        def knows(d) -> bool:
            return a.dht.run_coroutine(functools.partial(_in_routing_table, d.dht.peer_id))

        a.dht.run_coroutine(functools.partial(_drop_from_routing_table, b.dht.peer_id))  # an RPC to b failed
        assert not a.cut_off(via)
        assert a.connect(via, timeout=5, only_missing=True) == 0  # b does not answer; c is in the table
        assert knows(c) and a.cut_off(via)  # half the list did not answer: we seem cut off
        assert a.connect(via, timeout=5, only_missing=True) == 0
        assert not knows(c)  # probed although in the table, and dropped from it
        with DelayRelay(("127.0.0.1", 0), targets[0], 0.0, sock=sockets[0]), \
                DelayRelay(("127.0.0.1", 0), targets[1], 0.0, sock=sockets[1]):
            assert a.connect(via, timeout=5, only_missing=True) == 2  # the heal: both dialled afresh
            assert knows(b) and knows(c) and not a.cut_off(via)


@pytest.mark.integration
def test_a_peer_that_misses_a_listed_peer_checks_again_without_being_poked_and_dials_it_at_the_heal():
    """The peers on the healthy side of a cut are not poked (their rounds go on), and checked every
    ``interval`` (20 s) they dialled the cut-off peer back that much after the heal; meanwhile its
    own dials of them could be refused by libp2p's backoff (bench.chaos: 6 rounds apart). A peer with
    a listed peer that did not answer keeps checking every second or so, and dials it at the heal."""
    import socket

    from bench.delay_relay import DelayRelay
    from peer.localnet import wait_for
    from hivemind.utils.multiaddr import Multiaddr
    from peer.network import DHTOptions, start_dht

    opts = DHTOptions(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    with start_dht(opts) as a, start_dht(opts) as b, start_dht(opts) as c, start_dht(opts) as d:
        port_socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        port_socket.bind(("127.0.0.1", 0))  # bound, not listening: refuses, as a cut-off peer's port
        # b behind the port, c and d answering: one listed peer of three missing is not being cut off
        via = [f"/ip4/127.0.0.1/tcp/{port_socket.getsockname()[1]}/p2p/{b.peer_id}"] + c.maddrs() + d.maddrs()
        checks = []

        def source():
            checks.append(1)
            return via

        a.keep_connected(source, interval=600)  # no later pokes: only the unanswered peer wakes it
        a.poke()
        wait_for(lambda: len(checks) >= 2, 30, "a second check without a poke")
        assert not a.dht.run_coroutine(functools.partial(_in_routing_table, b.dht.peer_id))
        assert not a.cut_off(via)
        with DelayRelay(("127.0.0.1", 0), ("127.0.0.1", int(Multiaddr(b.maddrs()[0])["tcp"])), 0.0, sock=port_socket):
            wait_for(lambda: a.dht.run_coroutine(functools.partial(_in_routing_table, b.dht.peer_id)), 30,
                     "a to dial b once its port answers")


def test_a_later_minors_fields_are_read_past_and_counted():
    before = versions.UNKNOWN_FIELDS.snapshot().get("HolderRecord.admin", 0)
    newer = {**GOOD, "admin": True, "v": f"{versions.stated('dht')[0]}.99"}
    assert parse_record(HolderRecord, PEER, newer) == HolderRecord("ab12", "", 3, 100.0, 1.25e7)
    assert versions.UNKNOWN_FIELDS.snapshot()["HolderRecord.admin"] == before + 1
    old = parse_record(HolderRecord, PEER, GOOD)  # no version: a release that stated none, 1.0
    assert old is not None
    # a withdrawal with a later minor's field is still a withdrawal
    assert is_withdrawal({**withdrawal(b"c", 4, "ab", ""), "why": "drained"})


def test_a_record_of_another_major_is_refused_once_naming_both(caplog):
    other = {**GOOD, "v": "2.0"}
    with caplog.at_level(logging.WARNING, logger="peer.network.records"):
        assert parse_record(HolderRecord, PEER, other) is None
        assert parse_record(HolderRecord, PEER, other) is None
    lines = [r.getMessage() for r in caplog.records if "2.0" in r.getMessage()]
    assert len(lines) == 1 and versions.stated_text("dht") in lines[0] and "HolderRecord" in lines[0]
    assert parse_record(HolderRecord, PEER, {**GOOD, "v": "one"}) is None


def test_a_writer_of_the_previous_minor_leaves_out_what_the_current_one_added():
    decl = GroupDeclaration("ab", "cd", 1.0, wire="2.1")
    assert to_value(decl)["wire"] == "2.1" and to_value(decl)["v"] == versions.stated_text("dht")
    versions.set_override("dht=1.0")
    try:
        value = to_value(decl)
    finally:
        versions.set_override(None)
    assert "wire" not in value and "v" not in value  # both came with 1.1
    assert parse_record(GroupDeclaration, PEER, value) == GroupDeclaration("ab", "cd", 1.0)


def test_a_sparse_paced_declaration_round_trips_and_an_older_minor_leaves_the_flag_out():
    decl = GroupDeclaration("ab12", "", 1.0, paced=True, sparse=True)
    value = to_value(decl)
    assert value["sparse"] is True and parse_record(GroupDeclaration, PEER, value) == decl
    assert "sparse" not in to_value(GroupDeclaration("ab12", "", 1.0, paced=True))  # false: left out
    versions.set_override("dht=1.3")  # a peer of the minor before the flag
    try:
        older = to_value(decl)
    finally:
        versions.set_override(None)
    assert "sparse" not in older and older["paced"] is True
    assert parse_record(GroupDeclaration, PEER, older) == GroupDeclaration("ab12", "", 1.0, paced=True)


def test_each_value_we_store_under_a_key_replaces_our_last_one_on_a_real_dht():
    """hivemind keeps a subkey's value of the later expiration: a declaration stored again with the same
    expiration (whom to wait for) is refused by the node that holds the first, and so is a withdrawal
    expiring earlier than what it withdraws. Through OwnExpirations each store expires past the last
    one, so every value we store in turn is the one the DHT keeps."""
    from hivemind.utils import get_dht_time

    from peer.network import DHTOptions, OwnExpirations, start_dht

    opts = DHTOptions(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    with start_dht(opts) as a, start_dht(DHTOptions(host_maddrs=opts.host_maddrs, initial_peers=a.maddrs())) as b:
        key = group_key("tiny", "L0M1", 4)
        first, again = GroupDeclaration("ab", "", 1.0), GroupDeclaration("ab", "", 1.0, expecting=(PEER,))
        exp = get_dht_time() + 30
        # the premise: the same expiration again is refused
        assert a.dht.store(key, to_value(first), exp, subkey=a.peer_id)
        assert not a.dht.store(key, to_value(again), exp, subkey=a.peer_id)
        assert read_records(b.dht, key, GroupDeclaration)[a.peer_id].expecting == ()

        stored = OwnExpirations()
        other = group_key("tiny", "L0M1", 5)
        e1 = stored.take(other, exp)
        assert e1 == exp and a.dht.store(other, to_value(first), e1, subkey=a.peer_id)
        e2 = stored.take(other, exp)  # the same wish: just past the first
        assert e2 > e1 and a.dht.store(other, to_value(again), e2, subkey=a.peer_id)
        assert read_records(b.dht, other, GroupDeclaration)[a.peer_id].expecting == (PEER,)
        # a withdrawal wished to expire earlier still replaces the declaration; a later wish is kept as is
        e3 = stored.take(other, exp - 10)
        assert e3 > e2 and a.dht.store(other, withdrawal(), e3, subkey=a.peer_id)
        found = b.dht.get(other, latest=True)
        assert is_withdrawal(found.value[a.peer_id].value)
        assert stored.after(other, exp + 60) == exp + 60 and stored.last(other) == e3
        assert stored.last(key) is None
