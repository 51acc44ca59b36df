"""Two peers behind NAT exchange module states and average rounds through a circuit relay,
on real hivemind DHTs and p2p daemons.

Two peers that can be dialled only through a relay (each announces nothing but its circuit through a
third peer, as a peer behind NAT does): between private addresses the relay resets each relayed
connection after 128 KiB (go-libp2p's default limits, ``peer.network.relays``).

- A state of several hundred kilobytes arrives cut short by the resets, so a newcomer could never
  fetch a module held by NATed peers alone in one piece. The transfer resumes from the byte it
  reached, for the same state (its digest): the state arrives in pieces, bit-identical. A resumed request for a state the
  holder no longer keeps is refused, and the newcomer starts again from the holder's current state.
- An averaging round of a module held by the two of them alone would never complete if every part
  in flight were cut by each reset and all were sent again at once on the next connection. Their
  groups know both are relayed: parts go in pieces of at most ``RELAY_PIECE_BYTES``, one at a
  time to each member, and a piece cut by a reset is sent again.
"""

from __future__ import annotations

import logging

import pytest
import torch

from peer.localnet import wait_for
from peer.network import HolderRecord, holders_key, read_records
from peer.outer import ModuleState

pytestmark = pytest.mark.integration

RUN_ID = "relayed"
CONFIG = "ab" * 8
HOST = ["/ip4/127.0.0.1/tcp/0"]


@pytest.fixture(scope="module")
def relayed_pair():
    """A relay, and two peers announcing only circuits through it: (holder's averager, newcomer's averager,
    the holder's state provider's dict module -> state, the two peers' DHT nodes)."""
    from peer.averaging import NetAverager
    from peer.network import DHTOptions, HolderRecord, holders_key, read_records, start_dht
    from peer.network.relays import use_static_relays

    use_static_relays()
    states: dict[str, ModuleState] = {}
    with start_dht(DHTOptions(host_maddrs=HOST)) as relay:
        addr = relay.maddrs()[0]
        with start_dht(DHTOptions(host_maddrs=HOST, initial_peers=[addr], relays=[addr])) as a, \
                start_dht(DHTOptions(host_maddrs=HOST, initial_peers=[addr], relays=[addr])) as b:
            assert all("/p2p-circuit/" in m for m in [*a.maddrs(), *b.maddrs()]), (a.maddrs(), b.maddrs())
            holder = NetAverager(a, RUN_ID, CONFIG, state_provider=states.get, relayed=True)
            newcomer = NetAverager(b, RUN_ID, CONFIG, relayed=True)
            try:
                holder.hold("L0M0", 7)
                wait_for(lambda: a.peer_id in read_records(b.dht, holders_key(RUN_ID, "L0M0"), HolderRecord), 60,
                         "the holder's record, seen by the newcomer")
                yield holder, newcomer, states, (a, b)
            finally:
                newcomer.shutdown()
                holder.shutdown()


def _state(seed: int, round_no: int) -> ModuleState:
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(300, 300, generator=g), torch.randn(300, generator=g)]
    return ModuleState(params, [torch.randn(p.shape, generator=g) for p in params], round_no)


def test_a_state_larger_than_the_relay_limit_arrives_whole_in_pieces(relayed_pair, caplog):
    holder, newcomer, states = relayed_pair[:3]
    sent = states["L0M0"] = _state(0, 7)  # 2 x 361 KB: several times the relay's 128 KiB per connection
    with caplog.at_level(logging.INFO, logger="peer.averaging.state_transfer"):
        got = newcomer.fetch_state("L0M0", 60, like=sent.global_params)
    assert got.round_no == 7 and got.source == holder.peer_id
    assert all(torch.equal(x, y) for x, y in zip(got.global_params + got.momentum, sent.global_params + sent.momentum))
    pieces = [r.getMessage() for r in caplog.records if "came in" in r.getMessage()]
    # the relay did cut it (else this test proves nothing about resuming)
    assert pieces and int(pieces[0].split("came in ")[1].split()[0]) >= 3, pieces


def test_a_resume_for_a_state_no_longer_kept_starts_again_from_the_current_one(relayed_pair):
    """The holder moves to a new round between the pieces of one transfer: the resumed request names the
    old state's digest, is refused, and the newcomer gets the new state whole, never a mix of both."""
    from hivemind.p2p import P2P, PeerID

    from peer.averaging.state_transfer import STATE
    from peer.network.frames import handler_name
    from protos.hivepath.peer.v1.net_pb2 import StateReply, StateRequest

    holder, newcomer, states = relayed_pair[:3]
    states["L0M0"] = _state(1, 8)

    async def ask(request: StateRequest) -> StateReply:
        # each reply's payload, unread, still crosses the relay: a later request can meet its reset
        for attempt in range(5):
            _, reader, writer = await newcomer._p2p.call_binary_stream_handler(PeerID.from_base58(holder.peer_id),
                                                                              handler_name(newcomer.prefix, STATE))
            try:
                await P2P.send_protobuf(request, writer)
                reply, err = await P2P.receive_protobuf(StateReply, reader)
                assert err is None, err
                return reply
            except (EOFError, ConnectionError):
                if attempt == 4:
                    raise
            finally:
                writer.close()

    first = newcomer._call(ask(StateRequest(module_id="L0M0", config_hash=CONFIG)), 30)
    assert first.ok and first.round_no == 8 and first.total_len == first.payload_len > 0 and len(first.digest) == 64
    # the same state resumes
    again = newcomer._call(ask(StateRequest(module_id="L0M0", config_hash=CONFIG, offset=1000, digest=first.digest)), 30)
    assert again.ok and again.digest == first.digest and again.payload_len == first.total_len - 1000
    # a newer state replaces it at the next request from the start
    states["L0M0"] = _state(2, 9)
    newer = newcomer._call(ask(StateRequest(module_id="L0M0", config_hash=CONFIG)), 30)
    assert newer.ok and newer.round_no == 9 and newer.digest != first.digest
    stale = newcomer._call(ask(StateRequest(module_id="L0M0", config_hash=CONFIG, offset=1000, digest=first.digest)), 30)
    assert not stale.ok and "no longer kept" in stale.error
    got = newcomer.fetch_state("L0M0", 60, like=states["L0M0"].global_params)
    assert got.round_no == 9 and torch.equal(got.global_params[0], states["L0M0"].global_params[0])


def test_two_relayed_peers_average_a_module_larger_than_the_relay_limit_bit_identically(relayed_pair, caplog):
    """A 300k-parameter module, int8: each round moves about 300 KB each way between the two, more than
    two relayed connections carry. Without pieces and one-at-a-time resends, no round would complete."""
    import threading

    from peer.compression import get_codec

    a, b = relayed_pair[:2]
    for av in (a, b):
        av.hold("L1M0", 0)
    wait_for(lambda: len(read_records(b.dht, holders_key(RUN_ID, "L1M0"), HolderRecord)) == 2, 60,
             "both holder records")
    codec = get_codec("int8")
    with caplog.at_level(logging.INFO, logger="peer.averaging.allreduce"):
        for r in range(3):
            deltas = [torch.randn(300_000, generator=torch.Generator().manual_seed(10 * r + i)) for i in range(2)]
            results: list = [None, None]

            def one(i: int) -> None:
                results[i] = (a, b)[i].average("L1M0", r, [deltas[i]], float(i + 1), codec, 30.0)

            threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            for res in results:
                assert res.averaged is not None and res.group_size == 2, res.reason
            assert torch.equal(results[0].averaged[0], results[1].averaged[0])
            want = (deltas[0] + 2 * deltas[1]) / 3  # weighted by tokens (1 and 2)
            assert (results[0].averaged[0] - want).abs().max() < 0.05 * deltas[0].abs().max()
    # the relay did cut parts (else this proves nothing about resending them)
    assert any("asking" in r.getMessage() and "again" in r.getMessage() for r in caplog.records)


def test_a_relayed_trainer_trains_through_a_relayed_stage_server(relayed_pair):
    """Stage mode with both ends behind NAT: the stage server and its client can each be dialled only
    through the relay. A first small forward and backward match local autograd, and 16 request pairs of
    32 KB each way go through while the relay resets the connection every 128 KiB: a request cut by a
    reset is sent again by the client, to the same server (the only one)."""
    from models.lattice import ModularLM
    from models.presets import tiny_cpu
    from peer.stage import StageClient, StageServer, StageServerOptions

    cfg = tiny_cpu()
    C, T = cfg.lattice.d_model, cfg.lattice.seq_len
    B = 8  # (8, 32, 32) fp32: 32 KB a request
    server_dht, client_dht = relayed_pair[3]
    server = StageServer(cfg, "L0M0", server_dht, options=StageServerOptions(max_elements=B * T * C)).start()
    client = StageClient(client_dht, cfg.run_id, cfg.content_hash(), codec="none", request_timeout=10.0)
    try:
        ref = ModularLM(cfg.lattice, seed=cfg.seed, module_ids=["L0M0"]).mods["L0M0"]
        g = torch.Generator().manual_seed(5)
        # a first small pair (8 KB each way, far below the relay's first reset and a step's tokens):
        # exactly the module's autograd (a backward resent after the server stepped would differ)
        x = torch.randn(2, T, C, generator=g)
        y, hop = client.forward("L0M0", x)
        grad = torch.randn(y.shape, generator=g)
        gx = client.backward(hop, grad)
        xr = x.clone().requires_grad_(True)
        yr = ref(xr)
        yr.backward(grad)
        assert torch.allclose(y, yr, atol=1e-5) and torch.allclose(gx, xr.grad, atol=1e-5)
        for i in range(16):
            x = torch.randn(B, T, C, generator=g)
            y, hop = client.forward("L0M0", x)
            grad = torch.randn(y.shape, generator=g)
            gx = client.backward(hop, grad)
            assert hop.peer_id == server.peer_id and y.shape == gx.shape == x.shape
            assert bool(torch.isfinite(y).all() and torch.isfinite(gx).all())
        assert client.stats.bytes_sent > 3 * 128 * 1024  # more than three relayed connections carry
        assert client.stats.requests > 32, "no request was cut by the relay: this proves nothing about resending"
    finally:
        client.close()
        server.close()
