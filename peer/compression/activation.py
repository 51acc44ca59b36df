"""The codecs of activations and gradients in stage mode, by name (:data:`ACTIVATION_CODECS`).

A trainer and its stage servers exchange activations and their gradients (B, T, C) at every level
boundary, both ways, every micro-batch: in stage mode the link carries these, not the pseudo-gradient.
The pseudo-gradient value codecs of :data:`models.codec_spec.CODECS` serve on the flat vector
(:class:`FlatCodec`): ``int8`` (blockwise per 1024 values, as SWARM, Ryabinin et al. 2023, sends
activations; a quarter of fp32), ``fp16``, ``none``. :class:`TokenIntCodec` takes one absmax scale per
token (the last dimension, as ZeroQuant, Yao et al. 2022, quantises activations), 4 to 6-bit codes
and zstd over them: ``int4tok+zstd`` about a tenth of fp32's bytes, ``int5tok+zstd`` and
``int6tok+zstd`` more, ``int4tok-sr+zstd`` 4 bits with stochastic rounding. Alone, 4 bits everywhere
cost a trained path more bits per byte than a default may; what brings it within bounds is where the
error lands (:class:`peer.stage.wire.CodecScheme`): replies that carry only a module's residual
branches, so that the residual stream the trainer holds is never quantised, and 5 bits for the
embedding's output into level 0, whose position component 4 bits drown. ``bench.stage_codec`` trains a
demo path through each scheme against fp32 activations (its figures: docs/BENCHMARKS.md).

Every codec takes a finite CPU fp32 tensor and returns bytes; decoding takes the bytes and the shape,
and raises :class:`ValueError` naming the problem for bytes that cannot be an encoding of that shape
(:func:`peer.stage.wire.decode_tensor` turns it into a ``WireError``). What decoding returns is always
finite.
"""

from __future__ import annotations

import math
import os
import threading
from typing import Protocol, Sequence

import numpy as np
import torch
import zstandard
from torch import Tensor

from models.codec_spec import CODECS
from peer.compression.base import Codec
from peer.compression.codecs import get_codec
from peer.compression.entropy import ZstdContexts

__all__ = ["ActivationCodec", "FlatCodec", "TokenIntCodec", "TokenInt4Codec", "TOKEN_INT4", "TOKEN_INT4_SR",
           "TOKEN_INT5", "ACTIVATION_CODECS"]

TOKEN_INT4 = "int4tok+zstd"
"""The name of :class:`TokenInt4Codec` on the wire."""


class ActivationCodec(Protocol):
    """Encodes a tensor of activations or gradients to bytes and back."""

    name: str

    def encode(self, t: Tensor) -> bytes:
        """The bytes of ``t``, a finite CPU fp32 tensor of any shape; ValueError if it cannot be encoded."""

    def decode(self, data: bytes, shape: Sequence[int]) -> Tensor:
        """The CPU fp32 tensor of ``shape`` that ``data`` encodes; ValueError on malformed bytes."""


class FlatCodec:
    """A pseudo-gradient value codec (:mod:`peer.compression.quantizers`) applied to the flat vector."""

    def __init__(self, codec: Codec):
        self.codec = codec
        self.name = codec.name

    def encode(self, t: Tensor) -> bytes:
        return self.codec.encode(t.reshape(-1))

    def decode(self, data: bytes, shape: Sequence[int]) -> Tensor:
        return self.codec.decode(data, math.prod(shape)).view(list(shape))

    def __repr__(self) -> str:
        return f"FlatCodec({self.codec!r})"


class TokenIntCodec:
    """Per-token absmax ``bits``-bit codes, zstd-compressed: a small fraction of fp32's bytes (``bench.stage_codec``).

    A tensor is read as rows of its last dimension (a token's C values). Each row gets a scale
    ``absmax / qmax`` (``qmax = 2**(bits - 1) - 1``) rounded to bfloat16 (fp32's range: gradients of a
    mean loss are far below fp16's) and codes ``x / scale`` in [-qmax, qmax], rounded to nearest (then
    encoding is a function of the values) or, with ``stochastic`` (``int4tok-sr+zstd``), up with
    probability the fraction: unbiased, so that the rounding errors of gradients average out over a
    step's micro-batches and steps instead of adding up (``bench.stage_codec``). The decoding is the
    same. A per-token scale follows the tokens' very different magnitudes, of gradients above all.
    The layout, before the entropy stage::

        R little-endian bf16 scales | R rows of codes + qmax + 1: at 4 bits ceil(C / 2) bytes, two
                                      per byte, low nibble first (an odd row padded with code 0);
                                      at 5 to 8 bits C bytes, one per byte

    then one tag byte: :data:`ZSTD` and one zstd frame declaring its content size, or :data:`RAW` and
    the layout as it is where zstd would not shrink it. The codes of real activations are far from
    uniform: zstd's Huffman stage shrinks both layouts well below their raw bits (``bench.stage_codec``).

    Re-encoding what this codec decoded gives the same bytes (each row's absmax is ``qmax * scale``
    exactly, and a value on the grid rounds to itself either way), so a tensor relayed by the trainer
    to the next stage loses nothing more.
    """

    RAW, ZSTD = 0, 1
    LEVEL = 3
    """zstd level: level 3 saves more than level 1 on these codes at about the same speed; higher levels
    cost more time than they save."""

    def __init__(self, bits: int = 4, stochastic: bool = False) -> None:
        if not 4 <= bits <= 8:
            raise ValueError(f"per-token codes of {bits} bits: 4 to 8 are supported")
        self.bits = bits
        self.stochastic = stochastic
        self.name = f"int{bits}tok{'-sr' if stochastic else ''}+zstd"
        self.QMAX = 2 ** (bits - 1) - 1
        self._max_scale = _max_scale(self.QMAX)
        self._zstd = ZstdContexts(self.LEVEL).get  # micro-batches encode in threads
        self._rng = threading.local()

    @staticmethod
    def _rows(shape: Sequence[int]) -> tuple[int, int]:
        """``(rows, width)`` of a tensor of ``shape``: its last dimension is a row."""
        width = int(shape[-1]) if len(shape) else 1
        return (math.prod(shape) // width if width else 0), width

    def _row_bytes(self, width: int) -> int:
        return (width + 1) // 2 if self.bits == 4 else width

    def raw_size(self, rows: int, width: int) -> int:
        """Bytes of the layout of ``rows`` rows of ``width`` values (scales and packed codes)."""
        return rows * (2 + self._row_bytes(width))

    def max_size(self, shape: Sequence[int]) -> int:
        """The most bytes a tensor of ``shape`` encodes to: its layout sent raw, behind the tag."""
        return 1 + self.raw_size(*self._rows(shape))

    def encode(self, t: Tensor) -> bytes:
        rows, width = self._rows(t.shape)
        if rows == 0:
            return bytes((self.RAW,))
        x = t.detach().to(device="cpu", dtype=torch.float32).reshape(rows, width)  # (R, C)
        absmax = x.abs().amax(dim=1, keepdim=True)  # (R, 1)
        if not bool(torch.isfinite(absmax).all()):  # NaN propagates through amax, Inf is a maximum
            raise ValueError(f"{self.name}: cannot encode values holding NaN or Inf")
        ratio = absmax / self.QMAX  # (R, 1)
        if self.stochastic:  # toward zero: see below
            ratio = (ratio.view(torch.int32) & -0x10000).view(torch.float32)  # fp32 bits past bf16's cleared
        scale = torch.minimum(ratio.to(torch.bfloat16), self._max_scale)  # (R, 1)
        s = scale.to(torch.float32)
        q = torch.div(x, torch.where(s > 0, s, torch.ones_like(s)))  # (R, C)
        if self.stochastic:  # up with probability the fraction: unbiased; a value on the grid stays put
            q = stochastic_round(q, torch.rand(q.shape, generator=self._generator()))
        else:
            q = q.round_()
        # bf16 rounding moves a scale by at most 2^-8 of it, so |codes| < qmax + 0.5 round into range;
        # the clamp only acts on subnormal scales and the capped ones. With stochastic rounding the
        # scale is rounded toward zero instead, so a row's absmax codes to qmax or just past it, and the
        # clamp keeps it at qmax whatever the draw: the decoded row's absmax is qmax * scale, as the
        # class says (rounded to nearest, a scale rounded up left the absmax below qmax, a draw could
        # take it down a code, and the decoded tensor re-encoded to other bytes)
        codes = q.clamp_(-self.QMAX, self.QMAX).add_(self.QMAX + 1).to(torch.uint8)  # (R, C) in 1..2 qmax + 1
        if self.bits == 4:
            if width % 2:
                codes = torch.cat([codes, torch.full((rows, 1), 8, dtype=torch.uint8)], dim=1)  # (R, C + 1)
            codes = codes[:, 0::2] | (codes[:, 1::2] << 4)  # (R, ceil(C / 2))
        raw = scale.view(torch.int16).numpy().astype("<i2").tobytes() + codes.numpy().tobytes()
        frame = self._zstd()[0].compress(raw)
        if len(frame) < len(raw):
            return bytes((self.ZSTD,)) + frame
        return bytes((self.RAW,)) + raw

    def _generator(self) -> torch.Generator:
        """This thread's generator of stochastic rounding, seeded from the OS: micro-batches encode in
        threads, and rounding noise shared across peers would correlate their errors."""
        gen = getattr(self._rng, "gen", None)
        if gen is None:
            gen = self._rng.gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)
        return gen

    def _unpack(self, data: bytes, expected: int) -> bytes:
        """The layout inside ``data`` (``expected`` bytes): never inflated past that size."""
        if not 1 <= len(data) <= 1 + expected:
            raise ValueError(f"{self.name}: {len(data)} bytes cannot encode this shape (1 to {1 + expected} expected)")
        tag, body = data[0], memoryview(data)[1:]
        if tag == self.RAW:
            if len(body) != expected:
                raise ValueError(f"{self.name}: a raw payload of {len(body)} bytes, expected {expected}")
            return bytes(body)
        if tag != self.ZSTD:
            raise ValueError(f"{self.name}: unknown tag {tag}")
        try:
            declared = zstandard.frame_content_size(body)
            if declared != expected:  # also a frame that declares no size (-1): no bomb gets inflated
                raise ValueError(f"{self.name}: the zstd frame declares {declared} bytes, expected {expected}")
            raw = self._zstd()[1].decompress(body, max_output_size=expected, allow_extra_data=False)
        except zstandard.ZstdError as e:
            raise ValueError(f"{self.name}: corrupt zstd frame ({e})") from None
        if len(raw) != expected:
            raise ValueError(f"{self.name}: the zstd frame decompressed to {len(raw)} bytes, expected {expected}")
        return raw

    def decode(self, data: bytes, shape: Sequence[int]) -> Tensor:
        rows, width = self._rows(shape)
        raw = np.frombuffer(self._unpack(data, self.raw_size(rows, width)), dtype=np.uint8)
        bits = raw[: 2 * rows].view("<u2").astype(np.uint32) << 16  # (R,) bf16 -> the high half of fp32
        scale = torch.from_numpy(bits.view(np.float32)).view(rows, 1)  # (R, 1)
        if not bool(torch.isfinite(scale).all()) or bool((bits >> 31).any()):
            raise ValueError(f"{self.name}: a token's scale is negative, NaN or Inf")
        if bool((scale > self._max_scale.float()).any()):
            raise ValueError(f"{self.name}: a token's scale exceeds {float(self._max_scale):.4g} (values beyond fp32)")
        packed = torch.from_numpy(raw[2 * rows :].reshape(rows, self._row_bytes(width)).astype(np.int16))
        if self.bits == 4:
            half = (width + 1) // 2
            codes = torch.stack([packed & 0x0F, packed >> 4], dim=2).view(rows, 2 * half)  # low nibble first
            if width % 2 and bool((codes[:, width] != 8).any()):
                raise ValueError(f"{self.name}: the padding nibble of an odd-sized row is not code 0")
            codes = codes[:, :width]  # (R, C)
        else:
            codes = packed  # (R, C)
        if bool((codes == 0).any()) or bool((codes > 2 * self.QMAX + 1).any()):
            raise ValueError(f"{self.name}: a code is outside [-{self.QMAX}, {self.QMAX}]")
        # a code times a bf16 scale needs bits - 1 + 8 significant bits: exact in fp32, the same everywhere
        return (codes - (self.QMAX + 1)).to(torch.float32).mul_(scale).view(list(shape))

    def __repr__(self) -> str:
        return f"TokenIntCodec({self.bits}{', stochastic=True' if self.stochastic else ''})"


class TokenInt4Codec(TokenIntCodec):
    """:class:`TokenIntCodec` of 4 bits (``int4tok+zstd``)."""

    name = TOKEN_INT4
    QMAX = 7

    def __init__(self) -> None:
        super().__init__(4)

    def __repr__(self) -> str:
        return "TokenInt4Codec()"


def stochastic_round(q: Tensor, u: Tensor) -> Tensor:
    """``q`` rounded down, plus one where ``u`` (uniform in [0, 1), same shape) is below its fraction:
    up with probability the fraction, so unbiased, and an integer stays put whatever ``u`` is. (Adding
    ``u`` and flooring would not: in fp32, k + u for u just below 1 rounds to k + 1.)"""
    low = q.floor()
    return low.add_(u.lt(q - low).to(low.dtype))


def _max_scale(qmax: int) -> Tensor:
    """The largest bf16 scale whose code ``qmax`` decodes to a finite fp32 value (a 0-dim bf16 tensor)."""
    bits = torch.tensor(torch.finfo(torch.float32).max / qmax).to(torch.bfloat16).view(torch.int16)
    while not bool(torch.isfinite(bits.view(torch.bfloat16).float() * qmax)):
        bits = bits - 1  # the next smaller positive bf16
    return bits.view(torch.bfloat16)


TOKEN_INT5 = "int5tok+zstd"
"""The name of the 5-bit :class:`TokenIntCodec` on the wire."""


TOKEN_INT4_SR = "int4tok-sr+zstd"
"""The name of the 4-bit :class:`TokenIntCodec` with stochastic rounding on the wire."""


ACTIVATION_CODECS: dict[str, ActivationCodec] = {
    TOKEN_INT4: TokenInt4Codec(), TOKEN_INT4_SR: TokenIntCodec(4, stochastic=True), TOKEN_INT5: TokenIntCodec(5),
    "int6tok+zstd": TokenIntCodec(6),
    **{name: FlatCodec(get_codec(name)) for name in CODECS}}
"""Every codec of activations and gradients by name."""

