"""The sparse codec ``topk{K}b{B}`` (issue 26): layout, exact sizes, top-k, error feedback and averages
that decode to the same bits whichever format the reducer sends."""

from __future__ import annotations

import pytest
import torch

from models.codec_spec import codec_spec, encoded_size, split_wire_name, wire_name
from models.config import ConfigError, OuterConfig
from models.sparse_spec import CHUNK, FEEDBACK_DECAY, feedback_decay, sparse_spec
from peer.averaging import ErrorFeedback, LocalAverager, aggregate, encode_aggregate, get_codec, reduce_part, weighted_mean
from peer.averaging.aggregation import Aggregation
from peer.averaging.sparse import EXACT, GATHER


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


def test_k16_at_2_bits_is_146x_smaller_than_fp32():
    n = 64 * CHUNK
    assert codec_spec("topk16b2").encoded_size(n) == 64 * (4 + 16 * 12 // 8)
    assert 4 * n / codec_spec("topk16b2").encoded_size(n) == pytest.approx(146.3, abs=0.1)


def test_parts_cut_at_chunk_boundaries_encode_to_the_whole_vector():
    codec = get_codec("topk16b2")
    x = _vec(6 * CHUNK + 300, 2)
    whole = codec.encode(x)
    parts = codec.encode(x[: 2 * CHUNK]) + codec.encode(x[2 * CHUNK : 5 * CHUNK]) + codec.encode(x[5 * CHUNK :])
    assert parts == whole


@pytest.mark.parametrize("corrupt", ["length", "position", "order", "scale", "padding"])
def test_malformed_bytes_are_refused(corrupt):
    codec = get_codec("topk16b2")
    data = bytearray(codec.encode(_vec(CHUNK, 3)))
    if corrupt == "length":
        data = data[:-1]
    elif corrupt == "scale":
        data[0:4] = bytes.fromhex("0000c0ff")  # NaN
    elif corrupt in ("position", "order"):
        # first entry's position bits: set them to the second's (order) or beyond the chunk (tail chunk)
        data = bytearray(codec.encode(_vec(CHUNK, 3)))
        if corrupt == "order":
            data[4] = 0xFF
            data[5] |= 0xC0  # first position = 1023: the next one cannot be larger
        else:
            data = bytearray(codec.encode(_vec(100, 3)))
            data[4] = 0xFF
            data[5] |= 0xC0  # position 1023 in a chunk of 100
    elif corrupt == "padding":
        data = bytearray(get_codec("topk3b2").encode(_vec(CHUNK, 3)))  # 3 x 12 bits: 4 padding bits
        data[-1] |= 0x01
        codec = get_codec("topk3b2")
    with pytest.raises(ValueError):
        codec.decode(bytes(data), 100 if corrupt == "position" else CHUNK)


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
