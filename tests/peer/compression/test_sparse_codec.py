"""The sparse codec ``topk{K}b{B}``: layout, exact sizes, top-k, error feedback and averages
that decode to the same bits whichever format the reducer sends."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from models.codec_spec import codec_spec, encoded_size, split_wire_name, wire_name
from models.config import ConfigError, OuterConfig
from models.sparse_spec import CHUNK, FEEDBACK_DECAY, feedback_decay, sparse_spec
from peer.averaging import LocalAverager, aggregate, encode_aggregate, reduce_part
from peer.compression import ErrorFeedback, get_codec, weighted_mean
from peer.averaging.aggregation import Aggregation
from peer.compression.sparse import EXACT, GATHER


def _vec(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name,numel", [("topk16b2", 5 * CHUNK), ("topk32b4", 3 * CHUNK + 100), ("topk1b2", 7),
                                        ("topk1024b2", CHUNK + 1)])
def test_roundtrip_keeps_the_largest_values_per_chunk_at_exact_sizes(name, numel):
    codec = get_codec(name)
    spec = sparse_spec(name)
    x = _vec(numel, 1)
    data, decoded = codec.encode_roundtrip(x)
    assert len(data) == codec.encoded_size(numel) == spec.encoded_size(numel) == encoded_size(name, numel)
    assert torch.equal(codec.decode(data, numel), decoded)
    for start in range(0, numel, CHUNK):
        chunk, dec = x[start:start + CHUNK], decoded[start:start + CHUNK]
        kept = dec != 0
        assert int(kept.sum()) == spec.kept(chunk.numel())
        # every kept value is at least as large as every dropped one, and keeps its sign
        if bool((~kept).any()):
            assert float(chunk[kept].abs().min()) >= float(chunk[~kept].abs().max())
        assert bool((torch.sign(dec[kept]) == torch.sign(chunk[kept])).all())
        # levels: +-level * absmax / 2^(B-1)
        scale = chunk[kept].abs().max() / spec.levels  # fp32, exact (a power of two)
        levels = dec[kept].abs() / scale
        assert torch.allclose(levels, levels.round(), atol=1e-5, rtol=0)
        assert float(levels.round().min()) >= 1 and float(levels.max()) == spec.levels


def test_k16_at_2_bits_is_170x_smaller_than_fp32():
    n = 64 * CHUNK
    # 4 bytes of scale, 16 positions Elias-Fano coded in 32 + 16 x 6 bits, 16 codes of 2 bits
    assert codec_spec("topk16b2").encoded_size(n) == 64 * (4 + (32 + 16 * 6 + 16 * 2) // 8)
    assert 4 * n / codec_spec("topk16b2").encoded_size(n) == pytest.approx(170.7, abs=0.1)


@pytest.mark.parametrize("count,kept", [(1024, 16), (1024, 14), (1024, 1), (1024, 1024), (100, 2), (7, 1), (5, 5),
                                        (1000, 999), (33, 4)])
def test_positions_are_elias_fano_coded_in_their_exact_size(count, kept):
    from models.sparse_spec import position_bits
    from peer.compression.sparse import _elias_fano, _elias_fano_positions

    g = torch.Generator().manual_seed(count * 7 + kept)
    idx = torch.stack([torch.randperm(count, generator=g)[:kept].sort().values for _ in range(20)]).numpy()
    idx[0] = np.arange(count - kept, count)  # the last positions: the largest high parts
    idx[1] = np.arange(kept)
    bits = _elias_fano(idx, count)
    assert bits.shape == (20, position_bits(count, kept))
    back, used = _elias_fano_positions(bits, count, kept, "test")
    assert used == bits.shape[1] and np.array_equal(back, idx)


def test_parts_cut_at_chunk_boundaries_encode_to_the_whole_vector():
    codec = get_codec("topk16b2")
    x = _vec(6 * CHUNK + 300, 2)
    whole = codec.encode(x)
    parts = codec.encode(x[: 2 * CHUNK]) + codec.encode(x[2 * CHUNK : 5 * CHUNK]) + codec.encode(x[5 * CHUNK :])
    assert parts == whole


def _edit_bits(data: bytes, edit) -> bytes:
    """``data`` with ``edit(bits)`` applied to its bits after the 4-byte scale (one chunk)."""
    bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8)[4:]).copy()
    edit(bits)
    return data[:4] + np.packbits(bits).tobytes()


@pytest.mark.parametrize("corrupt,says", [("length", "bytes"), ("count", "do not hold 16 entries"),
                                           ("position", "out of the chunk or not strictly ascending"),
                                           ("order", "out of the chunk or not strictly ascending"),
                                           ("scale", "scale"), ("padding", "padding")])
def test_malformed_bytes_are_refused(corrupt, says):
    codec, numel = get_codec("topk16b2"), CHUNK
    data = codec.encode(_vec(CHUNK, 3))
    # topk16b2 on 1024 values: 32 bits of high parts (16 ones), 16 x 6 low bits, 16 x 2 bits of codes
    if corrupt == "length":
        data = data[:-1]
    elif corrupt == "scale":
        data = bytes.fromhex("0000c0ff") + data[4:]  # NaN
    elif corrupt == "count":
        data = _edit_bits(data, lambda b: b.__setitem__(int(np.flatnonzero(b[:32] == 0)[0]), 1))  # 17 ones
    elif corrupt == "order":
        def same_first_two(b):  # positions 0 and 1 both high part 0 with equal low parts: not ascending
            b[:32] = 0
            b[0:2] = 1
            b[3:17] = 1  # the other 14: high part 1 (in the chunk)
            b[32 + 6 : 32 + 12] = b[32:38]
        data = _edit_bits(data, same_first_two)
    elif corrupt == "position":
        numel = 100  # a tail chunk keeps 2 positions with 5 low bits; its high parts take 6 bits
        data = _edit_bits(codec.encode(_vec(100, 3)), lambda b: b.__setitem__(slice(0, 6), [0, 0, 0, 0, 1, 1]))
    elif corrupt == "padding":
        codec = get_codec("topk3b2")  # 31 bits of positions and 6 of codes: 3 padding bits
        data = bytearray(codec.encode(_vec(CHUNK, 3)))
        data[-1] |= 0x01
        data = bytes(data)
    with pytest.raises(ValueError, match=says):
        codec.decode(data, numel)


def test_averages_gathered_or_exact_decode_to_the_weighted_mean_bit_for_bit():
    codec = get_codec("topk16b2")
    n = 4 * CHUNK + 17
    contributions = {f"p{i}": (codec.roundtrip(_vec(n, 10 + i)), float(3 + i)) for i in range(4)}
    reduced = aggregate(contributions)
    expected = weighted_mean([contributions[p][0] for p in sorted(contributions)],
                             [contributions[p][1] for p in sorted(contributions)])
    assert torch.equal(reduced.value, expected)
    gathered = encode_aggregate(codec, reduced, contributions)
    assert gathered[0] == GATHER  # 4 independent contributions barely overlap: gathering is smaller
    assert torch.equal(codec.decode_average(gathered, n), expected)
    exact = codec.encode_average(reduced.value)  # no contributions given: the aggregate itself
    assert exact[0] == EXACT and len(exact) > len(gathered)
    assert torch.equal(codec.decode_average(exact, n), expected)
    # overlapping contributions (the same positions): the union is small and sent exactly
    same = {f"p{i}": (contributions["p0"][0] * (i + 1), 1.0) for i in range(4)}
    reduced = aggregate(same)
    reply = encode_aggregate(codec, reduced, same)
    assert reply[0] == EXACT and torch.equal(codec.decode_average(reply, n), reduced.value)


def test_robust_rules_send_their_aggregate_exactly():
    codec = get_codec("topk16b2")
    contributions = {f"p{i}": (codec.encode(_vec(CHUNK, 20 + i)), 1.0) for i in range(4)}
    rule = Aggregation("trimmed_mean")
    data, reduced = reduce_part(codec, contributions, CHUNK, rule)
    assert data[0] == EXACT and torch.equal(codec.decode_average(data, CHUNK), reduced.value)


def test_error_feedback_decays_by_095_for_sparse_codecs():
    assert feedback_decay("topk16b2") == FEEDBACK_DECAY == 0.95 and feedback_decay("int8") == 1.0
    ef = ErrorFeedback(4, decay=0.95)
    ef.update(torch.tensor([2.0, 0.0, 0.0, 0.0]), torch.zeros(4))
    assert torch.equal(ef.add(torch.ones(4)), torch.tensor([1.0 + 0.95 * 2.0, 1.0, 1.0, 1.0]))
    with pytest.raises(ValueError):
        ErrorFeedback(4, decay=0.0)


def test_local_averager_members_apply_identical_bits_with_token_weights():
    codec = get_codec("topk16b2")
    hub = LocalAverager()
    members = [hub.member(f"w{k}") for k in range(3)]
    deltas = [_vec(3 * CHUNK, 30 + k) for k in range(3)]
    results = [None] * 3

    import threading

    def go(k: int) -> None:
        results[k] = members[k].average("m", 0, [deltas[k]], float(100 * (k + 1)), codec, timeout=30.0)

    threads = [threading.Thread(target=go, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    expected = weighted_mean([codec.roundtrip(d) for d in deltas], [100.0, 200.0, 300.0])
    for res in results:
        assert res.ok and res.group_size == 3
        assert torch.equal(res.averaged[0], expected)
    assert results[0].bytes_sent == codec.encoded_size(3 * CHUNK)


def test_config_and_wire_names():
    assert OuterConfig(codec="topk16b2").wire_codec() == "topk16b2"  # no entropy stage on packed bits
    assert split_wire_name("topk16b2") == ("topk16b2", "none") and wire_name("topk32b4", "zstd") == "topk32b4"
    for bad in ("topk0b2", "topk16b3", "topk2000b2", "topk16"):
        with pytest.raises(ConfigError, match="codec"):
            OuterConfig(codec=bad)
        with pytest.raises(ValueError):
            get_codec(bad)
