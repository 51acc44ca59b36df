"""A lone holder does not step alone while peers it just sent its state to are about to declare
(bit-identical replicas), on real hivemind DHTs and p2p daemons.

Two newcomers that fetched round r from the module's only holder, and declared r before their holder
records were visible, would find it gone if it stepped alone to r+1, and average the old state between
them: a fork at r+1. So the holder counts a peer that fetched its state to average it as a holder at
that round; an archive's fetch (``joining=False``) does not. A holder also serves a
round whose exchange already runs: a leader refuses a group whose members all fetched this round from
holders none of which joined. In overlap mode a holder whose record still shows the last round is
waited for until the gather deadline."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from peer.outer import ModuleState
from peer.averaging.matchmaking import LONE, Matchmaker
from peer.network import GroupDeclaration, HolderRecord, group_key, holders_key, records_from_value, to_value
from peer.averaging.state_transfer import StateServer, fetch_module_state
from helpers.swarm import loopback_swarm, run

pytestmark = pytest.mark.integration

RUN_ID = "joiners"
CONFIG = "ef" * 8
PREFIX = "joiners_test"
ROUND = 4
TIMEOUT = 10.0  # the round budget: gather deadline 2 s, patience for joiners 20 s


@pytest.fixture(scope="module")
def swarm():
    torch.manual_seed(0)
    state = ModuleState([torch.randn(4, 3)], [torch.zeros(4, 3)], ROUND)

    async def setup(_: int, d, p2p) -> tuple:
        server = StateServer(p2p, CONFIG, PREFIX, lambda mid: state)
        await server.start()
        mm = Matchmaker(d.dht, p2p, d.peer_id, RUN_ID, CONFIG, "", 1e6, PREFIX, joiners=server.joiners)
        await mm.start()
        return d, p2p, mm

    with loopback_swarm(3, setup) as (_, nodes, loop):
        yield nodes, loop, state


def _hold(node, module_id: str, round_no: int) -> None:
    from hivemind.utils import get_dht_time

    d = node[0]
    assert d.dht.store(holders_key(RUN_ID, module_id), to_value(HolderRecord(CONFIG, "", round_no, 1.0, 1e6)),
                       get_dht_time() + 60, subkey=d.peer_id)


async def _fetch(node, holder, module_id: str, joining: bool) -> ModuleState:
    d, p2p, _ = node
    return await fetch_module_state(d.dht, p2p, RUN_ID, module_id, CONFIG, PREFIX, d.peer_id, 20.0,
                                    joining=joining)


async def _declared(node, module_id: str, round_no: int, who: str, deadline: float) -> None:
    """Wait (on the DHT, with a deadline) until ``who`` declared ``round_no`` of ``module_id``."""
    while True:
        found = await node[0].dht.get(group_key(RUN_ID, module_id, round_no), latest=True, return_future=True)
        if who in records_from_value(found, GroupDeclaration):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{who} never declared round {round_no} of {module_id}")
        await asyncio.sleep(0.05)


async def _late(node, first, module_id: str, round_no: int, digest: str, **kw):
    """A member that declares only once ``first`` has declared (a newcomer still on its first steps)."""
    await _declared(node, module_id, round_no, first[0].peer_id, time.monotonic() + 30)
    return await node[2].form_group(module_id, round_no, TIMEOUT, digest, **kw)


@pytest.mark.parametrize("leader", ["holder", "newcomer"])
def test_a_lone_holder_waits_for_the_newcomers_it_sent_its_state_to(swarm, leader):
    """With a newcomer leading, the second newcomer is slow to join: it declares, but joins only once the
    holder has joined the leader. The leader knows of it only from the holder's declaration, and must
    wait for it rather than close the group with the holder alone (a fork: the second newcomer is left
    with the old state at this round)."""
    from hivemind.utils import get_dht_time

    nodes, loop, state = swarm
    low, mid, high = sorted(nodes, key=lambda n: n[0].peer_id)
    module_id = "L0M0" if leader == "holder" else "L3M0"
    holder, a, b = (low, mid, high) if leader == "holder" else (high, low, mid)
    _hold(holder, module_id, ROUND)  # the only holder record: the newcomers' are not visible yet
    fetched = [run(loop, _fetch(n, holder, module_id, joining=True)) for n in (a, b)]
    assert [s.round_no for s in fetched] == [ROUND, ROUND]
    digest = state.digest
    key = group_key(RUN_ID, module_id, ROUND)

    async def slow_joiner():
        await _declared(b, module_id, ROUND, a[0].peer_id, time.monotonic() + 30)
        declaration = to_value(GroupDeclaration(CONFIG, "", 1e6, b"", digest))
        assert await b[0].dht.store(key, declaration, get_dht_time() + TIMEOUT, subkey=b[0].peer_id,
                                    return_future=True)
        deadline = time.monotonic() + 30
        while key in a[2]._looking and holder[0].peer_id not in a[2]._looking[key].followers:
            assert time.monotonic() < deadline, "the holder never joined the leader"
            await asyncio.sleep(0.02)  # a poll of the leader's state, with a deadline
        return await b[2].form_group(module_id, ROUND, TIMEOUT, digest)

    async def all_three():
        return await asyncio.gather(holder[2].form_group(module_id, ROUND, TIMEOUT, digest),
                                    _late(a, holder, module_id, ROUND, digest),
                                    _late(b, holder, module_id, ROUND, digest) if leader == "holder" else slow_joiner())

    everyone = tuple(sorted(n[0].peer_id for n in nodes))
    for group, why, adopt, *_ in run(loop, all_three()):
        assert group is not None and group.group_id != LONE, why
        assert group.members == everyone and adopt == "", (group, why)
        assert group.group_id.startswith(f"{key}-{min(everyone)[-8:]}"), group


@pytest.mark.parametrize("joining", [False, True], ids=["archive", "silent-joiner"])
def test_a_lone_holder_steps_alone_after_an_archive_fetch_but_not_after_a_joiner_s(swarm, joining):
    """An archive never declares: it does not hold the holder back. A joiner that never declares makes
    the holder fail the round (local progress kept) instead of stepping alone past it."""
    nodes, loop, state = swarm
    holder, other, _ = nodes
    module_id = "L0M1" if joining else "L1M1"
    _hold(holder, module_id, ROUND)
    run(loop, _fetch(other, holder, module_id, joining=joining))
    group, why, adopt, *_ = run(loop, holder[2].form_group(module_id, ROUND, TIMEOUT, state.digest))
    if joining:
        assert group is None and adopt == "" and other[0].peer_id in why and "did not declare" in why, why
    else:
        assert group is not None and group.group_id == LONE, why


def test_a_joiner_that_announces_the_module_idle_does_not_hold_the_holder_back(swarm):
    """A stage server fetches its module's state and then announces it idle until a trainer drives it:
    it will not declare, so the holder steps alone (as after an archive's fetch) instead of failing
    the round waiting for it."""
    from hivemind.utils import get_dht_time

    nodes, loop, state = swarm
    holder, other, _ = nodes
    module_id = "L2M1"
    _hold(holder, module_id, ROUND)
    run(loop, _fetch(other, holder, module_id, joining=True))
    idle = HolderRecord(CONFIG, "", ROUND, 1.0, 1e6, idle=True)
    assert other[0].dht.store(holders_key(RUN_ID, module_id), to_value(idle), get_dht_time() + 60,
                              subkey=other[0].peer_id)
    group, why, adopt, *_ = run(loop, holder[2].form_group(module_id, ROUND, TIMEOUT, state.digest))
    assert group is not None and group.group_id == LONE, why


def test_overlap_member_waits_for_a_holder_whose_record_shows_the_last_round(swarm):
    nodes, loop, state = swarm
    first, lagging, _ = nodes
    _hold(first, "L1M0", ROUND + 1)
    _hold(lagging, "L1M0", ROUND)  # its exchange of ROUND ended; the record of ROUND + 1 is not out yet
    digest = state.digest

    async def both():
        return await asyncio.gather(
            first[2].form_group("L1M0", ROUND + 1, TIMEOUT, digest, wait_for_behind=False),
            _late(lagging, first, "L1M0", ROUND + 1, digest, wait_for_behind=False))

    pair = tuple(sorted([first[0].peer_id, lagging[0].peer_id]))
    for group, why, *_ in run(loop, both()):
        assert group is not None and group.members == pair, why


def test_newcomers_do_not_average_a_round_their_source_has_left(swarm):
    """The source served round r while its own exchange of r ran: it declared r and stepped on. The two
    newcomers see its declaration, but it never joins them: averaging between themselves would fork."""
    from hivemind.utils import get_dht_time

    nodes, loop, state = swarm
    source, *newcomers = sorted(nodes, key=lambda n: n[0].peer_id, reverse=True)  # a newcomer leads
    _hold(source, "L2M2", ROUND)
    digest = state.digest
    declaration = GroupDeclaration(CONFIG, "", 1e6, b"", digest)
    assert source[0].dht.store(group_key(RUN_ID, "L2M2", ROUND), to_value(declaration), get_dht_time() + 60,
                               subkey=source[0].peer_id)
    for n in newcomers:
        got = run(loop, _fetch(n, source, "L2M2", joining=True))
        n[2].fetched("L2M2", got.source, got.round_no)
        assert got.source == source[0].peer_id

    follower, leader = newcomers  # the smaller id leads

    async def both():
        # the follower declares once the leader has: seeing only the source's declaration, it would
        # lead a group of its own (also no fork, but not the rule under test)
        return await asyncio.gather(leader[2].form_group("L2M2", ROUND, TIMEOUT, digest),
                                    _late(follower, leader, "L2M2", ROUND, digest))

    (g_leader, why_leader, *_), (g_follower, why_follower, *_) = run(loop, both())
    assert g_leader is None and "fetched this round's state" in why_leader, why_leader
    assert g_follower is None and "gave up" in why_follower, why_follower
