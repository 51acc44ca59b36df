"""A state transfer whose connection is cut before the holder's first byte asks the same holder again.

A relay resets a relayed connection after 128 KiB each way (``peer.network.relays``): the reset can
fall on the request of a transfer's first piece, before any byte of the state came back (the earlier
traffic of the pair used up the connection's allowance). That is a cut like any later piece's, not a
holder that cannot serve: the transfer dials again instead of giving up on the holder (with a single
holder, the fetch failed). Here the stream is hivemind's P2P stand-in: the first stream ends before
the reply, the next ones serve the state.
"""

from __future__ import annotations

import asyncio
import hashlib

import pytest

from peer.averaging.state_transfer import _transfer
from protos.hivepath.peer.v1.net_pb2 import StateReply, StateRequest

STATE = bytes(range(256)) * 40


class _Writer:
    def __init__(self) -> None:
        self.sent = bytearray()

    def write(self, data: bytes) -> None:
        self.sent += data

    async def drain(self) -> None:
        return None

    def close(self) -> None:
        return None


class _CutFirst:
    """``call_binary_stream_handler`` whose first ``cuts`` streams end before the reply (a reset)."""

    def __init__(self, cuts: int) -> None:
        self.cuts, self.opened = cuts, 0

    async def call_binary_stream_handler(self, peer_id, name):
        self.opened += 1
        reader = asyncio.StreamReader()
        if self.opened > self.cuts:
            reply = StateReply(ok=True, round_no=7, payload_len=len(STATE), total_len=len(STATE),
                               digest=hashlib.sha256(STATE).hexdigest()).SerializeToString()
            reader.feed_data(b"\x00" + len(reply).to_bytes(8, "big") + reply)
            reader.feed_data(len(STATE).to_bytes(8, "big") + STATE)
        reader.feed_eof()
        return None, reader, _Writer()


PEER = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"


@pytest.mark.parametrize("cuts", [1, 2])
def test_a_first_piece_cut_before_any_byte_is_asked_again(cuts):
    p2p = _CutFirst(cuts)
    round_no, data = asyncio.run(_transfer(p2p, PEER, "hivepath_t", StateRequest(module_id="L0M0"), 5.0, 1 << 20))
    assert (round_no, data) == (7, STATE)
    assert p2p.opened == cuts + 1


def test_a_holder_whose_connections_keep_being_cut_before_any_byte_is_given_up():
    p2p = _CutFirst(100)
    with pytest.raises(RuntimeError, match="0 of 0 bytes received"):
        asyncio.run(_transfer(p2p, PEER, "hivepath_t", StateRequest(module_id="L0M0"), 5.0, 1 << 20))
    assert p2p.opened == 3  # three stalls in a row, then the next holder
