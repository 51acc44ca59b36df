"""Pseudo-gradient codecs: exact sizes, error bounds, block alignment, malformed input, error feedback."""

from __future__ import annotations

import platform
import struct

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from models.codec_spec import CODECS
from peer.averaging import BLOCK, flatten, unflatten
from peer.compression import ErrorFeedback, get_codec
from peer.averaging.memory import FlatBuffers, keep_freed_memory


def _gauss(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


# -- sizes ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "numel, sizes",
    [
        (0, {"none": 0, "fp16": 0, "int8": 0, "int4": 0}),
        (1, {"none": 4, "fp16": 2, "int8": 5, "int4": 5}),
        (1024, {"none": 4096, "fp16": 2048, "int8": 1028, "int4": 516}),
        (2049, {"none": 8196, "fp16": 4098, "int8": 2061, "int4": 1037}),
        (2500, {"none": 10000, "fp16": 5000, "int8": 2512, "int4": 1262}),
    ],
)
def test_encoded_sizes_are_exact(numel, sizes):
    x = _gauss(numel)
    for name in CODECS:
        codec = get_codec(name)
        assert codec.encoded_size(numel) == sizes[name], name
        assert len(codec.encode(x)) == sizes[name], name


def test_compressed_size_per_codec_on_a_large_vector():
    """The ratios quoted in docs/BENCHMARKS.md (codecs) (1 Mi values)."""
    n = 1 << 20
    ratios = {name: get_codec(name).encoded_size(n) / (4 * n) for name in CODECS}
    assert ratios == {"none": 1.0, "fp16": 0.5, "int8": 0.2509765625, "int4": 0.1259765625}


# -- round-trip error -------------------------------------------------------------------------------


def test_roundtrip_error_on_gaussian_deltas():
    """Relative L2 error of each codec on N(0, 1) values, as measured in docs/BENCHMARKS.md (codecs)."""
    x = _gauss(1 << 18)
    rel = {}
    for name in CODECS:
        y = get_codec(name).roundtrip(x)
        assert y.dtype == torch.float32 and y.shape == x.shape
        rel[name] = float((y - x).norm() / x.norm())
    assert rel["none"] == 0.0
    assert 1e-4 < rel["fp16"] < 3e-4
    assert 5e-3 < rel["int8"] < 1e-2
    assert 0.1 < rel["int4"] < 0.16


@settings(max_examples=60, deadline=None)
@given(
    values=st.lists(st.floats(-1e4, 1e4, allow_nan=False, width=32), min_size=1, max_size=2600),
    name=st.sampled_from(["int8", "int4"]),
)
def test_blockwise_error_bounded_by_half_a_step(values, name):
    x = torch.tensor(values, dtype=torch.float32)
    codec = get_codec(name)
    y = codec.roundtrip(x)
    qmax = {"int8": 127, "int4": 7}[name]
    for start in range(0, x.numel(), BLOCK):
        block = x[start : start + BLOCK]
        bound = float(block.abs().max()) / qmax / 2 * (1 + 1e-5)
        assert float((y[start : start + BLOCK] - block).abs().max()) <= bound + 1e-30
    assert bool((y[x == 0] == 0).all())


@settings(max_examples=40, deadline=None)
@given(values=st.lists(st.floats(-6e4, 6e4, allow_nan=False, width=32), min_size=1, max_size=300))
def test_fp16_relative_error(values):
    x = torch.tensor(values, dtype=torch.float32)
    y = get_codec("fp16").roundtrip(x)
    assert bool(((y - x).abs() <= x.abs() * 2**-11 + 2**-24).all())


def test_none_is_exact_and_zero_vector_stays_zero():
    x = _gauss(3000)
    assert torch.equal(get_codec("none").roundtrip(x), x)
    for name in CODECS:
        assert torch.equal(get_codec(name).roundtrip(torch.zeros(2050)), torch.zeros(2050))


# -- block alignment --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", CODECS)
def test_encoding_in_block_aligned_parts_equals_encoding_whole(name):
    codec = get_codec(name)
    x = _gauss(5 * BLOCK + 77, seed=3) * torch.linspace(0.01, 10, 5 * BLOCK + 77)
    bounds = [0, BLOCK, 3 * BLOCK, 5 * BLOCK, x.numel()]
    parts = [x[a:b] for a, b in zip(bounds, bounds[1:])]
    encoded_parts = [codec.encode(p) for p in parts]
    assert b"".join(encoded_parts) == codec.encode(x)
    decoded = torch.cat([codec.decode(e, p.numel()) for e, p in zip(encoded_parts, parts)])
    assert torch.equal(decoded, codec.roundtrip(x))


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_encoders_taking_a_long_vector_in_chunks_give_the_bytes_of_each_block_alone(name):
    """Blockwise encoders take full blocks a chunk at a time (``_CHUNK_BLOCKS``): across chunk
    boundaries, with a tail block, the bytes are those of every block encoded alone (an all-zero
    block's scale is +0.0 whichever way torch finds its extremes), and the round
    trip and the decoded values agree."""
    from peer.compression.quantizers import _CHUNK_BLOCKS

    codec = get_codec(name)
    numel = (2 * _CHUNK_BLOCKS + 3) * BLOCK + 77
    x = _gauss(numel, seed=9) * torch.linspace(0.01, 10, numel)
    x[BLOCK : 2 * BLOCK] = 0.0
    data, values = codec.encode_roundtrip(x)
    assert data == codec.encode(x)
    assert data == b"".join(codec.encode(x[a : a + BLOCK]) for a in range(0, numel, BLOCK))
    assert values.numpy().tobytes() == codec.decode(data, numel).numpy().tobytes()
    assert values.numpy().tobytes() == codec.roundtrip(x).numpy().tobytes()


def test_unaligned_parts_differ_for_blockwise_codecs():
    """The alignment rule matters: splitting mid-block changes the scales, hence the values."""
    x = _gauss(2 * BLOCK, seed=4)
    x[0] = 50.0  # a large value in block 0 only
    codec = get_codec("int8")
    split = torch.cat([codec.roundtrip(x[:100]), codec.roundtrip(x[100:])])
    assert not torch.equal(split, codec.roundtrip(x))


# -- golden bytes and determinism -------------------------------------------------------------------


def test_golden_bytes_pin_the_formats():
    x = torch.tensor([0.0, 1.0, -1.0, 0.5])
    scale7 = struct.pack("<f", np.float32(1.0) / np.float32(7.0))
    # int4: 0.5 / fp32(1/7) = 3.4999998 -> codes 0, 7, -7, 3 -> nibbles 8, 15, 1, 11, low nibble first
    assert get_codec("int4").encode(x) == scale7 + bytes([0xF8, 0xB1])
    scale127 = struct.pack("<f", np.float32(1.0) / np.float32(127.0))
    # int8: 0.5 / fp32(1/127) = 63.5 exactly -> 64 (round half to even)
    assert get_codec("int8").encode(x) == scale127 + bytes([0, 127, 0x81, 64])
    assert get_codec("fp16").encode(x) == bytes.fromhex("0000003c00bc0038")
    assert get_codec("none").encode(x) == struct.pack("<4f", 0.0, 1.0, -1.0, 0.5)


def test_int4_whole_buffer_packing_equals_the_per_nibble_table():
    """Full blocks take the int16 pair path both ways; it must give the bytes and codes of the
    padded, table-driven path that odd tail blocks still use."""
    from peer.compression.quantizers import _NIBBLES

    codec = get_codec("int4")
    gen = torch.Generator().manual_seed(0)
    for count in (BLOCK, 2, 6):
        q = torch.randint(-7, 8, (33, count), generator=gen).float()  # (nb, count) integral codes
        fast = np.empty((33, count // 2), dtype=np.uint8)
        codec._pack_into(q, fast)
        assert np.array_equal(fast, codec._pack(q)), count
        codes = codec._unpack(fast, count)
        assert np.array_equal(codes.numpy(), np.take(_NIBBLES, fast, axis=0).reshape(33, -1)), count
        assert torch.equal(codes.float(), q)


@pytest.mark.parametrize("name", CODECS)
def test_decode_is_deterministic_and_independent_of_input_memory(name):
    codec = get_codec(name)
    data = codec.encode(_gauss(3000, seed=5))
    a = codec.decode(data, 3000)
    b = codec.decode(bytearray(data), 3000)
    assert torch.equal(a, b) and a.dtype == torch.float32 and a.is_contiguous()


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("numel", [0, 1, 7, BLOCK, 3 * BLOCK + 17])
def test_encode_roundtrip_gives_the_bytes_and_exactly_what_decode_gives(name, numel):
    """The sender's one-pass encode+decode (the all-reduce uses it for error feedback and its own part)
    is bit for bit what a receiver decodes, signed zeros and all-zero blocks included."""
    codec = get_codec(name)
    x = _gauss(numel, seed=numel) * 0.01
    if numel > 100:
        x[: BLOCK // 2] = 0.0  # an all-zero start (a whole zero block when numel >= BLOCK)
        x[BLOCK // 2 : BLOCK // 2 + 50] = -1e-30  # rounds to a negative zero code
    data, values = codec.encode_roundtrip(x)
    assert data == codec.encode(x)
    decoded = codec.decode(data, numel)
    assert values.dtype == torch.float32 and values.shape == (numel,)
    assert values.numpy().tobytes() == decoded.numpy().tobytes()


@pytest.mark.parametrize("name", [*CODECS, *(f"{c}+zstd" for c in CODECS)])
@pytest.mark.parametrize("numel", [0, 1, 7, BLOCK, 3 * BLOCK + 17])
def test_decode_into_writes_exactly_what_decode_returns(name, numel):
    """The all-reduce decodes averages straight into its output vector: the same bits as decode,
    into a slice of a larger buffer, leaving the rest of that buffer alone."""
    codec = get_codec(name)
    x = _gauss(numel, seed=numel + 1) * 0.01
    if numel > 100:
        x[:BLOCK // 2] = 0.0
        x[BLOCK // 2 : BLOCK // 2 + 50] = -1e-30
    data = codec.encode(x)
    buf = torch.full((numel + 10,), 7.0)
    codec.decode_into(data, buf[5 : 5 + numel])
    assert buf[5 : 5 + numel].numpy().tobytes() == codec.decode(data, numel).numpy().tobytes()
    assert bool((buf[:5] == 7.0).all()) and bool((buf[5 + numel :] == 7.0).all())
    if numel:
        with pytest.raises(ValueError):
            codec.decode_into(data[:-1] if name.startswith(("none", "fp16", "int")) and "+" not in name
                              else b"\x09" + data[1:], buf[:numel])


def test_phases_count_nested_cpu_once():
    """An inner phase's CPU is taken from the outer one, so the phases add up to the time spent."""
    from peer.compression.phases import phase, snapshot

    def spin(seconds: float) -> None:
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    import time

    before, t0 = snapshot(), time.thread_time()
    with phase("encode"):
        spin(0.05)
        with phase("entropy"):
            spin(0.05)
        spin(0.05)
    t1, after = time.thread_time(), snapshot()
    encode, entropy = after["encode"] - before["encode"], after["entropy"] - before["entropy"]
    assert entropy >= 0.05 and encode >= 0.1
    assert abs(encode + entropy - (t1 - t0)) < 0.01  # counted once: the outer phase paused while the inner ran
    assert after["decode"] == before["decode"]


def test_a_phase_that_ticks_is_counted_as_it_runs():
    """``tick`` counts a running phase's CPU so far (a vector encoded while the group forms is seen
    by the snapshot taken when it formed), and the rest once it ends: each second once."""
    import time

    from peer.compression.phases import phase, snapshot, tick

    def spin(seconds: float) -> None:
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    before = snapshot()
    with phase("decode"):
        spin(0.05)
        tick()
        middle = snapshot()
        spin(0.05)
    after = snapshot()
    assert middle["decode"] - before["decode"] >= 0.05
    assert after["decode"] - middle["decode"] >= 0.05
    assert after["decode"] - before["decode"] < 0.1 + 0.01


# -- bad input --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", CODECS)
def test_decode_rejects_wrong_lengths(name):
    codec = get_codec(name)
    data = codec.encode(_gauss(1500))
    with pytest.raises(ValueError, match="expected"):
        codec.decode(data[:-1], 1500)
    with pytest.raises(ValueError, match="expected"):
        codec.decode(data + b"\0", 1500)
    with pytest.raises(ValueError, match="expected"):
        codec.decode(data, 1501)


def test_decode_rejects_malformed_contents():
    nan_scale = struct.pack("<f", float("nan")) + bytes(4)
    with pytest.raises(ValueError, match="scale"):
        get_codec("int8").decode(nan_scale, 4)
    negative = struct.pack("<f", -1.0) + bytes(4)
    with pytest.raises(ValueError, match="scale"):
        get_codec("int8").decode(negative, 4)
    with pytest.raises(ValueError, match="-128"):
        get_codec("int8").decode(struct.pack("<f", 1.0) + bytes([0x80, 0, 0, 0]), 4)
    with pytest.raises(ValueError, match="nibble"):
        get_codec("int4").decode(struct.pack("<f", 1.0) + bytes([0x88, 0x08]), 4)
    with pytest.raises(ValueError, match="padding"):
        get_codec("int4").decode(struct.pack("<f", 1.0) + bytes([0x88, 0x98]), 3)
    # a finite scale so large that code 127 times it overflows: decoders return finite values only
    huge = struct.pack("<f", 3.0e38) + bytes([127, 0, 0, 0])
    with pytest.raises(ValueError, match="exceeds"):
        get_codec("int8").decode(huge, 4)
    with pytest.raises(ValueError, match="NaN"):
        get_codec("fp16").decode(bytes.fromhex("007c0000"), 2)  # +inf
    with pytest.raises(ValueError, match="NaN"):
        get_codec("none").decode(struct.pack("<f", float("nan")), 1)


@pytest.mark.parametrize("name", CODECS)
def test_encode_refuses_non_finite_and_non_flat(name):
    codec = get_codec(name)
    for bad in (float("nan"), float("inf")):
        x = _gauss(10)
        x[3] = bad
        with pytest.raises(ValueError, match="NaN or Inf"):
            codec.encode(x)
    with pytest.raises(ValueError, match="1-D"):
        codec.encode(torch.zeros(2, 2))


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_blockwise_codecs_encode_near_the_fp32_limit_only_to_finite_values(name):
    codec = get_codec(name)
    near = torch.full((BLOCK + 5,), 1.0e36).index_fill_(0, torch.tensor([7]), -1.0e36)  # (BLOCK + 5,)
    assert torch.isfinite(codec.roundtrip(near)).all()
    top = torch.full((10,), torch.finfo(torch.float32).max)
    try:
        decoded = codec.roundtrip(top)
    except ValueError as e:  # int8: fp32 max over 127, times 127, rounds past fp32 max
        assert "cannot be encoded" in str(e)
    else:
        assert torch.isfinite(decoded).all()


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_blocks_of_subnormal_values_get_codes_within_range(name):
    """A block whose absmax over qmax is subnormal has a scale too coarse for x / scale to stay
    within qmax + 1/2 (the encoder clamps only such blocks): codes stay in range, so the bytes decode
    and keep each value's sign, and normal blocks beside them are unaffected."""
    codec = get_codec(name)
    qmax = 127 if name == "int8" else 7
    tiny = 2.0 ** -149  # the smallest subnormal
    # absmax = (1.5 qmax - 0.5) tiny: absmax / qmax rounds down to one tiny, so x / scale is ~1.5 qmax
    sub = torch.full((BLOCK,), (1.5 * qmax - 0.5) * tiny).index_fill_(0, torch.tensor([3]), -(1.5 * qmax - 0.5) * tiny)
    normal = _gauss(BLOCK, seed=3)
    data, decoded = codec.encode_roundtrip(torch.cat([sub, normal]))
    assert torch.equal(codec.decode(data, 2 * BLOCK), decoded)  # decodes: no code outside [-qmax, qmax]
    assert decoded[3] < 0 < decoded[0] and decoded[0] == qmax * tiny
    assert torch.equal(decoded[BLOCK:], codec.roundtrip(normal))

def test_fp16_refuses_values_beyond_its_range():
    with pytest.raises(ValueError, match="65504"):
        get_codec("fp16").encode(torch.tensor([1e6]))


def test_unknown_codec_name():
    with pytest.raises(ValueError, match="int8"):
        get_codec("int3")


# -- flatten / unflatten ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", [*CODECS, *(f"{c}+zstd" for c in CODECS)])
@pytest.mark.parametrize("numel", [0, 1, 7, BLOCK, 3 * BLOCK + 17])
def test_encode_roundtrip_into_writes_what_encode_roundtrip_returns(name, numel):
    """The all-reduce encodes its parts with their decoded values written straight into the round's
    vector: the same bytes and bits as encode_roundtrip, into a slice of a larger buffer whose stale
    contents (last round's) play no part, leaving the rest of it alone."""
    codec = get_codec(name)
    x = _gauss(numel, seed=numel + 2) * 0.01
    if numel > 100:
        x[:BLOCK // 2] = 0.0
        x[BLOCK // 2 : BLOCK // 2 + 50] = -1e-30
    data, values = codec.encode_roundtrip(x)
    buf = torch.full((numel + 10,), 7.0)
    buf[5 : 5 + numel] = float("nan")
    assert codec.encode_roundtrip_into(x, buf[5 : 5 + numel]) == data
    assert buf[5 : 5 + numel].numpy().tobytes() == values.numpy().tobytes()
    assert bool((buf[:5] == 7.0).all()) and bool((buf[5 + numel :] == 7.0).all())
    if name.startswith("int") and numel:
        with pytest.raises(ValueError, match="out must be"):
            codec.encode_roundtrip_into(x, buf[: numel + 1])
    # a reducer's own part: the same values without the bytes
    buf[5 : 5 + numel] = float("nan")
    codec.roundtrip_into(x, buf[5 : 5 + numel])
    assert buf[5 : 5 + numel].numpy().tobytes() == values.numpy().tobytes()
    assert codec.roundtrip(x).numpy().tobytes() == values.numpy().tobytes()
    assert bool((buf[:5] == 7.0).all()) and bool((buf[5 + numel :] == 7.0).all())


def test_flat_buffers_reuse_a_given_back_vector_per_size():
    """Round-sized vectors are reused across rounds (no fresh pages to fault in), one owner at a time."""
    pool = FlatBuffers(keep=1)
    a = pool.take(100)
    assert a.shape == (100,) and a.dtype == torch.float32
    b = pool.take(100)  # a is still taken: a different vector
    assert b.data_ptr() != a.data_ptr()
    pool.give(a)
    pool.give(b)  # beyond keep: dropped
    assert pool.take(100).data_ptr() == a.data_ptr()
    assert pool.take(100).data_ptr() not in (a.data_ptr(), b.data_ptr())
    assert pool.take(50).shape == (50,)
    like = [torch.randn(3, 4, dtype=torch.float64), torch.randn(5)]
    out = pool.take(17)
    assert flatten(like, out=out).data_ptr() == out.data_ptr()
    assert torch.equal(out, flatten(like))


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_keep_freed_memory_pins_glibc_thresholds_once():
    assert keep_freed_memory() is True
    assert keep_freed_memory() is True  # idempotent: set once per process


def test_flatten_unflatten_roundtrip_any_dtype():
    like = [torch.randn(3, 4, dtype=torch.float64), torch.randn(5).to(torch.bfloat16), torch.randn(2, 1, 2)]
    flat = flatten(like)
    assert flat.dtype == torch.float32 and flat.shape == (12 + 5 + 4,)
    back = unflatten(flat, like)
    assert [b.shape for b in back] == [t.shape for t in like]
    for b, t in zip(back, like):
        assert torch.equal(b, t.to(torch.float32))
    with pytest.raises(ValueError, match="unflatten"):
        unflatten(flat[:-1], like)


# -- error feedback ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["int4", "int8"])
def test_error_feedback_makes_sent_sum_track_true_sum(name):
    """sum(sent) - sum(true) equals the residual: one round's error at most, never accumulating."""
    codec = get_codec(name)
    g = torch.Generator().manual_seed(7)
    n, rounds = 3000, 60
    bias = torch.full((n,), 0.03)  # a small, consistent component a quantiser keeps rounding away
    ef = ErrorFeedback(n)
    true_sum, sent_sum, plain_sum = torch.zeros(n), torch.zeros(n), torch.zeros(n)
    worst_drift = 0.0
    for _ in range(rounds):
        delta = bias + torch.randn(n, generator=g)
        x = ef.add(delta)
        sent = codec.roundtrip(x)
        ef.update(x, sent)
        true_sum += delta
        sent_sum += sent
        plain_sum += codec.roundtrip(delta)
        worst_drift = max(worst_drift, float((sent_sum - true_sum).abs().max()))
    one_step = 5.0 / {"int4": 7, "int8": 127}[name]  # |x| stays below ~5: half a step is < this
    assert worst_drift < one_step
    assert torch.allclose(sent_sum - true_sum, -ef.residual, atol=1e-3)
    plain_err = float((plain_sum - true_sum).norm())
    tracked_err = float((sent_sum - true_sum).norm())
    assert tracked_err < plain_err / 2


def test_error_feedback_state_roundtrip_and_shape_checks():
    ef = ErrorFeedback(4)
    ef.update(torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([1.0, 2.5, 3.0, 3.0]))
    assert torch.equal(ef.residual, torch.tensor([0.0, -0.5, 0.0, 1.0]))
    other = ErrorFeedback(4)
    other.load_state_dict(ef.state_dict())
    assert torch.equal(other.add(torch.ones(4)), torch.tensor([1.0, 0.5, 1.0, 2.0]))
    with pytest.raises(ValueError):
        other.add(torch.ones(5))
    with pytest.raises(ValueError):
        ErrorFeedback(3).load_state_dict(ef.state_dict())


# -- the lossless entropy stage (OuterConfig.entropy = "zstd") --------------------------------------


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("numel", [0, 1, 7, BLOCK, 3 * BLOCK + 17])
def test_entropy_stage_is_lossless_and_bounded(name, numel):
    inner, coded = get_codec(name), get_codec(f"{name}+zstd")
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 0.02  # (numel,)
    data, decoded = coded.encode_roundtrip(x)
    assert torch.equal(decoded, inner.roundtrip(x))
    assert torch.equal(coded.decode(data, numel), inner.roundtrip(x))
    assert torch.equal(coded.roundtrip(x), inner.roundtrip(x))
    assert coded.size_ok(len(data), numel) and len(data) <= coded.encoded_size(numel) == inner.encoded_size(numel) + 1
    assert not coded.size_ok(coded.encoded_size(numel) + 1, numel) and not coded.size_ok(0, numel)


@pytest.mark.parametrize("name, most", [("int8", 0.95), ("int4", 0.95), ("fp16", 0.97)])
def test_entropy_stage_shrinks_quantised_gaussian_deltas(name, most):
    """Blockwise absmax codes of a Gaussian are far from uniform: zstd's Huffman stage shrinks them
    (int8: ~0.92 of the codec's bytes); the shrink is asserted, its size is in bench.codecs."""
    x = torch.randn(1 << 18, generator=torch.Generator().manual_seed(0))  # (n,)
    raw = get_codec(name).encode(x)
    packed = get_codec(f"{name}+zstd").encode(x)
    assert packed[0] == 1 and len(packed) <= most * len(raw)


def test_entropy_stage_sends_incompressible_bytes_raw():
    x = torch.randn(3, generator=torch.Generator().manual_seed(1))  # 12 bytes: a zstd frame is larger
    packed = get_codec("none+zstd").encode(x)
    assert packed[0] == 0 and packed[1:] == get_codec("none").encode(x)


def test_entropy_stage_skips_zstd_where_a_sample_shows_it_would_not_pay():
    """A large encoding whose first bytes zstd cannot shrink goes raw (its CPU would buy no link
    time); one whose sample shrinks is compressed whole, and both decode to the inner codec's values."""
    from peer.compression.entropy import EntropyCoded

    coder = get_codec("none+zstd")
    n = 3 * EntropyCoded.SAMPLE // 4  # fp32 values: 3 samples' worth of bytes
    noise = torch.from_numpy(np.random.default_rng(3).integers(0, 2**32, n, dtype=np.uint32).view(np.float32).copy())
    noise[~torch.isfinite(noise)] = 1.0
    packed = coder.encode(noise)
    assert packed[0] == EntropyCoded.RAW and packed[1:] == get_codec("none").encode(noise)
    smooth = torch.zeros(n)
    smooth[EntropyCoded.SAMPLE // 4 :] = noise[EntropyCoded.SAMPLE // 4 :]  # a compressible sample, noise after
    packed = coder.encode(smooth)
    assert packed[0] == EntropyCoded.ZSTD and len(packed) < len(get_codec("none").encode(smooth))
    for x, data in ((noise, coder.encode(noise)), (smooth, packed)):
        assert coder.decode(data, n).numpy().tobytes() == x.numpy().tobytes()


def test_entropy_stage_rejects_malformed_bytes_without_inflating_them():
    import zstandard

    coded, n = get_codec("int8+zstd"), 4 * BLOCK
    good = coded.encode(torch.randn(n, generator=torch.Generator().manual_seed(2)))
    raw_size = get_codec("int8").encoded_size(n)
    bomb = b"\x01" + zstandard.ZstdCompressor(level=1).compress(bytes(100 * raw_size))  # declares 100x the size
    short = b"\x01" + zstandard.ZstdCompressor(level=1).compress(bytes(raw_size - 1))
    cases = {
        "unknown entropy tag 7": b"\x07" + good[1:],
        "corrupt zstd frame": good[:1] + good[1:9] + bytes(len(good) - 9),
        f"holds {100 * raw_size} bytes, expected {raw_size}": bomb,
        f"holds {raw_size - 1} bytes, expected {raw_size}": short,
        "cannot encode": b"",
        "do not encode": b"\x00" + bytes(10),  # raw, of the wrong length: the inner codec says so
    }
    for why, data in cases.items():
        with pytest.raises(ValueError, match=why):
            coded.decode(data, n)


def test_entropy_codec_names():
    assert get_codec("int4+zstd").name == "int4+zstd"
    with pytest.raises(ValueError, match=r"optionally followed by \+zstd"):
        get_codec("int8+lz4")


@pytest.mark.parametrize("name", [*CODECS, *(f"{c}+zstd" for c in CODECS), "topk16b2"])
def test_a_reducer_writes_the_average_every_member_decodes_as_it_encodes_it(name):
    """The reducer keeps its own copy of a part's average from encoding it (no decode of its own
    bytes): the same bytes as ``encode_aggregate`` without ``out``, and bit for bit what every
    member's ``decode_average_into`` makes of them, gathered (sparse) or not."""
    from peer.averaging.aggregation import aggregate, encode_aggregate

    codec = get_codec(name)
    n = 3 * BLOCK + 17
    contributions = {f"p{i}": (codec.roundtrip(_gauss(n, seed=40 + i) * 0.01), float(2 + i)) for i in range(3)}
    reduced = aggregate(contributions)
    out = torch.full((n,), float("nan"))
    data = encode_aggregate(codec, reduced, contributions, out=out)
    assert data == encode_aggregate(codec, reduced, contributions)
    member = torch.empty(n)
    codec.decode_average_into(data, member)
    assert out.numpy().tobytes() == member.numpy().tobytes()


@pytest.mark.parametrize("name", [*CODECS, *(f"{c}+zstd" for c in CODECS)])
@pytest.mark.parametrize("numel", [1, BLOCK, 600 * BLOCK + 17])
def test_a_vector_encoded_ahead_gives_each_part_the_bytes_of_the_part_alone(name, numel):
    """``Codec.prepare``: the vector encoded whole in a thread (as the group forms) gives every
    block-aligned part the bytes the codec makes of that part alone, and writes the values a receiver
    decodes; a part asked for before the encoding reached it waits for it (the reader starts first)."""
    import threading

    codec = get_codec(name)
    x = _gauss(numel, seed=3) * 0.01
    prepared = codec.prepare(numel)
    cuts = sorted({0, numel, *(min(numel, k * BLOCK) for k in (1, 7, 300, 599))})
    parts = list(zip(cuts, cuts[1:]))
    got: dict = {}
    readers = [threading.Thread(target=lambda a=a, b=b: got.__setitem__((a, b), prepared.part(a, b))) for a, b in parts]
    for t in readers:
        t.start()
    out = torch.empty(numel)
    prepared.fill(x, out)
    for t in readers:
        t.join()
    assert torch.equal(out, codec.roundtrip(x))
    for a, b in parts:
        assert got[(a, b)] == codec.encode(x[a:b]), (a, b)
        assert torch.equal(codec.decode(got[(a, b)], b - a), out[a:b])


def test_a_vector_encoded_ahead_refuses_unaligned_parts_and_passes_on_an_encoding_error():
    codec = get_codec("fp16")
    prepared = codec.prepare(3 * BLOCK)
    with pytest.raises(ValueError, match="block-aligned"):
        prepared.part(1, BLOCK)
    with pytest.raises(ValueError, match="block-aligned"):
        prepared.part(0, 3 * BLOCK + 1)
    too_big = torch.full((3 * BLOCK,), 1e6)  # beyond half precision
    with pytest.raises(ValueError, match="half-precision"):
        prepared.fill(too_big, torch.empty(3 * BLOCK))
    with pytest.raises(ValueError, match="could not be encoded"):  # a reader waiting on it is not left hanging
        prepared.part(0, BLOCK)
    with pytest.raises(ValueError, match="prepared for"):
        get_codec("int8").prepare(BLOCK).fill(torch.zeros(2 * BLOCK), torch.empty(2 * BLOCK))


def test_the_sparse_codec_encodes_nothing_ahead():
    assert get_codec("topk16b2").prepare(4 * BLOCK) is None  # its parts choose their own values
