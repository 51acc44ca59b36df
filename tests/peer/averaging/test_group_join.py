"""The leader/follower join protocol when a relay's reset cuts a join stream.

Between two peers behind NAT every join stream crosses a relay, which resets the relayed connection
after 128 KiB: a follower can lose the leader's BEGIN after the leader counted it in. The follower then
joins again, and a leader that already began answers with the same group; a stream that ends without
a decisive reply is taken as cut, never as a refusal. Units over the protocol's own handler and reader
(the relayed rounds themselves run in ``tests/peer/network/test_relayed_peers.py``)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from peer.averaging.group_join import CUT_STREAM, GroupJoin, Looking
from peer.averaging.partition import Group
from protos.hivepath.peer.v1.net_pb2 import JoinReply, JoinRequest

KEY = "run_L0M0_r3_group"
CONFIG, DATA = "ab" * 8, "cd" * 8


class _Id:
    def __init__(self, peer: str):
        self.peer = peer

    def to_base58(self) -> str:
        return self.peer


def _leader() -> GroupJoin:
    return GroupJoin(None, "leader", CONFIG, DATA, 1e6, "hivepath_run")


async def _first_reply(join: GroupJoin, sender: str) -> JoinReply:
    replies = join._handle_join(JoinRequest(group_key=KEY, config_hash=CONFIG, data_hash=DATA),
                                SimpleNamespace(remote_id=_Id(sender)))
    try:
        return await replies.__anext__()
    finally:
        await replies.aclose()


def test_a_member_that_joins_again_after_the_group_began_gets_the_same_group():
    join = _leader()
    group = Group(f"{KEY}-leader-1234", ("a", "leader"), (1e6, 1e6), 20.0, (True, True))
    join._begun[KEY] = group
    again = asyncio.run(_first_reply(join, "a"))
    assert again.code == JoinReply.BEGIN and again.group_id == group.group_id
    assert tuple(again.members) == group.members and tuple(again.relayed) == (True, True)
    assert join._check_group(again, "leader") == (Group(group.group_id, group.members, group.bandwidths,
                                                        group.allreduce_timeout, (True, True)), "")
    # anyone else is not let into a group that began without it
    other = asyncio.run(_first_reply(join, "b"))
    assert other.code == JoinReply.REFUSED and "not looking" in other.reason


def test_a_follower_that_joins_twice_ends_its_earlier_handler():
    async def run() -> JoinReply:
        join = _leader()
        looking = join._looking[KEY] = Looking(KEY)
        looking.decided.set()  # we lead it
        first = join._handle_join(JoinRequest(group_key=KEY, config_hash=CONFIG, data_hash=DATA),
                                  SimpleNamespace(remote_id=_Id("a")))
        assert (await first.__anext__()).code == JoinReply.ACCEPTED
        second = join._handle_join(JoinRequest(group_key=KEY, config_hash=CONFIG, data_hash=DATA),
                                   SimpleNamespace(remote_id=_Id("a")))
        assert (await second.__anext__()).code == JoinReply.ACCEPTED
        ended = await asyncio.wait_for(first.__anext__(), 30)  # not left waiting for a group forever
        await second.aclose()
        return ended

    assert asyncio.run(run()).code == JoinReply.REFUSED


def test_a_join_stream_that_ends_without_a_decision_reads_as_cut():
    async def replies(*codes: int):
        for code in codes:
            yield JoinReply(code=code)

    async def read(*codes: int):
        return await _leader()._read_replies(replies(*codes), "leader", asyncio.Event())

    assert asyncio.run(read(JoinReply.ACCEPTED)) is CUT_STREAM
    assert asyncio.run(read()) is CUT_STREAM
    refused = asyncio.run(read(JoinReply.REFUSED))
    assert refused[0] is None and "refused" in refused[1]


def _reply_to(join: GroupJoin, request: JoinRequest) -> JoinReply:
    async def first() -> JoinReply:
        replies = join._handle_join(request, SimpleNamespace(remote_id=_Id("c")))
        try:
            return await replies.__anext__()
        finally:
            await replies.aclose()

    return asyncio.run(first())


def test_a_leader_refuses_another_averaging_major_and_other_bytes_by_name():
    from peer.averaging.compat import wire_key
    from protos import versions

    join = _leader()
    ours = versions.stated_text("averaging")
    other = _reply_to(join, JoinRequest(group_key=KEY, config_hash=CONFIG, data_hash=DATA, protocol="2.0"))
    assert other.code == JoinReply.REFUSED and "2.0" in other.reason and ours in other.reason
    assert "averaging protocol" in other.reason
    bytes_differ = _reply_to(join, JoinRequest(group_key=KEY, config_hash=CONFIG, data_hash=DATA, protocol=ours,
                                               wire="1.7"))
    assert bytes_differ.code == JoinReply.REFUSED and "averaging bytes 1.7" in bytes_differ.reason
    # the previous minor with the same bytes (and a release that states neither) is let in as far as versions go
    for protocol in ("1.0", ""):
        same = _reply_to(join, JoinRequest(group_key=KEY, config_hash=CONFIG, data_hash=DATA, protocol=protocol,
                                           wire=wire_key()))
        assert same.code == JoinReply.REFUSED and "not looking" in same.reason
