"""A reducer's validation of the parts it receives (``peer.averaging.reducer``): a malformed contribution
(wrong codec or size, a corrupt entropy frame, a bad weight) drops its sender from the part and
keeps everyone else's; a good one decodes to exactly what its sender's codec round trip gives."""

from __future__ import annotations

import asyncio

import pytest
import torch

from peer.averaging import BLOCK
from peer.compression import get_codec
from peer.averaging.reducer import PartReducer, PartSlot
from protos.hivepath.peer.v1.net_pb2 import PartHeader

N = 2 * BLOCK


def _header(codec: str, numel: int = N, weight: float = 1.0) -> PartHeader:
    return PartHeader(group_id="g", segment=0, part_index=0, attempt=0, weight=weight, numel=numel, codec=codec)


@pytest.mark.parametrize("codec", ["int8", "int8+zstd", "int4+zstd", "none+zstd"])
def test_reducer_drops_the_sender_of_a_malformed_part_and_keeps_the_rest(codec):
    x = torch.randn(N, generator=torch.Generator().manual_seed(0)) * 0.01  # (N,)
    good = get_codec(codec).encode(x)
    other = codec.split("+")[0] if "+" in codec else f"{codec}+zstd"
    bad = {
        "wrong-codec": (_header(other), get_codec(other).encode(x), f"part is {other}/{N} elements"),
        "wrong-numel": (_header(codec, N - BLOCK), good, f"expected {codec}/{N}"),
        "too-long": (_header(codec), good + bytes(get_codec(codec).encoded_size(N)), "cannot encode"),
        "empty": (_header(codec), b"", "cannot encode"),
        "nan-weight": (_header(codec, weight=float("nan")), good, "weight nan"),
    }
    if "+" in codec:
        bad["unknown-tag"] = (_header(codec), b"\x05" + good[1:], "unknown entropy tag 5")
        bad["corrupt"] = (_header(codec), good[:1] + good[1:6] + bytes(len(good) - 6), "undecodable")

    async def main() -> PartSlot:
        server = PartReducer(p2p=None, peer_id="me", prefix="test")
        slot = PartSlot(N, get_codec(codec), expected={"honest", *bad})
        assert await server._offer(slot, "honest", _header(codec), good) == ""
        for sender, (header, payload, why) in bad.items():
            problem = await server._offer(slot, sender, header, payload)
            assert why in problem, (sender, problem)
        assert "duplicate" in await server._offer(slot, "honest", _header(codec), good)
        assert "not a member" in await server._offer(slot, "stranger", _header(codec), good)
        return slot

    slot = asyncio.run(main())
    assert set(slot.decoded) == {"honest"} and set(slot.dropped) == set(bad)
    assert slot.complete()
    assert torch.equal(slot.decoded["honest"][0], get_codec(codec).roundtrip(x))
