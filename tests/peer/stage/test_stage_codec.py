"""The activation codecs of stage mode (``int4tok+zstd``, ``int4tok-sr+zstd``, ``int5tok+zstd``): error
bounds, size, determinism or unbiasedness, malformed input; codec schemes and the trainer following one."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
import zstandard

from models.lattice import ModularLM
from models.presets import demo
from peer.stage import DEFAULT_ACTIVATION_CODEC, WireError, activation_codec, decode_tensor, encode_tensor
from peer.compression.activation import (TOKEN_INT4, TOKEN_INT4_SR, TOKEN_INT5, TokenInt4Codec, TokenIntCodec,
                                         stochastic_round)
from peer.stage.wire import CodecScheme, codec_scheme
from protos.hivepath.peer.v1.stage_pb2 import EncodedTensor

CODEC = activation_codec(TOKEN_INT4)


def _tokens(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Gaussian values whose tokens' magnitudes span six orders (as gradients' do)."""
    gen = torch.Generator().manual_seed(seed)
    magnitude = 10.0 ** torch.empty(shape[:-1] + (1,)).uniform_(-6, 0, generator=gen)  # (..., 1)
    return torch.randn(shape, generator=gen) * magnitude


def _wire(x: torch.Tensor) -> EncodedTensor:
    """``x`` encoded, as the other side parses it."""
    return EncodedTensor.FromString(encode_tensor(x, CODEC).SerializeToString())


def _demo_activations_and_gradients() -> list[torch.Tensor]:
    """What crosses the links of a demo path (untrained) on one batch: each level's input and output
    (B, T, C), and their gradients."""
    cfg = demo()
    path = (0, 0)
    pm = ModularLM(cfg.lattice, seed=0, module_ids=cfg.lattice.path_modules(path)).path_model(path)
    idx = torch.randint(0, cfg.lattice.vocab_size, (8, cfg.lattice.seq_len + 1),
                        generator=torch.Generator().manual_seed(0))  # (B, T+1)
    h = pm.embed(idx[:, :-1])  # (B, T, C)
    hs = [h]
    for module in pm.stack:
        h = module(h)  # (B, T, C)
        hs.append(h)
    for t in hs:
        t.retain_grad()
    logits = pm.head(h, pm.embed.tok.weight)  # (B, T, V)
    torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1)).backward()
    return [t.detach() for t in hs] + [t.grad for t in hs]


def test_decode_tensor_accepts_it_beside_the_value_codecs():
    x = _tokens((2, 3, 8))
    for name in (TOKEN_INT4, TOKEN_INT4_SR, TOKEN_INT5, "int8", "fp16", "none"):
        y = decode_tensor(EncodedTensor.FromString(encode_tensor(x, activation_codec(name)).SerializeToString()),
                          "x", 1000, last_dim=8)
        assert y.shape == x.shape and y.dtype == torch.float32
    with pytest.raises(WireError, match=re.escape(f"is not one of {TOKEN_INT4}, {TOKEN_INT4_SR}, {TOKEN_INT5}, int6tok+zstd, none")):
        activation_codec("int4tok")


@pytest.mark.parametrize("shape", [(2, 5, 8), (3, 4, 7), (1, 1, 1), (4, 96, 96)])
def test_round_trip_error_is_at_most_half_a_step_of_each_token(shape):
    x = _tokens(shape)
    y = decode_tensor(_wire(x), "x", 10**6, shape=list(shape))
    absmax = x.abs().amax(dim=-1, keepdim=True)  # (..., 1)
    # half a step of 4-bit codes (absmax / 14), the step's bf16 rounding (2^-8) on top
    assert bool(((y - x).abs() <= absmax / 14 * (1 + 2**-8)).all())
    assert float((y - x).norm() / x.norm()) < 0.13  # about 0.11 on Gaussian tokens


def test_zero_and_extreme_tokens_decode_finite():
    x = torch.tensor([[[0.0, -0.0, 0.0], [3.4e38, -3.4e38, 1.0], [1e-30, -2e-30, 0.0]]])  # (1, 3, 3)
    y = decode_tensor(_wire(x), "x", 100)
    assert bool(torch.isfinite(y).all()) and bool((y[0, 0] == 0).all())
    assert float(y[0, 1, 0]) > 3.3e38 and float(y[0, 1, 1]) < -3.3e38
    assert torch.allclose(y[0, 2], x[0, 2], rtol=0, atol=2e-30 / 14 * 1.01)


def test_bytes_are_at_most_an_eighth_of_fp32_on_demo_activations_and_gradients():
    tensors = _demo_activations_and_gradients()
    sizes = [len(encode_tensor(t, CODEC).data) for t in tensors]
    for t, size in zip(tensors, sizes):
        assert size <= 0.125 * 4 * t.numel(), f"{tuple(t.shape)}: {size / (4 * t.numel()):.4f} of fp32"
    assert sum(sizes) <= 0.115 * 4 * sum(t.numel() for t in tensors)  # about 0.10


def test_bytes_are_under_an_eighth_on_gaussian_tokens_and_bounded_on_noise():
    x = _tokens((16, 96, 96))
    assert len(encode_tensor(x, CODEC).data) <= 0.125 * 4 * x.numel()
    # codes that zstd cannot shrink go raw: the layout behind its tag, 4 + 16/96 bits a value
    noise = torch.empty(16, 96, 96).uniform_(-1, 1, generator=torch.Generator().manual_seed(0))
    noise[..., 0] = 1.0
    assert len(encode_tensor(noise, CODEC).data) <= CODEC.max_size(noise.shape) == 1 + 16 * 96 * (2 + 48)


def test_encoding_is_deterministic_and_reencoding_what_was_decoded_changes_nothing():
    x = _tokens((4, 9, 33), seed=3)
    first = encode_tensor(x, CODEC).data
    assert encode_tensor(x.clone(), TokenInt4Codec()).data == first  # another instance, same bytes
    relayed = decode_tensor(EncodedTensor(shape=[4, 9, 33], codec=TOKEN_INT4, data=first), "x", 10**4)
    assert encode_tensor(relayed, CODEC).data == first  # the trainer relays a level's output losslessly


def test_stochastic_rounding_is_unbiased_within_a_step_and_relays_losslessly():
    """``int4tok-sr+zstd``: each value within one step of its token, the mean of many encodings far
    closer to the values than one rounding to nearest; the same layout (the plain codec decodes it);
    a decoded tensor re-encodes to the same bytes."""
    sr = activation_codec(TOKEN_INT4_SR)
    assert sr.name == TOKEN_INT4_SR and isinstance(sr, TokenIntCodec) and sr.stochastic
    x = _tokens((2, 8, 96), seed=4)
    step = x.abs().amax(dim=-1, keepdim=True) / 7  # (2, 8, 1)
    draws = torch.stack([sr.decode(sr.encode(x), x.shape) for _ in range(400)])  # (400, 2, 8, 96)
    assert bool(((draws - x).abs() <= step * 1.01).all())
    nearest = CODEC.decode(CODEC.encode(x), x.shape)
    assert (draws.mean(0) - x).abs().mean() < 0.25 * (nearest - x).abs().mean()
    data = sr.encode(x)
    assert torch.equal(CODEC.decode(data, x.shape), sr.decode(data, x.shape))
    relayed = sr.decode(data, x.shape)
    assert sr.encode(relayed) == CODEC.encode(relayed)


def test_a_stochastically_rounded_tensor_relays_losslessly_whatever_the_draws():
    """Rows whose ``absmax / 7`` rounds up to bf16 by about 2^-9 of it: rounded to nearest, such a
    scale left the absmax just below code 7, a draw took it down to 6 about once in 150 encodings, and
    the decoded row re-encoded to other bytes (the test above failed now and then). 64 such rows, 50
    encodings each, each row's absmax its only value near the top: every decoded tensor's rows have
    absmax ``7 * scale`` and re-encode to the same bytes."""
    sr = activation_codec(TOKEN_INT4_SR)
    gen = torch.Generator().manual_seed(7)
    ratios = (torch.full((64, 1), 0x3F80C000, dtype=torch.int32) + torch.arange(64, dtype=torch.int32)[:, None] * 0x10000)
    absmax = ratios.view(torch.float32) * 7  # each absmax / 7 three quarters of the way to the next bf16
    x = (torch.rand((64, 96), generator=gen) - 0.5) * absmax  # below half the absmax: codes -4..4
    x[:, 5] = absmax[:, 0] * torch.where(torch.arange(64) % 2 == 0, 1.0, -1.0)  # the one value that codes to 7
    assert bool(((absmax / 7).to(torch.bfloat16).float() > absmax / 7).all())  # nearest rounds every scale up
    for _ in range(50):
        relayed = sr.decode(sr.encode(x), x.shape)
        scale = relayed.abs().amax(dim=1) / 7
        assert torch.equal(scale, scale.to(torch.bfloat16).float())
        assert sr.encode(relayed) == CODEC.encode(relayed)


def test_stochastic_rounding_keeps_grid_values_whatever_the_draw():
    """An integer code stays put even for a draw just below 1 (k + u would round to k + 1 in fp32: a
    relayed tensor re-encoded to other bytes), and a fraction goes up exactly when the draw is below it."""
    q = torch.tensor([3.0, 5.0, -2.0, 0.0, 7.0, 2.25, -1.5])
    top = torch.full_like(q, 1 - 2 ** -24)  # the largest float32 below 1
    assert torch.equal(stochastic_round(q.clone(), top), torch.tensor([3.0, 5.0, -2.0, 0.0, 7.0, 2.0, -2.0]))
    assert torch.equal(stochastic_round(q.clone(), torch.zeros_like(q)), torch.tensor([3.0, 5.0, -2.0, 0.0, 7.0, 3.0, -1.0]))
    # fractions 0.25 and 0.5: a draw of 0.3 keeps the first down and takes the second up
    assert torch.equal(stochastic_round(q.clone(), torch.full_like(q, 0.3)), torch.tensor([3.0, 5.0, -2.0, 0.0, 7.0, 2.0, -1.0]))


def _raw_layout(rows: int, width: int, scale_bits: int = 0x3F80, nibble: int = 8) -> bytes:
    """A layout sent raw: ``rows`` scales (bf16 bits, 1.0 by default), every code nibble ``nibble``."""
    codes = bytes([nibble | nibble << 4]) * ((width + 1) // 2)
    return bytes((TokenInt4Codec.RAW,)) + scale_bits.to_bytes(2, "little") * rows + codes * rows


def test_every_malformed_payload_is_a_wire_error_naming_it():
    good = _wire(_tokens((2, 4, 8)))
    frame_of = lambda raw, **kw: bytes((TokenInt4Codec.ZSTD,)) + zstandard.ZstdCompressor(**kw).compress(raw)  # noqa: E731
    layout = 64 * (2 + 48)  # (1, 64, 96): the raw layout's bytes
    cases = {
        "bytes cannot encode this shape": good.data[:0],
        "a raw payload of": _raw_layout(8, 8)[:-3],  # truncated
        "unknown tag 7": bytes((7,)) + good.data[1:],
        "corrupt zstd frame": bytes((TokenInt4Codec.ZSTD,)) + np.random.default_rng(0).bytes(40),  # garbage
        "a code is outside [-7, 7]": _raw_layout(8, 8, nibble=0),
        "scale is negative, NaN or Inf": _raw_layout(8, 8, scale_bits=0xBF80),  # -1.0
    }
    for needle, data in cases.items():
        with pytest.raises(WireError, match=re.escape(needle)):
            decode_tensor(EncodedTensor(shape=[2, 4, 8], codec=TOKEN_INT4, data=data), "x", 1000)
    with pytest.raises(WireError, match="scale is negative, NaN or Inf"):
        decode_tensor(EncodedTensor(shape=[1, 1, 8], codec=TOKEN_INT4, data=_raw_layout(1, 8, 0x7FC0)), "x", 10)  # NaN
    with pytest.raises(WireError, match="scale exceeds"):
        decode_tensor(EncodedTensor(shape=[1, 1, 8], codec=TOKEN_INT4, data=_raw_layout(1, 8, 0x7F7F)), "x", 10)
    odd = bytearray(_raw_layout(1, 7))
    odd[-1] = 0x18  # the padding nibble of a 7-wide row holds code -7
    with pytest.raises(WireError, match="padding nibble"):
        decode_tensor(EncodedTensor(shape=[1, 1, 7], codec=TOKEN_INT4, data=bytes(odd)), "x", 10)
    bombs = {
        "declares 10000000 bytes, expected 3200": frame_of(b"\0" * 10_000_000),  # small on the wire
        "declares -1 bytes": frame_of(_raw_layout(64, 96)[1:], write_content_size=False),
        "unused data": frame_of(_raw_layout(64, 96)[1:]) + b"\0",
    }
    for needle, data in bombs.items():
        assert len(data) <= 1 + layout
        with pytest.raises(WireError, match=re.escape(needle)):
            decode_tensor(EncodedTensor(shape=[1, 64, 96], codec=TOKEN_INT4, data=data), "x", 10**4)


def test_decode_tensor_keeps_its_checks_for_the_codec():
    good = _wire(_tokens((2, 4, 8)))
    cases = {
        "shape (batch, tokens, width)": EncodedTensor(shape=[64], codec=TOKEN_INT4, data=good.data),
        "empty dimension": EncodedTensor(shape=[2, 0, 8], codec=TOKEN_INT4, data=good.data),
        "width 16 differs": EncodedTensor(shape=[1, 4, 16], codec=TOKEN_INT4, data=good.data),
        "more than this server accepts": EncodedTensor(shape=[200, 4, 8], codec=TOKEN_INT4, data=good.data),
        "malformed": EncodedTensor(shape=[4, 4, 8], codec=TOKEN_INT4, data=good.data),  # another shape's bytes
    }
    for needle, msg in cases.items():
        with pytest.raises(WireError, match=re.escape(needle)):
            decode_tensor(msg, "x", 1000, last_dim=8)
    with pytest.raises(WireError, match="differs from the expected"):
        decode_tensor(good, "grad", 1000, shape=[2, 4, 9])
    for bad in (float("nan"), float("inf")):
        with pytest.raises(WireError, match="NaN or Inf"):
            encode_tensor(torch.tensor([[[1.0, bad]]]), CODEC)


@pytest.mark.parametrize("bits", [5, 6])
def test_finer_per_token_codes_round_trip_within_half_a_step_and_relay_losslessly(bits):
    codec = activation_codec(f"int{bits}tok+zstd")
    qmax = 2 ** (bits - 1) - 1
    for shape in [(2, 5, 8), (3, 4, 7), (4, 96, 96)]:
        x = _tokens(shape, seed=bits)
        msg = EncodedTensor.FromString(encode_tensor(x, codec).SerializeToString())
        y = decode_tensor(msg, "x", 10**6, shape=list(shape))
        absmax = x.abs().amax(dim=-1, keepdim=True)  # (..., 1)
        assert bool(((y - x).abs() <= absmax / (2 * qmax) * (1 + 2**-8)).all())
        assert encode_tensor(y, codec).data == msg.data
    bad = bytes((TokenIntCodec.RAW,)) + (0x3F80).to_bytes(2, "little") + bytes([2 * qmax + 2]) * 8
    with pytest.raises(WireError, match=re.escape(f"a code is outside [-{qmax}, {qmax}]")):
        decode_tensor(EncodedTensor(shape=[1, 1, 8], codec=codec.name, data=bad), "x", 10)


def test_five_bit_codes_cost_under_a_sixth_of_fp32_on_demo_activations():
    tensors = _demo_activations_and_gradients()
    codec = activation_codec(TOKEN_INT5)
    sizes = [len(encode_tensor(t, codec).data) for t in tensors]
    assert sum(sizes) <= 0.17 * 4 * sum(t.numel() for t in tensors)  # about 0.14
    assert len(encode_tensor(tensors[0], codec).data) > len(encode_tensor(tensors[0], CODEC).data)


def test_the_default_scheme_sends_under_an_eighth_of_fp32_with_residual_replies():
    """Peers' default (``bench.stage_codec`` measures its quality): 5-bit codes for level 0's forward,
    4-bit elsewhere, residual replies; on the demo's activations and gradients, under 1/8 of fp32."""
    scheme = codec_scheme(DEFAULT_ACTIVATION_CODEC)
    assert scheme.residual and scheme.forward(0) == TOKEN_INT5 and scheme.forward(1) == scheme.backward(0) == TOKEN_INT4
    tensors = _demo_activations_and_gradients()
    forward0 = activation_codec(scheme.forward(0))
    sizes = [len(encode_tensor(t, forward0 if i == 0 else CODEC).data) for i, t in enumerate(tensors)]
    assert sum(sizes) <= 4 * sum(t.numel() for t in tensors) / 8


def test_a_codec_scheme_names_each_levels_codec_both_ways():
    plain = codec_scheme("int8")
    assert plain == CodecScheme("int8") and [plain.forward(0), plain.backward(1)] == ["int8", "int8"]
    name = f"{TOKEN_INT4}/first={TOKEN_INT5}/first_grad=int8"
    scheme = codec_scheme(name)
    assert str(scheme) == name
    assert [scheme.forward(i) for i in range(3)] == [TOKEN_INT5, TOKEN_INT4, TOKEN_INT4]
    assert [scheme.backward(i) for i in range(3)] == ["int8", TOKEN_INT4, TOKEN_INT4]
    full = codec_scheme(f"{TOKEN_INT4}/grad={TOKEN_INT4_SR}/first={TOKEN_INT5}/residual")
    assert full.residual and not scheme.residual and str(full) == f"{TOKEN_INT4}/grad={TOKEN_INT4_SR}/first={TOKEN_INT5}/residual"
    assert [full.forward(i) for i in range(2)] == [TOKEN_INT5, TOKEN_INT4]
    assert [full.backward(i) for i in range(2)] == [TOKEN_INT4_SR, TOKEN_INT4_SR]
    assert codec_scheme(f"{TOKEN_INT4}/grad=int8/first_grad=fp16").backward(0) == "fp16"
    for bad, needle in [(f"{TOKEN_INT4}/first=int3", "first codec 'int3'"), ("int3/first=int8", "base codec 'int3'"),
                        ("int8/residual/residual", "'residual' is not"), ("int8/grad=int9", "grad codec 'int9'"),
                        (f"{TOKEN_INT4}/last=int8", "'last=int8' is not"), (f"{TOKEN_INT4}/first", "'first' is not"),
                        (f"{TOKEN_INT4}/first=int8/first=fp16", "once each")]:
        with pytest.raises(WireError, match=re.escape(needle)):
            codec_scheme(bad)


class _LocalClient:
    """A :class:`peer.stage.StageClient` stand-in: runs each level here, through the codec each call names."""

    def __init__(self, scheme: str, modules: dict):
        self.scheme = codec_scheme(scheme)
        self.modules = modules
        self.calls: list[tuple[str, str, str]] = []

    def _cross(self, t: torch.Tensor, codec: str) -> torch.Tensor:
        return decode_tensor(encode_tensor(t, activation_codec(codec)), "t", t.numel())

    def forward(self, module_id: str, x: torch.Tensor, codec=None):
        self.calls.append(("forward", module_id, codec))
        xin = self._cross(x, codec).requires_grad_(True)
        y = self.modules[module_id](xin)
        return self._cross(y.detach(), codec), (xin, y)

    def backward(self, hop, grad: torch.Tensor, codec=None) -> torch.Tensor:
        xin, y = hop
        self.calls.append(("backward", None, codec))
        y.backward(self._cross(grad, codec))
        return self._cross(xin.grad, codec)


def test_the_stage_trainer_sends_each_level_in_the_codec_its_scheme_names():
    from models.presets import tiny_cpu
    from peer.node.stage_runner import StageTrainer

    torch.set_num_threads(1)
    cfg = tiny_cpu()
    path = (0,) * cfg.lattice.levels
    ids = cfg.lattice.path_modules(path)[1:-1]
    assert len(ids) >= 2
    lm = ModularLM(cfg.lattice, seed=cfg.seed, module_ids=ids)
    client = _LocalClient(f"{TOKEN_INT4}/first=int8/first_grad={TOKEN_INT5}", {m: lm.mods[m] for m in ids})
    trainer = StageTrainer(cfg, path, client, torch.device("cpu"))
    try:
        x = torch.randint(0, cfg.lattice.vocab_size, (2, cfg.lattice.seq_len))
        loss, _ = trainer.train_step(x, torch.roll(x, -1, dims=1))
    finally:
        trainer.close()
    assert loss == loss and client.calls[0] == ("forward", ids[0], "int8")
    assert [c[2] for c in client.calls] == (["int8"] + [TOKEN_INT4] * (len(ids) - 1) + [TOKEN_INT4] * (len(ids) - 1)
                                            + [TOKEN_INT5])


def test_the_bench_crosses_each_level_as_the_trainer_does():
    from bench.stage_codec import Link

    link = Link(f"{TOKEN_INT4}/first={TOKEN_INT5}")
    x = _tokens((2, 16, 96))
    for level, codec in [(0, TOKEN_INT5), (1, TOKEN_INT4)]:
        before = link.bytes["forward"]
        y = link.cross(x, "forward", level)
        assert link.bytes["forward"] - before == len(encode_tensor(x, activation_codec(codec)).data)
        assert torch.equal(y, activation_codec(codec).decode(encode_tensor(x, activation_codec(codec)).data, x.shape))
    link.cross(x, "backward", 0)
    assert link.bytes["backward"] == len(encode_tensor(x, CODEC).data)
