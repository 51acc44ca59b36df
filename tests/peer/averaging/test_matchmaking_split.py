"""One group per round: holders that declare a round after its group began form no second group of it.

A member's gather ends at its deadline with whoever declared by then, and its group begins. Holders
that declare the round later (a slow step, a pipeline batch that ended late) used to read the early
group's declarations, elect the smallest id among everyone declared and, when that was one of their
own, form a second group of the round: two averages applied under one round number, replicas that
no digest told apart until the lineages met (``bench.swarm``, a split of 2 and 3 of 5 holders). The
leader of a group states that it began (:attr:`peer.network.records.GroupDeclaration.formed`); a late
holder that reads it, or a late leader that reads it before it begins, fails the round as behind the
group and re-syncs to the round it applies. Real hivemind DHTs and p2p daemons on loopback."""

from __future__ import annotations

import asyncio

import pytest
import torch

from peer.averaging.matchmaking import Matchmaker
from peer.network import GroupDeclaration, HolderRecord, group_key, holders_key, records_from_value, to_value
from peer.outer import ModuleState
from peer.localnet import wait_for
from helpers.swarm import loopback_swarm, run

pytestmark = pytest.mark.integration

RUN_ID = "split"
CONFIG = "ef" * 8
PREFIX = "split_test"


@pytest.fixture(scope="module")
def swarm():
    torch.manual_seed(0)
    digest = ModuleState([torch.randn(4, 3)], [torch.zeros(4, 3)], 5).digest

    async def setup(i: int, d, p2p) -> tuple:
        mm = Matchmaker(d.dht, p2p, d.peer_id, RUN_ID, CONFIG, "", 1e6, PREFIX)
        await mm.start()
        return d, mm

    with loopback_swarm(4, setup) as (_, nodes, loop):
        yield sorted(nodes, key=lambda n: n[0].peer_id), loop, digest  # by peer id: nodes[0] would lead


def _hold(nodes, module_id: str, round_no: int) -> None:
    from hivemind.utils import get_dht_time

    for d, _ in nodes:
        assert d.dht.store(holders_key(RUN_ID, module_id), to_value(HolderRecord(CONFIG, "", round_no, 1.0, 1e6)),
                           get_dht_time() + 60, subkey=d.peer_id)


def _declarations(node, key: str) -> dict:
    return records_from_value(node[0].dht.get(key, latest=True), GroupDeclaration)


def test_holders_that_declare_after_the_rounds_group_began_form_no_second_group(swarm):
    nodes, loop, digest = swarm
    _hold(nodes, "L1M0", 7)  # every holder at round 7: the early pair waits for the late pair until its deadline
    early, late = nodes[2:], nodes[:2]  # the late pair has the smallest ids: it would lead everyone declared

    async def both(pair):
        return await asyncio.gather(*(mm.form_group("L1M0", 7, 10.0, digest) for _, mm in pair))

    formed = run(loop, both(early))
    assert all(m.group is not None and set(m.group.members) == {d.peer_id for d, _ in early} for m in formed), formed
    key = group_key(RUN_ID, "L1M0", 7)
    leader = min(d.peer_id for d, _ in early)
    wait_for(lambda: _declarations(nodes[0], key).get(leader, GroupDeclaration("", "", 0)).formed, 60,
             "the early group's leader to state that it began")

    late_matches = run(loop, both(late))
    for m in late_matches:
        assert m.group is None and m.ahead == 8, m  # behind the early group: re-sync to the round it applies
        assert "began this round's group without us" in m.reason, m.reason


def test_a_late_leader_that_reads_the_round_began_before_its_group_begins_gives_way(swarm):
    from hivemind.utils import get_dht_time

    nodes, loop, digest = swarm
    _hold(nodes, "L1M1", 3)
    key = group_key(RUN_ID, "L1M1", 3)
    # the other two declared the round (and will not join us): the late leader waits for them until its close
    # deadline, and one of them begins a group of the round meanwhile
    for d, _ in nodes[2:]:
        assert d.dht.store(key, to_value(GroupDeclaration(CONFIG, "", 1e6, digest=digest)), get_dht_time() + 30,
                           subkey=d.peer_id)
    late = nodes[:2]
    futures = [asyncio.run_coroutine_threadsafe(mm.form_group("L1M1", 3, 30.0, digest), loop) for _, mm in late]
    lead = late[0][1]

    def following():
        looking = lead._looking.get(key)
        return looking is not None and looking.decided.is_set() and late[1][0].peer_id in looking.followers
    wait_for(following, 60, "the late pair to decide on a leader and its follower to join")
    other = nodes[2][0]
    assert other.dht.store(key, to_value(GroupDeclaration(CONFIG, "", 1e6, digest=digest, formed=True)),
                           get_dht_time() + 31, subkey=other.peer_id)
    leading, following_ = (f.result(60) for f in futures)
    assert leading.group is None and leading.ahead == 4, leading
    assert "began this round's group without us" in leading.reason, leading.reason
    assert following_.group is None, following_  # told the leader gave up: no second group of round 3
    assert lead._declared["L1M1"] == key
    # it states no group of the round began; it withdraws its declaration of a try that formed none
    wait_for(lambda: late[0][0].peer_id not in _declarations(nodes[0], key), 60, "the late leader's withdrawal")


def test_gathering_tells_a_member_behind_whether_the_group_of_its_new_round_has_not_begun(swarm):
    """``Matchmaker.gathering`` (what a member that re-synced after a round behind asks before
    joining the round it now holds between its rounds): true while holders at our state declared the
    round and none states that its group began."""
    from hivemind.utils import get_dht_time

    nodes, loop, digest = swarm
    me, other, third = nodes[0][1], nodes[1][0], nodes[2][0]
    key = group_key(RUN_ID, "L0M1", 9)
    assert not run(loop, me.gathering("L0M1", 9, digest))  # nobody declared it
    assert third.dht.store(key, to_value(GroupDeclaration(CONFIG, "", 1e6, digest="ab" * 8)), get_dht_time() + 30,
                           subkey=third.peer_id)
    wait_for(lambda: third.peer_id in _declarations(nodes[0], key), 60, "the other state's declaration to be readable")
    assert not run(loop, me.gathering("L0M1", 9, digest))  # another state's holders are no group of ours
    assert other.dht.store(key, to_value(GroupDeclaration(CONFIG, "", 1e6, digest=digest)), get_dht_time() + 30,
                           subkey=other.peer_id)
    wait_for(lambda: run(loop, me.gathering("L0M1", 9, digest)), 60, "a holder at our state gathering the round")
    assert other.dht.store(key, to_value(GroupDeclaration(CONFIG, "", 1e6, digest=digest, formed=True)),
                           get_dht_time() + 31, subkey=other.peer_id)
    wait_for(lambda: not run(loop, me.gathering("L0M1", 9, digest)), 60, "the round's group to read as begun")


def test_a_member_that_gives_a_round_up_withdraws_its_declaration_and_declares_it_again(swarm):
    """A member that fails a round tries it again under the same key a round of compute later. Its
    declaration of the failed try stayed readable until it expired, a round budget later: the other
    holder, declaring meanwhile, counted it as waiting and led or followed a member that was training
    (two holders a round out of phase failed every round so). A try that ends without a group withdraws
    the declaration, on the DHT and where it was pushed; the next try's declaration outlives that withdrawal."""
    from hivemind.utils import get_dht_time

    nodes, loop, digest = swarm
    first, second = nodes[0], nodes[1]  # the first has the smaller id: the second would follow it
    for d, _ in (first, second):
        assert d.dht.store(holders_key(RUN_ID, "L0M2"), to_value(HolderRecord(CONFIG, "", 4, 1.0, 1e6)),
                           get_dht_time() + 120, subkey=d.peer_id)
    key = group_key(RUN_ID, "L0M2", 4)

    alone = run(loop, first[1].form_group("L0M2", 4, 40.0, digest))
    assert alone.group is None and "did not declare in time" in alone.reason, alone
    # its declaration would stay readable for 40 s less the 8 s gather: the withdrawal is read well before
    wait_for(lambda: first[0].peer_id not in _declarations(second, key), 20, "the failed try's withdrawal to be read")
    assert first[0].peer_id not in second[1].pushed_to(key)

    # the second holder's try while the first trains: it waits for the first, not for a stale declaration of it
    later = run(loop, second[1].form_group("L0M2", 4, 30.0, digest))
    assert later.group is None and "did not declare in time" in later.reason, later
    assert "joined us" not in later.reason and "refused" not in later.reason

    # both try again at once, the second well within its last try's budget: its withdrawal there is still on
    # the DHT, and its new declaration must outlive it to be read
    async def both():
        return await asyncio.gather(*(mm.form_group("L0M2", 4, 10.0, digest) for _, mm in (first, second)))
    together = run(loop, both())
    members = {first[0].peer_id, second[0].peer_id}
    assert all(m.group is not None and set(m.group.members) == members for m in together), together
