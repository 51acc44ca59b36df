"""Only admitted peers average, on real hivemind DHTs and p2p daemons: two peers holding
coordinator-signed credentials form a group and refuse an outsider whose credential is forged; state
transfer is refused to the outsider; and the matchmaking and state-transfer handlers survive
malformed, oversized and fuzzed requests without crashing and without any change of state."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import HealthCheck, given, settings as hsettings, strategies as st

from coordinator.credentials import CredentialIssuer
from peer.network import CredentialVerifier
from peer.outer import ModuleState
from peer.averaging.matchmaking import Matchmaker
from protos.hivepath.peer.v1.net_pb2 import JoinReply, JoinRequest
from peer.network import HolderRecord, holders_key, to_value
from peer.averaging.state_transfer import MAX_REQUEST_BYTES, StateServer, StateTransferError, fetch_module_state
from helpers.swarm import loopback_swarm, run

pytestmark = pytest.mark.integration

RUN_ID = "adm"
CONFIG = "ab" * 8
PREFIX = "adm_test"


class Node:
    def __init__(self, dht, credential: bytes, verifier: CredentialVerifier):
        self.node = dht
        self.dht = dht.dht
        self.peer_id = dht.peer_id
        self.credential = credential
        self.verifier = verifier
        self.p2p = None
        self.mm: Matchmaker = None  # type: ignore[assignment]
        self.server: StateServer = None  # type: ignore[assignment]


@pytest.fixture(scope="module")
def swarm():
    torch.manual_seed(0)
    issuer = CredentialIssuer(Ed25519PrivateKey.generate(), RUN_ID, 3600.0)
    forger = CredentialIssuer(Ed25519PrivateKey.generate(), RUN_ID, 3600.0)
    now = time.time()
    state = ModuleState([torch.randn(4, 3)], [torch.zeros(4, 3)], 7)

    async def setup(i: int, d, p2p) -> Node:
        signer = forger if i == 2 else issuer  # node 2 is the outsider: its credential is forged
        n = Node(d, signer.issue(d.peer_id, now).encode(), CredentialVerifier(RUN_ID, issuer.public_key))
        n.p2p = p2p
        n.mm = Matchmaker(n.dht, n.p2p, n.peer_id, RUN_ID, CONFIG, "", 1e6, PREFIX,
                          credential=lambda: n.credential, verifier=n.verifier)
        await n.mm.start()
        n.server = StateServer(n.p2p, CONFIG, PREFIX, lambda mid: state if mid == "L0M0" else None, n.verifier)
        await n.server.start()
        return n

    with loopback_swarm(3, setup) as (_, nodes, loop):
        yield nodes, loop, state


def test_admitted_peers_group_without_the_outsider(swarm, caplog):
    from hivemind.utils import get_dht_time

    nodes, loop, _ = swarm
    a, b, m = nodes
    for n in nodes:  # holder records make every member wait for the others' declarations
        assert n.dht.store(holders_key(RUN_ID, "L0M1"), to_value(HolderRecord(CONFIG, "", 1, 1.0, 1e6, n.credential)),
                           get_dht_time() + 60, subkey=n.peer_id)
    with caplog.at_level(logging.WARNING, logger="peer.network.credentials"):
        async def all_three():
            return await asyncio.gather(*(n.mm.form_group("L0M1", 1, 6.0) for n in nodes))

        (ga, why_a, *_), (gb, why_b, *_), (gm, why_m, *_) = run(loop, all_three())
    assert ga is not None and gb is not None and ga.members == gb.members == tuple(sorted([a.peer_id, b.peer_id]))
    assert gm is None or m.peer_id not in ga.members and set(gm.members) == {m.peer_id}
    assert f"from {m.peer_id}: credential signature is not the coordinator's" in caplog.text


def test_state_transfer_only_to_admitted_peers(swarm):
    nodes, loop, state = swarm
    a, b, m = nodes
    from hivemind.utils import get_dht_time

    assert a.dht.store(holders_key(RUN_ID, "L0M0"), to_value(HolderRecord(CONFIG, "", 7, 1.0, 1.0, a.credential)),
                       get_dht_time() + 60, subkey=a.peer_id)
    served = a.server.served
    got = run(loop, fetch_module_state(b.dht, b.p2p, RUN_ID, "L0M0", CONFIG, PREFIX, b.peer_id, 20.0,
                                       credential=lambda: b.credential, verifier=b.verifier))
    assert got.round_no == 7 and torch.equal(got.global_params[0], state.global_params[0])
    assert a.server.served == served + 1
    with pytest.raises(StateTransferError, match="not admitted: credential signature"):
        run(loop, fetch_module_state(m.dht, m.p2p, RUN_ID, "L0M0", CONFIG, PREFIX, m.peer_id, 20.0,
                                     credential=lambda: m.credential))
    with pytest.raises(StateTransferError, match="not admitted: no credential"):
        run(loop, fetch_module_state(m.dht, m.p2p, RUN_ID, "L0M0", CONFIG, PREFIX, m.peer_id, 20.0))
    assert a.server.served == served + 1


async def _raw_state_stream(sender: Node, target: Node, payload: bytes) -> bytes:
    from hivemind.p2p import PeerID

    _, reader, writer = await sender.p2p.call_binary_stream_handler(PeerID.from_base58(target.peer_id),
                                                                    f"{PREFIX}_state")
    try:
        writer.write(payload)
        await writer.drain()
        try:
            return await asyncio.wait_for(reader.read(1 << 16), 2.0)  # a truncated request gets no answer
        except (asyncio.TimeoutError, ConnectionError, asyncio.IncompleteReadError):
            return b""
    finally:
        writer.close()


def test_state_handler_refuses_malformed_and_oversized_requests(swarm):
    from hivemind.p2p import P2P

    nodes, loop, _ = swarm
    a, b, _ = nodes
    served = a.server.served
    huge = P2P.MESSAGE_MARKER + (1 << 40).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER)
    over = P2P.MESSAGE_MARKER + (MAX_REQUEST_BYTES + 1).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + b"x" * 5000
    garbage = P2P.MESSAGE_MARKER + (6).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + b"\xff\xff\xff\xff\xff\xff"
    for payload in (huge, over, garbage, b"\x07junk", b"", P2P.MESSAGE_MARKER + b"\x00\x00"):
        run(loop, _raw_state_stream(b, a, payload))
    assert a.server.served == served
    ok = run(loop, fetch_module_state(b.dht, b.p2p, RUN_ID, "L0M0", CONFIG, PREFIX, b.peer_id, 20.0,
                                      credential=lambda: b.credential, verifier=b.verifier))
    assert ok.round_no == 7 and a.server.served == served + 1  # still serving


FUZZ = hsettings(max_examples=25, deadline=None, derandomize=True,
                 suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
blob = st.one_of(st.binary(max_size=64), st.binary(min_size=2000, max_size=20000), st.just(b"own"))
text = st.one_of(st.text(max_size=30), st.text(min_size=5000, max_size=20000), st.just(f"{RUN_ID}_L0M0_r1_group"))


@FUZZ
@given(group_key=text, config_hash=text, data_hash=text, bandwidth=st.floats(allow_nan=True, allow_infinity=True),
       credential=blob, sender=st.sampled_from([1, 2]))
def test_fuzzed_join_requests_are_refused_without_state_change(swarm, group_key, config_hash, data_hash, bandwidth,
                                                               credential, sender):
    from hivemind.p2p import PeerID

    nodes, loop, _ = swarm
    a, s = nodes[0], nodes[sender]
    credential = s.credential if credential == b"own" else credential

    async def ask() -> list[JoinReply]:
        request = JoinRequest(group_key=group_key, config_hash=config_hash, data_hash=data_hash, bandwidth=bandwidth,
                              credential=credential)
        stream = await s.p2p.iterate_protobuf_handler(PeerID.from_base58(a.peer_id), a.mm.handler_name, request,
                                                      JoinReply)
        return [r async for r in stream]

    before = dict(a.mm._looking)
    replies = run(loop, ask())
    assert len(replies) == 1 and replies[0].code == JoinReply.REFUSED and replies[0].reason
    assert dict(a.mm._looking) == before
    if credential != s.credential or sender == 2:
        assert replies[0].reason.startswith("not admitted")
