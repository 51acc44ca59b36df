"""Forks never average (bit-identical replicas): holders that carry one round number but
different states are told apart by their state digests, on real hivemind DHTs and p2p daemons.
The state held by most holders is kept; the others fail the round with the digest to re-sync to,
and a re-sync fetch takes only that state (or a later round of it)."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from peer.outer import ModuleState
from peer.averaging.matchmaking import LONE, Matchmaker
from peer.outer import state_digest
from peer.network import HolderRecord, holders_key, to_value
from peer.averaging.state_transfer import StateServer, StateTransferError, fetch_module_state
from peer.localnet import wait_for
from helpers.swarm import loopback_swarm, run

pytestmark = pytest.mark.integration

RUN_ID = "fork"
CONFIG = "cd" * 8
PREFIX = "fork_test"


@pytest.fixture(scope="module")
def swarm():
    torch.manual_seed(0)
    kept = ModuleState([torch.randn(4, 3)], [torch.zeros(4, 3)], 5)
    forked = ModuleState([kept.global_params[0] + 1e-3], [torch.zeros(4, 3)], 5)
    states = [kept, kept, forked]

    async def setup(i: int, d, p2p) -> tuple:
        mm = Matchmaker(d.dht, p2p, d.peer_id, RUN_ID, CONFIG, "", 1e6, PREFIX)
        await mm.start()
        server = StateServer(p2p, CONFIG, PREFIX, lambda mid, s=states[i]: s if mid in ("L0M1", "L2M2") else None)
        await server.start()
        return d, p2p, mm

    with loopback_swarm(3, setup) as (_, nodes, loop):
        yield nodes, loop, states


def _hold(nodes, module_id: str, round_no: int) -> None:
    from hivemind.utils import get_dht_time

    for d, _, _ in nodes:
        assert d.dht.store(holders_key(RUN_ID, module_id), to_value(HolderRecord(CONFIG, "", round_no, 1.0, 1e6)),
                           get_dht_time() + 60, subkey=d.peer_id)


def test_state_digest_tells_equal_rounds_apart():
    a = [torch.arange(12, dtype=torch.float32).reshape(4, 3)]
    m = [torch.zeros(4, 3)]
    assert state_digest(a, m) == state_digest([a[0].clone()], [m[0].clone()])
    assert state_digest(a, m) != state_digest([a[0] + 1e-6], m)
    assert state_digest(a, m) != state_digest(m, a)  # momentum is part of the state
    assert state_digest(a, m) != state_digest([a[0].reshape(3, 4)], [m[0].reshape(3, 4)])  # so are shapes


def test_majority_state_is_kept_and_the_fork_re_syncs_to_it(swarm):
    nodes, loop, states = swarm
    digests = [s.digest for s in states]
    assert digests[0] == digests[1] != digests[2]
    _hold(nodes, "L0M1", 5)

    async def all_three():
        return await asyncio.gather(*(mm.form_group("L0M1", 5, 8.0, dg) for (_, _, mm), dg in zip(nodes, digests)))

    (g0, why0, adopt0, *_), (g1, why1, adopt1, *_), (g2, why2, adopt2, *_) = run(loop, all_three())
    pair = tuple(sorted([nodes[0][0].peer_id, nodes[1][0].peer_id]))
    assert g0 is not None and g1 is not None and g0.members == g1.members == pair, (why0, why1)
    assert adopt0 == adopt1 == ""
    assert g2 is None and adopt2 == digests[0] and "forked" in why2, why2


def test_a_tie_is_broken_the_same_way_on_both_sides(swarm):
    nodes, loop, states = swarm
    two = [nodes[0], nodes[2]]
    digests = [states[0].digest, states[2].digest]
    _hold(two, "L1M0", 3)

    async def both():
        return await asyncio.gather(*(mm.form_group("L1M0", 3, 8.0, dg) for (_, _, mm), dg in zip(two, digests)))

    results = run(loop, both())
    kept = max(digests)
    for (group, why, adopt, *_), digest in zip(results, digests):
        if digest == kept:
            assert group is not None and group.group_id == LONE and adopt == "", why
        else:
            assert group is None and adopt == kept, why


def test_re_sync_fetch_takes_only_the_kept_state(swarm):
    nodes, loop, states = swarm
    d2, p2p2, _ = nodes[2]
    d0, p2p0, _ = nodes[0]
    _hold([nodes[1]], "L0M1", 5)  # only the holder of the kept state is listed
    kept = states[0].digest

    got = run(loop, fetch_module_state(d0.dht, p2p0, RUN_ID, "L0M1", CONFIG, PREFIX, d0.peer_id, 20.0,
                                       accept=lambda s: "" if s.digest == kept else "not kept"))
    assert got.digest == kept and torch.equal(got.global_params[0], states[0].global_params[0])
    with pytest.raises(StateTransferError, match="not kept"):
        run(loop, fetch_module_state(d2.dht, p2p2, RUN_ID, "L0M1", CONFIG, PREFIX, d2.peer_id, 20.0,
                                     accept=lambda s: "" if s.digest == "0" * 16 else "not kept"))


def test_a_holder_ahead_of_the_others_waits_for_them_instead_of_stepping_alone(swarm):
    """Stepping alone whenever nobody is at our exact round would race a cut-off peer ahead by one round
    per inner loop; the holders behind re-sync to us at their next round instead."""
    nodes, loop, states = swarm
    (_, _, mm0), behind = nodes[0], nodes[1]
    _hold([behind], "L2M0", 6)
    group, why, adopt, *_ = run(loop, mm0.form_group("L2M0", 7, 4.0, states[0].digest))
    assert group is None and adopt == "", why
    assert "waiting for holders behind us" in why and f"{behind[0].peer_id[-8:]} at round 6" in why, why
    # alone for real (no other live holder of the module): the member steps alone
    group, why, *_ = run(loop, mm0.form_group("L2M1", 7, 4.0, states[0].digest))
    assert group is not None and group.group_id == LONE, why


def test_a_holder_that_stays_behind_holds_us_back_for_two_round_budgets_only(swarm):
    """An idle or stuck holder (its record refreshed, its round never ending) must not stop the
    module's outer steps for good: after two round budgets without its record moving, we step alone."""
    from peer.averaging.matchmaking import BEHIND_PATIENCE_ROUNDS

    nodes, loop, states = swarm
    mm0, stuck = nodes[0][2], nodes[1]
    _hold([stuck], "L3M0", 2)
    budget = 1.0
    start = time.monotonic()
    first = run(loop, mm0.form_group("L3M0", 9, budget, states[0].digest))
    assert first.group is None and "waiting for holders behind us" in first.reason, first.reason
    deadline = start + 30.0
    while True:
        match = run(loop, mm0.form_group("L3M0", 9, budget, states[0].digest))
        if match.group is not None or time.monotonic() > deadline:
            break
        assert "waiting for holders behind us" in match.reason, match.reason
    assert match.group is not None and match.group.group_id == LONE, match.reason
    assert time.monotonic() - start >= BEHIND_PATIENCE_ROUNDS * budget
    # its record moves (it ended a round, still behind us): we wait for it again
    _hold([stuck], "L3M0", 3)
    again = run(loop, mm0.form_group("L3M0", 10, budget, states[0].digest))
    assert again.group is None and "at round 3" in again.reason, again.reason


def test_a_re_sync_asks_only_holders_at_the_round_it_needs(swarm):
    nodes, loop, states = swarm
    d0, p2p0, _ = nodes[0]
    _hold([nodes[1]], "L2M2", 5)
    with pytest.raises(StateTransferError, match="at round 6 or later"):
        run(loop, fetch_module_state(d0.dht, p2p0, RUN_ID, "L2M2", CONFIG, PREFIX, d0.peer_id, 20.0, min_round=6))
    got = run(loop, fetch_module_state(d0.dht, p2p0, RUN_ID, "L2M2", CONFIG, PREFIX, d0.peer_id, 20.0, min_round=5))
    assert got.round_no == 5


def _store(node, key: str, value: dict) -> None:
    from hivemind.utils import get_dht_time

    d = node[0]
    assert d.dht.store(key, value, get_dht_time() + 60, subkey=d.peer_id)


def test_a_holder_behind_one_that_left_re_syncs_instead_of_stepping_alone(swarm):
    """A holder that withdrew (a drain, a trainer restart, a reassignment) announcing round 6 applied
    round 5 without us: once its record is gone, stepping alone at round 5 would make a second round-5
    state (the kill -9 coordinator test caught one). Its withdrawal says the round it left at; one that
    left at our own round never applied it, and holds nobody back."""
    from peer.network import withdrawal

    nodes, loop, states = swarm
    mm0, gone = nodes[0][2], nodes[1]
    _store(gone, holders_key(RUN_ID, "L4M0"), withdrawal(round_no=6, config_hash=CONFIG))
    match = run(loop, mm0.form_group("L4M0", 5, 4.0, states[0].digest))
    assert match.group is None and match.reason.startswith("behind: holders that left were at round 6"), match.reason
    _store(gone, holders_key(RUN_ID, "L4M1"), withdrawal(round_no=5, config_hash=CONFIG))  # the control: it left at our round
    match = run(loop, mm0.form_group("L4M1", 5, 4.0, states[0].digest))
    assert match.group is not None and match.group.group_id == LONE, match.reason
    _store(gone, holders_key(RUN_ID, "L4M3"), withdrawal(round_no=6, config_hash="12" * 8))  # another run config
    match = run(loop, mm0.form_group("L4M3", 5, 4.0, states[0].digest))
    assert match.group is not None and match.group.group_id == LONE, match.reason


def test_a_lone_holder_behind_the_archive_re_syncs_from_it(swarm):
    """The archive keeps a round this holder missed (the holders that applied it left since): that is
    the module's state at that round, so the holder re-syncs to it rather than step alone into another."""
    from peer.network import ArchiveRecord, archive_key

    nodes, loop, states = swarm
    mm0, archive = nodes[0][2], nodes[2]
    _store(archive, archive_key(RUN_ID, "L4M2"), to_value(ArchiveRecord(CONFIG, "", 8)))
    match = run(loop, mm0.form_group("L4M2", 5, 4.0, states[0].digest))
    assert match.group is None and match.reason.startswith("behind: the archive keeps round 8"), match.reason
    match = run(loop, mm0.form_group("L4M2", 9, 4.0, states[0].digest))  # the archive is behind us: alone
    assert match.group is not None and match.group.group_id == LONE, match.reason


def test_a_holder_whose_partner_vanished_does_not_race_ahead_alone(swarm):
    """A partition: the other holder's record expires without a withdrawal, and the coordinator does
    not answer us either (the matchmaker's default: not known to). Stepping alone at once would race
    this holder ahead one round per inner loop, and at the heal its lone lineage would be the one
    ahead; it waits two round budgets after it last read the record, then steps alone."""
    from hivemind.utils import get_dht_time
    from peer.averaging.matchmaking import BEHIND_PATIENCE_ROUNDS
    from peer.network import read_records

    nodes, loop, states = swarm
    mm0, partner = nodes[0][2], nodes[1]
    budget = 2.0
    d1 = partner[0]
    assert d1.dht.store(holders_key(RUN_ID, "L5M0"), to_value(HolderRecord(CONFIG, "", 5, 1.0, 1e6)),
                        get_dht_time() + 2.0, subkey=d1.peer_id)
    first = run(loop, mm0.form_group("L5M0", 5, budget, states[0].digest))
    assert first.group is None and "did not declare in time" in first.reason, first.reason
    seen_at = time.monotonic()
    deadline = seen_at + 30.0
    wait_for(lambda: not read_records(nodes[0][0].dht, holders_key(RUN_ID, "L5M0"), HolderRecord), 30,
             "the partner's record to expire")
    match = run(loop, mm0.form_group("L5M0", 5, budget, states[0].digest))
    assert match.group is None and "vanished without leaving" in match.reason, match.reason
    assert "out of touch with the coordinator" in match.reason, match.reason
    while match.group is None and time.monotonic() < deadline:
        assert "vanished without leaving" in match.reason, match.reason
        match = run(loop, mm0.form_group("L5M0", 5, budget, states[0].digest))
    assert match.group is not None and match.group.group_id == LONE, match.reason
    assert time.monotonic() - seen_at >= BEHIND_PATIENCE_ROUNDS * budget - 0.5


def test_a_holder_that_still_reaches_the_coordinator_steps_alone_when_its_partner_vanished(swarm):
    """The control of the test above: the coordinator has answered us without a break since before
    the partner's record vanished, so the partner is the one cut off (or killed), and we step alone
    at once as the only live holder."""
    from hivemind.utils import get_dht_time
    from peer.network import read_records

    nodes, loop, states = swarm
    mm0, partner = nodes[0][2], nodes[1]
    d1 = partner[0]
    assert d1.dht.store(holders_key(RUN_ID, "L5M1"), to_value(HolderRecord(CONFIG, "", 5, 1.0, 1e6)),
                        get_dht_time() + 2.0, subkey=d1.peer_id)
    first = run(loop, mm0.form_group("L5M1", 5, 2.0, states[0].digest))
    assert first.group is None and "did not declare in time" in first.reason, first.reason
    wait_for(lambda: not read_records(nodes[0][0].dht, holders_key(RUN_ID, "L5M1"), HolderRecord), 30,
             "the partner's record to expire")
    try:
        mm0.in_touch_since = lambda: 0.0  # in touch since long before
        match = run(loop, mm0.form_group("L5M1", 5, 2.0, states[0].digest))
        assert match.group is not None and match.group.group_id == LONE, match.reason
        back = time.monotonic()  # in touch again only since the partner vanished: a heal, we were cut off
        mm0.in_touch_since = lambda: back
        match = run(loop, mm0.form_group("L5M1", 6, 2.0, states[0].digest))
        assert match.group is None and "out of touch with the coordinator" in match.reason, match.reason
    finally:
        mm0.in_touch_since = lambda: None


class _MissingFromReads:
    """A DHT whose reads of ``key`` miss ``peer``'s subkey, as a get that reached only the nodes a
    store did not reach returns a partial dictionary: everything else is the real DHT's."""

    def __init__(self, dht, key: str, peer: str):
        self._dht, self._key, self._peer = dht, key, peer

    def __getattr__(self, name):
        return getattr(self._dht, name)

    def get(self, key, *args, **kwargs):
        from hivemind.utils import ValueWithExpiration

        async def read():
            found = await self._dht.get(key, *args, **kwargs)
            if key != self._key or found is None or not isinstance(found.value, dict):
                return found
            return ValueWithExpiration({k: v for k, v in found.value.items() if k != self._peer}, found.expiration_time)
        return read()


def test_a_holder_does_not_step_alone_when_a_read_misses_a_partner_whose_record_is_valid(swarm):
    """A read of the holders key that misses a holder whose record is still on the DHT (unexpired, not
    withdrawn) is the read's fault, not a departure: even in touch with the coordinator, a holder does
    not step alone then (the partner may be at its round: a second state at one round number), and
    steps on with it once the reads see it again."""
    from hivemind.utils import get_dht_time

    nodes, loop, states = swarm
    (d0, _, mm0), (d1, _, mm1) = nodes[0], nodes[1]
    key = holders_key(RUN_ID, "L5M2")
    assert d1.dht.store(key, to_value(HolderRecord(CONFIG, "", 5, 1.0, 1e6)), get_dht_time() + 120, subkey=d1.peer_id)
    first = run(loop, mm0.form_group("L5M2", 5, 2.0, states[0].digest))
    assert first.group is None and "did not declare in time" in first.reason, first.reason
    real = mm0.dht
    try:
        mm0.dht = _MissingFromReads(real, key, d1.peer_id)
        mm0.in_touch_since = lambda: 0.0  # the coordinator answered us throughout
        match = run(loop, mm0.form_group("L5M2", 5, 2.0, states[0].digest))
        assert match.group is None and "missing from our read" in match.reason, match.reason
    finally:
        mm0.dht = real
        mm0.in_touch_since = lambda: None
    # nor do two holders average without a third that both reads missed (it may be averaging this
    # round with others: two means of one round)
    d2 = nodes[2][0]
    key3 = holders_key(RUN_ID, "L5M3")
    for d in (d0, d1, d2):
        assert d.dht.store(key3, to_value(HolderRecord(CONFIG, "", 5, 1.0, 1e6)), get_dht_time() + 120, subkey=d.peer_id)
    seen = run(loop, mm0.form_group("L5M3", 5, 2.0, states[0].digest))  # reads all three
    assert seen.group is None and "did not declare in time" in seen.reason, seen.reason
    real1 = mm1.dht
    try:
        mm0.dht, mm1.dht = _MissingFromReads(real, key3, d2.peer_id), _MissingFromReads(real1, key3, d2.peer_id)

        async def pair():
            return await asyncio.gather(mm0.form_group("L5M3", 5, 8.0, states[0].digest),
                                        mm1.form_group("L5M3", 5, 8.0, states[1].digest))

        m0, m1 = run(loop, pair())
        assert m0.group is None and "missing from our read" in m0.reason, m0.reason
        assert m1.group is None, m1.reason  # its leader gave up (or it never saw the third: first read)
    finally:
        mm0.dht, mm1.dht = real, real1
    # read whole again: the two holders average together
    assert d0.dht.store(key, to_value(HolderRecord(CONFIG, "", 5, 1.0, 1e6)), get_dht_time() + 120, subkey=d0.peer_id)
    async def together():
        return await asyncio.gather(mm0.form_group("L5M2", 5, 8.0, states[0].digest),
                                    mm1.form_group("L5M2", 5, 8.0, states[1].digest))

    both = run(loop, together())
    assert all(m.group is not None and m.group.group_id != LONE and len(m.group.members) == 2 for m in both), both
