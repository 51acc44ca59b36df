"""Direct lanes (``peer.network.lanes``): streams between two real hivemind P2P hosts on loopback that
carry their bytes over a TLS connection of their own, opened through the authenticated p2p stream.

Checked: the handler sees the authenticated caller and intact bytes, streams reuse one connection,
a host that presents another certificate gets no token, a connection without a valid token or with
malformed frames reaches no handler, a lane cut mid-stream is a stream cut and the peer goes through
P2P for a while, a peer that offers no lane (or is of a version without lanes) is reached over P2P,
and a round among averagers with and without lanes is bit-identical.
"""

from __future__ import annotations

import asyncio
import os
import secrets
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from peer.network import lane_wire as wire
from peer.network import lanes as lanes_mod
from peer.network.frames import STREAM_CUT, read_payload, serve
from peer.network.lanes import DirectLanes
from protos.hivepath.peer.v1 import net_pb2

PART = net_pb2.DESCRIPTOR.services_by_name["Averaging"].methods_by_name["Part"]
PREFIX = "hivepath_lanetest"
NAME = f"{PREFIX}_part"

pytestmark = pytest.mark.integration


async def _hosts(offer: bool = True, serve_lanes: bool = True):
    """Two P2P hosts on loopback; the first serves an echo handler ``NAME`` (over its lane too when
    ``serve_lanes``); returns (a, b, lanes of a, lanes of b, calls seen by the handler)."""
    from hivemind.p2p import P2P

    a = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    b = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=[str(m) for m in await a.get_visible_maddrs()])
    lanes_a, lanes_b = DirectLanes(a, PREFIX, offer=offer), DirectLanes(b, PREFIX, offer=False)
    if serve_lanes:
        await lanes_a.start(lanes_mod.lane_hosts(await a.get_visible_maddrs()))
    await lanes_b.start([])
    calls: list[str] = []

    async def echo(info, reader, writer) -> None:
        calls.append(info.peer_id.to_base58())
        data = await read_payload(reader, 16 << 20)
        await P2P.send_raw_data(data[::-1], writer)
        await reader.read()  # the caller hangs up first, as over P2P

    await serve(a, PREFIX, PART, echo, lanes=lanes_a if serve_lanes else None)
    return a, b, lanes_a, lanes_b, calls


async def _close(*things) -> None:
    for thing in things:
        if isinstance(thing, DirectLanes):
            await thing.close()
        else:
            await thing.shutdown()


async def _echo_over(lanes_b: DirectLanes, peer: str, data: bytes) -> bytes:
    from hivemind.p2p import P2P

    opened = await lanes_b.open(peer, NAME)
    assert opened is not None
    reader, writer = opened
    try:
        await P2P.send_raw_data(data, writer)
        return await P2P.receive_raw_data(reader)
    finally:
        writer.close()


def test_streams_over_a_lane_reach_the_handler_as_the_authenticated_caller_on_one_connection():
    async def scenario() -> None:
        a, b, lanes_a, lanes_b, calls = await _hosts()
        try:
            assert lanes_a.addresses and lanes_a.addresses[0].startswith("127.0.0.1:")
            peer = a.peer_id.to_base58()
            assert await lanes_b.open(peer, NAME) is None  # the first lane is set up in the background
            await asyncio.wait_for(_until(lambda: lanes_b._idle.get(peer)), 10)
            # spans several frames, and more than a stream buffers before its connection stops reading
            data = os.urandom(wire.READ_AHEAD + 3 * wire.MAX_FRAME + 12345)
            for _ in range(3):
                assert await _echo_over(lanes_b, peer, data) == data[::-1]
                # the connection goes back to the pool once the handler ended its side too
                await asyncio.wait_for(_until(lambda: lanes_b._idle.get(peer)), 10)
            assert calls == [b.peer_id.to_base58()] * 3  # the caller the p2p connection authenticated
            assert lanes_b.opened == 3 and len(lanes_b._connections) == 1  # one TLS connection, reused
        finally:
            await _close(lanes_a, lanes_b, a, b)

    asyncio.run(scenario())


async def _until(condition, interval: float = 0.01):
    while not condition():
        await asyncio.sleep(interval)
    return condition()


def test_a_lane_presenting_another_certificate_gets_no_token_and_the_peer_goes_through_p2p():
    async def scenario() -> None:
        a, b, lanes_a, lanes_b, calls = await _hosts()
        try:
            peer = a.peer_id.to_base58()
            offer = await lanes_b._offer(peer)
            assert offer is not None
            offer.fingerprint = bytes(32)  # as if someone else answered at the offered address
            assert await lanes_b.connect(peer) is False
            assert "not the offered certificate" in offer.problems[0]
            assert lanes_b._paused[peer] > 0 and await lanes_b.open(peer, NAME) is None
            assert not any(c.peer for c in lanes_a._connections)  # no token arrived: nobody is known there
            await asyncio.wait_for(_until(lambda: not lanes_a._connections), 10)  # and the connection is gone
            assert calls == []
        finally:
            await _close(lanes_a, lanes_b, a, b)

    asyncio.run(scenario())


async def _raw_connection(lanes_a: DirectLanes):
    host, port = lanes_mod._split_address(lanes_a.addresses[0])
    return await asyncio.open_connection(host, port, ssl=lanes_mod._client_context(), server_hostname="")


@pytest.mark.parametrize("hello", ["random token", "oversized frame", "data before open", "unknown handler"])
def test_a_connection_without_a_valid_token_or_with_malformed_frames_is_closed_and_reaches_no_handler(hello):
    async def scenario() -> None:
        a, b, lanes_a, lanes_b, calls = await _hosts()
        try:
            peer = a.peer_id.to_base58()
            offer = await lanes_b._offer(peer)  # a valid token, issued to b
            header = wire._HEADER
            token = secrets.token_bytes(32) if hello == "random token" else offer.token
            reader, writer = await _raw_connection(lanes_a)
            writer.write(header.pack(wire._HELLO, 32) + token)
            if hello == "oversized frame":
                writer.write(header.pack(wire._OPEN, wire.MAX_FRAME + 1))
            elif hello == "data before open":
                writer.write(header.pack(wire._DATA, 3) + b"abc")
            elif hello == "unknown handler":
                name = b"hivepath_lanetest_nosuch"
                writer.write(header.pack(wire._OPEN, len(name)) + name)
            else:
                writer.write(header.pack(wire._OPEN, len(NAME)) + NAME.encode())
            await writer.drain()
            assert await asyncio.wait_for(reader.read(), 10) == b""  # the server closed it
            writer.close()
            assert calls == []
            await asyncio.wait_for(_until(lambda: not lanes_a._connections), 10)
            # the lane still serves its rightful caller
            assert await lanes_b.connect(peer)
            assert await _echo_over(lanes_b, peer, b"abc") == b"cba" and calls == [b.peer_id.to_base58()]
        finally:
            await _close(lanes_a, lanes_b, a, b)

    asyncio.run(scenario())


def test_a_lane_cut_mid_stream_is_a_stream_cut_and_the_peer_goes_through_p2p_for_a_while():
    async def scenario() -> None:
        from hivemind.p2p import P2P

        a, b, lanes_a, lanes_b, calls = await _hosts()
        try:
            peer = a.peer_id.to_base58()
            assert await lanes_b.connect(peer)
            reader, writer = await lanes_b.open(peer, NAME)
            writer.write((100).to_bytes(8, "big") + b"0123456789")  # 10 of 100 bytes: the handler waits
            await writer.drain()
            await asyncio.wait_for(_until(lambda: lanes_a._connections), 10)
            for connection in list(lanes_a._connections):  # the connection dies (a reset, a crash)
                connection.transport.abort()
            with pytest.raises(STREAM_CUT):
                await asyncio.wait_for(P2P.receive_raw_data(reader), 10)
            writer.close()
            assert await lanes_b.open(peer, NAME) is None  # P2P until the pause is over
            lanes_b._paused[peer] = 0.0
            assert await lanes_b.connect(peer)  # then a fresh connection
            assert await _echo_over(lanes_b, peer, b"xyz") == b"zyx"
        finally:
            await _close(lanes_a, lanes_b, a, b)

    asyncio.run(scenario())


@pytest.mark.parametrize("peer_kind", ["offers none", "has no lanes"])
def test_a_peer_without_a_lane_is_reached_over_p2p(peer_kind):
    async def scenario() -> None:
        a, b, lanes_a, lanes_b, calls = await _hosts(offer=peer_kind != "offers none",
                                                     serve_lanes=peer_kind != "has no lanes")
        try:
            peer = a.peer_id.to_base58()
            assert await lanes_b.open(peer, NAME) is None
            await asyncio.wait_for(_until(lambda: peer not in lanes_b._connecting), 10)
            # paused: a lane-less peer costs one offer request per pause, and its streams go through P2P
            assert lanes_b._paused[peer] > 0 and await lanes_b.open(peer, NAME) is None
            assert not lanes_b._connecting
            _, reader, writer = await b.call_binary_stream_handler(a.peer_id, NAME)
            from hivemind.p2p import P2P

            await P2P.send_raw_data(b"abc", writer)
            assert await P2P.receive_raw_data(reader) == b"cba"
            writer.close()
        finally:
            await _close(lanes_a, lanes_b, a, b)

    asyncio.run(scenario())


def test_a_round_among_averagers_with_and_without_lanes_is_bit_identical_and_lanes_carry_their_parts():
    """Two averagers with lanes and one without (``direct_lanes=False``: a peer of an earlier version
    serves no ``Lane`` rpc): the two reach each other over their lanes, everyone reaches the third
    over P2P, and the three end with the same bytes, the codec's mean of their deltas."""
    from peer.localnet import wait_for

    from peer.averaging import BLOCK
    from peer.compression import get_codec
    from peer.averaging.net_averager import NetAverager
    from peer.network import DHTOptions, HolderRecord, holders_key, read_records, start_dht

    host = ["/ip4/127.0.0.1/tcp/0"]
    with start_dht(DHTOptions(host_maddrs=host)) as d0, \
            start_dht(DHTOptions(host_maddrs=host, initial_peers=d0.maddrs())) as d1, \
            start_dht(DHTOptions(host_maddrs=host, initial_peers=d0.maddrs())) as d2:
        avgs = [NetAverager(d, "lanes", "bbbb0000bbbb0000", direct_lanes=i < 2) for i, d in enumerate((d0, d1, d2))]
        try:
            for avg in avgs:
                avg.hold("L0M0", 0)
            for avg in avgs:
                wait_for(lambda: len(read_records(avg.dht, holders_key("lanes", "L0M0"), HolderRecord)) == 3, 30,
                         "every holder record")
            numel = 5 * BLOCK + 7
            deltas = [torch.randn(numel, generator=torch.Generator().manual_seed(i)) for i in range(3)]
            int8 = get_codec("int8")
            with ThreadPoolExecutor(3) as pool:
                # the first round goes through P2P while the lanes are set up; the second uses them
                for round_no in range(2):
                    results = list(pool.map(lambda i: avgs[i].average("L0M0", round_no, [deltas[i]], 1.0, int8, 30.0),
                                            range(3)))
                    streams = [avg.lane_streams for avg in avgs]
                    if round_no == 0:
                        wait_for(lambda: all(avg._lanes._idle for avg in avgs[:2]), 30, "the two lanes set up")
            # the codec's work ran in each averager's own small pool, not in asyncio's default one
            import threading

            from peer.averaging.net_averager import CODEC_THREADS
            codec_threads = [t for t in threading.enumerate() if t.name.startswith("net-averager-codec")]
            assert 3 <= len(codec_threads) <= 3 * CODEC_THREADS, [t.name for t in threading.enumerate()]
        finally:
            for avg in avgs:
                avg.shutdown()
    for res in results:
        assert res.group_size == 3, res.reason
        assert torch.equal(res.averaged[0], results[0].averaged[0])
    exact = sum(deltas) / 3
    assert float((results[0].averaged[0] - exact).abs().max()) < 2e-2 * float(exact.abs().max())
    assert streams[0] > 0 and streams[1] > 0 and streams[2] == 0, streams


def test_an_address_that_never_answers_holds_up_no_stream():
    """A firewall that drops the lane's port (here: a listener that never speaks TLS) costs the
    background set-up its timeout; streams meanwhile go through P2P at once, then the peer is paused."""
    async def scenario() -> None:
        a, b, lanes_a, lanes_b, calls = await _hosts()
        silent = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        try:
            peer = a.peer_id.to_base58()
            offer = await lanes_b._offer(peer)
            offer.addresses = [("127.0.0.1", silent.sockets[0].getsockname()[1])]
            assert await lanes_b.open(peer, NAME) is None
            assert peer in lanes_b._connecting  # still waiting on the silent address
            assert await lanes_b.open(peer, NAME) is None
            await asyncio.wait_for(_until(lambda: peer not in lanes_b._connecting), 10)
            assert "TimeoutError" in offer.problems[0] and lanes_b._paused[peer] > 0
        finally:
            silent.close()
            await _close(lanes_a, lanes_b, a, b)

    asyncio.run(scenario())


def test_a_handler_that_reads_late_stops_the_connection_reading_and_then_gets_every_byte():
    """Bytes nobody reads yet fill a stream's buffer up to READ_AHEAD, then the connection stops
    reading (the sender waits on TCP); a read of more than that resumes it and gets all of them."""
    async def scenario() -> None:
        from hivemind.p2p import P2P

        a, b, lanes_a, lanes_b, calls = await _hosts()
        go = asyncio.Event()

        async def late(info, reader, writer) -> None:
            await go.wait()
            data = await read_payload(reader, 128 << 20)
            await P2P.send_raw_data(len(data).to_bytes(8, "big"), writer)
            await reader.read()

        lanes_a.serve(f"{PREFIX}_late", late)
        try:
            peer = a.peer_id.to_base58()
            assert await lanes_b.connect(peer)
            reader, writer = await lanes_b.open(peer, f"{PREFIX}_late")
            data = bytes(4 * wire.READ_AHEAD)
            sending = asyncio.ensure_future(P2P.send_raw_data(data, writer))
            await asyncio.wait_for(_until(lambda: any(c._reading_paused for c in lanes_a._connections)), 10)
            # what is not read yet waits in TCP's buffers (the sender's drain holds it once they are full),
            # not in ours: at most READ_AHEAD and the last piece TLS handed over
            assert all(c.stream.reader._size <= wire.READ_AHEAD + (1 << 20) for c in lanes_a._connections)
            go.set()
            await asyncio.wait_for(sending, 10)
            assert int.from_bytes(await asyncio.wait_for(P2P.receive_raw_data(reader), 10), "big") == len(data)
            writer.close()
        finally:
            await _close(lanes_a, lanes_b, a, b)

    asyncio.run(scenario())


def test_the_offer_names_the_addresses_peers_reach_at_the_port_bound_for_them():
    offered = lanes_mod._offered
    # listening on the wildcard: each found address at its port, the wildcard itself never
    assert offered(["10.0.0.5", "127.0.0.1"], {"0.0.0.0": 4100}) == ["10.0.0.5:4100", "127.0.0.1:4100"]
    # an announced public address in front of a port forwarded to a private host we bound
    assert offered(["198.51.100.7"], {"10.0.0.5": 4100}) == ["198.51.100.7:4100", "10.0.0.5:4100"]
    # a host bound on its own keeps its own (ephemeral) port; v6 in brackets; no port for another family
    assert offered(["10.0.0.5", "fe80::1"], {"10.0.0.5": 4100, "::": 4200}) == ["10.0.0.5:4100", "[fe80::1]:4200"]
    assert offered(["fe80::1"], {"10.0.0.5": 4100}) == ["10.0.0.5:4100"]
    for text in offered(["10.0.0.5", "fe80::1"], {"0.0.0.0": 1, "::": 2}):
        assert lanes_mod._split_address(text)[1] in (1, 2)


def test_a_lane_port_asked_for_listens_on_the_wildcard_and_is_offered_at_the_found_address():
    import socket

    async def scenario() -> None:
        from hivemind.p2p import P2P

        with socket.socket() as probe:  # a free port, then released for the lane
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        a = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        b = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=[str(m) for m in await a.get_visible_maddrs()])
        lanes_a, lanes_b, taken = DirectLanes(a, PREFIX), DirectLanes(b, PREFIX, offer=False), DirectLanes(a, PREFIX)
        try:
            await lanes_a.start(["127.0.0.1"], listen=["0.0.0.0"], port=port)
            assert lanes_a.addresses == [f"127.0.0.1:{port}"]
            await lanes_b.start([])
            lanes_a.serve(NAME, _echo_handler)
            assert await lanes_b.connect(a.peer_id.to_base58())
            assert await _echo_over(lanes_b, a.peer_id.to_base58(), b"abc") == b"cba"
            with pytest.raises(lanes_mod.LanePortError, match=f"cannot listen on port {port}"):
                await taken.start(["127.0.0.1"], port=port)  # in use: the operator hears of it at start
        finally:
            await _close(lanes_a, lanes_b, taken, a, b)

    asyncio.run(scenario())


async def _echo_handler(info, reader, writer) -> None:
    from hivemind.p2p import P2P

    data = await read_payload(reader, 1 << 20)
    await P2P.send_raw_data(data[::-1], writer)
    await reader.read()


@pytest.mark.parametrize("extra, problem", [({"lane_port": 70000}, "--lane-port must be a TCP port"),
                                            ({"lane_port": 4100, "client_mode": True}, "--client-mode accepts no")])
def test_a_lane_port_that_cannot_be_is_refused_naming_the_flag(extra, problem):
    from models.errors import HivepathError
    from peer.node.startup import NetworkOptions

    with pytest.raises(HivepathError, match=problem):
        NetworkOptions(coordinator="127.0.0.1:7700", token="t", **extra)
