"""The four value codecs of the pseudo-gradient: fp32, fp16 and the blockwise absmax quantisers.

Their byte layouts and sizes are specified in :mod:`models.codec_spec` (names, :data:`BLOCK`, the
table of formats); each codec here carries its :class:`~models.codec_spec.CodecSpec` and takes its
sizes from it. Blockwise codecs quantise consecutive blocks of :data:`BLOCK` elements starting at
element 0 of the vector they are given, and lay each block out as ``scale | codes``. Hence encoding a
vector whole, or in parts whose boundaries are multiples of :data:`BLOCK`, gives the same bytes
(concatenated) and the same decoded values: the all-reduce may split a module's delta at any
multiple of ``BLOCK``.

Decoding is pure IEEE arithmetic on the CPU (an integer code times an fp32 scale, or an exact
widening), so the same bytes decode to bit-identical tensors on every machine. Decoders validate the
byte length, the scales and the codes, and raise :class:`ValueError` on malformed input; what they
return is always finite (a scale whose codes could overflow fp32 is malformed), so a receiver needs no
second pass over the values.
"""

from __future__ import annotations

import abc
import sys
from typing import Callable, Optional

import numpy as np
import torch
from torch import Tensor

from models.codec_spec import BLOCK, SCALE_BYTES, SPECS, CodecSpec
from peer.compression.base import Codec, check_flat, max_scale
from peer.compression.prepared import Prepared

__all__ = ["NoneCodec", "Fp16Codec", "Int8Codec", "Int4Codec", "VALUE_CODECS"]


_MAX_SCALE = {s.qmax: max_scale(s.qmax) for s in SPECS.values() if s.blockwise}
"""Per qmax, the largest block scale: decoded values are always finite (larger scales are refused)."""


class _SpecCodec(Codec):
    """A codec with a fixed layout: its name and sizes come from its :class:`CodecSpec`."""

    spec: CodecSpec

    @property
    def name(self) -> str:  # type: ignore[override]  # read-only here, from the spec
        return self.spec.name

    def encoded_size(self, numel: int) -> int:
        return self.spec.encoded_size(numel)

    def prepare(self, numel: int) -> "Prepared":
        return Prepared(self, numel)

    def _prepare_into(self, flat: Tensor, out: Tensor, raw: np.ndarray, advance: Callable[[int], None]) -> None:
        """Write the encoding of ``flat`` into ``raw`` (uint8, ``encoded_size(numel)``) and its decoded
        values into ``out``, calling ``advance(n)`` once the first ``n`` values' bytes are written
        (:meth:`Prepared.fill`); whole here, chunk by chunk in the blockwise codecs."""
        raw[:] = np.frombuffer(self.encode_roundtrip_into(flat, out), dtype=np.uint8)
        advance(flat.numel())


class NoneCodec(_SpecCodec):
    """No compression: little-endian fp32."""

    spec = SPECS["none"]

    def encode(self, flat: Tensor) -> bytes:
        return check_flat(flat).numpy().astype("<f4", copy=False).tobytes()

    def encode_roundtrip(self, flat: Tensor) -> tuple[bytes, Tensor]:
        flat = check_flat(flat)
        return flat.numpy().astype("<f4", copy=False).tobytes(), flat.clone()

    def encode_roundtrip_into(self, flat: Tensor, out: Tensor) -> bytes:
        flat = check_flat(flat)
        out.copy_(flat)
        return flat.numpy().astype("<f4", copy=False).tobytes()

    def decode(self, data: bytes, numel: int) -> Tensor:
        self._check_length(data, numel)
        out = torch.from_numpy(np.frombuffer(data, dtype="<f4").astype(np.float32))  # (numel,)
        if not bool(torch.isfinite(out).all()):
            raise ValueError("none: decoded values hold NaN or Inf")
        return out


class Fp16Codec(_SpecCodec):
    """IEEE half precision (about 3 significant digits); values beyond 65504 are refused."""

    spec = SPECS["fp16"]

    def encode(self, flat: Tensor) -> bytes:
        return self._half(flat).numpy().astype("<f2", copy=False).tobytes()

    def encode_roundtrip(self, flat: Tensor) -> tuple[bytes, Tensor]:
        half = self._half(flat)
        return half.numpy().astype("<f2", copy=False).tobytes(), half.to(torch.float32)

    @staticmethod
    def _half(flat: Tensor) -> Tensor:
        half = check_flat(flat).to(torch.float16)
        if not bool(torch.isfinite(half).all()):
            raise ValueError("fp16: values beyond the half-precision range (65504) cannot be encoded")
        return half

    def decode(self, data: bytes, numel: int) -> Tensor:
        self._check_length(data, numel)
        half = torch.from_numpy(np.frombuffer(data, dtype="<f2").astype(np.float16))  # (numel,)
        if not bool(torch.isfinite(half).all()):
            raise ValueError("fp16: decoded values hold NaN or Inf")
        return half.to(torch.float32)


class _BlockwiseCodec(_SpecCodec):
    """Shared machinery of absmax block quantisers: ``scale = absmax / qmax``, ``q = round(x / scale)``."""

    @property
    def qmax(self) -> int:
        return self.spec.qmax

    @abc.abstractmethod
    def _pack(self, q: Tensor) -> np.ndarray:
        """Integer codes ``(nb, count)`` in [-qmax, qmax] -> uint8 ``(nb, code_bytes)``."""

    def _pack_into(self, q: Tensor, dst: np.ndarray) -> None:
        """:meth:`_pack` written into ``dst``, a uint8 ``(nb, code_bytes)`` view of the output."""
        dst[...] = self._pack(q)

    def _codes(self, packed: np.ndarray) -> Optional[np.ndarray]:
        """The int8 codes of ``packed`` (uint8 ``(nb, code_bytes)``) as a view, where the layout has
        one code per byte; None otherwise."""
        return None

    @abc.abstractmethod
    def _unpack(self, raw: np.ndarray, count: int) -> "Tensor | np.ndarray":
        """uint8 ``(nb, code_bytes)`` -> int8 codes ``(nb, count)`` (a tensor, or an array that may be a
        read-only view of ``raw``); ValueError on invalid codes."""

    def _encode_blocks(self, blocks: Tensor, values: Optional[Tensor], out: Optional[np.ndarray]) -> None:
        # blocks: (nb, count) fp32; values: None or (nb, count) fp32, filled with what decode gives;
        # out: None (only the values are wanted) or uint8 (nb, SCALE_BYTES + code_bytes), the bytes.
        # The extremes (two reductions), then the codes are computed in place in ``values`` (or one
        # temporary): the exchange is CPU-bound on small machines and this is its largest single cost;
        # no fresh round-sized buffer is touched (page faults), and the bytes are unchanged.
        # amax and amin, not aminmax: torch's aminmax along a dimension is several times slower on the CPU
        hi, lo = torch.amax(blocks, dim=1, keepdim=True), torch.amin(blocks, dim=1, keepdim=True)  # (nb, 1) each
        # (nb, 1) == blocks.abs().amax(dim=1); + 0.0 makes the -0.0 that maximum(+0.0, -0.0) may give
        # +0.0 (which of the two it returns differs between torch's vector and scalar paths): an
        # all-zero block's scale is +0.0 whatever the split, and its decoded zeros are +0.0
        absmax = torch.maximum(hi, lo.neg_()).add_(0.0)
        if not bool(torch.isfinite(absmax).all()):  # NaN propagates through amax/amin, Inf is an extreme
            raise ValueError("cannot encode a vector holding NaN or Inf")
        scale = absmax / self.qmax  # (nb, 1)
        if bool((scale > _MAX_SCALE[self.qmax]).any()):
            raise ValueError(f"{self.name}: values beyond {_MAX_SCALE[self.qmax] * self.qmax:.4g} cannot be encoded")
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.div(blocks, safe) if values is None else torch.div(blocks, safe, out=values)
        q.round_()  # (nb, count) integral codes
        # |x| / fl(absmax / qmax) stays below qmax + 1/2 whenever the scale is a normal float (two
        # roundings of relative error 2^-24 each), so the codes are already in [-qmax, qmax]; a
        # subnormal scale keeps too few bits for that, and only then is a clamp pass needed
        if bool(((scale > 0) & (scale < _FLT_MIN)).any()):
            q.clamp_(-self.qmax, self.qmax)
        if out is not None:
            out[:, :SCALE_BYTES] = scale.numpy().astype("<f4", copy=False).view(np.uint8)
            self._pack_into(q, out[:, SCALE_BYTES:])
        if values is not None:
            codes = None if out is None else self._codes(out[:, SCALE_BYTES:])
            if codes is not None:  # decode's own operation on the codes just written (a third cheaper)
                np.multiply(codes, scale.numpy(), out=q.numpy())
            else:
                # what decode computes from these bytes: integer code times the stored fp32 scale, added
                # to +0.0 (which turns the -0.0 that rounding leaves into the +0.0 a decoded code 0
                # gives); one pass (addcmul) where add_(0.0).mul_(scale) took two, the same bits
                torch.addcmul(_ZERO, q, scale, out=q)

    def _encode(self, flat: Tensor, values: Optional[Tensor], out: Optional[np.ndarray],
                advance: Optional[Callable[[int], None]] = None) -> None:
        """Encode ``flat``: its bytes into ``out`` (uint8, the encoded size) and its decoded values into
        ``values``, each if given; ``advance(n)`` is called as the first ``n`` values are done. Full
        blocks go :data:`_CHUNK_BLOCKS` at a time: each pass over a chunk finds it in the core's cache,
        where passes over the whole vector each go to memory (less CPU for the round trip, much less for
        a plain encode)."""
        flat = check_flat(flat, finite=False)  # checked per block in _encode_blocks
        numel = flat.numel()
        full, tail = divmod(numel, BLOCK)
        stride = SCALE_BYTES + self.spec.code_bytes(BLOCK)
        for c0 in range(0, full, _CHUNK_BLOCKS):
            c1 = min(full, c0 + _CHUNK_BLOCKS)
            self._encode_blocks(flat[c0 * BLOCK : c1 * BLOCK].view(c1 - c0, BLOCK),
                                None if values is None else values[c0 * BLOCK : c1 * BLOCK].view(c1 - c0, BLOCK),
                                None if out is None else out[c0 * stride : c1 * stride].reshape(c1 - c0, stride))
            if advance is not None:
                advance(c1 * BLOCK)
        if tail:
            self._encode_blocks(flat[full * BLOCK :].view(1, -1),
                                None if values is None else values[full * BLOCK :].view(1, -1),
                                None if out is None else out[full * stride :].reshape(1, -1))
        if advance is not None:
            advance(numel)

    def _bytes(self, flat: Tensor, values: Optional[Tensor]) -> bytes:
        """:meth:`_encode` into a fresh buffer: the bytes."""
        flat = check_flat(flat, finite=False)
        out = np.empty(self.encoded_size(flat.numel()), dtype=np.uint8)
        self._encode(flat, values, out)
        return out.tobytes()

    def _prepare_into(self, flat: Tensor, out: Tensor, raw: np.ndarray, advance: Callable[[int], None]) -> None:
        self._check_out(flat, out)
        self._encode(flat, out, raw, advance)

    def encode(self, flat: Tensor) -> bytes:
        return self._bytes(flat, None)

    def encode_roundtrip(self, flat: Tensor) -> tuple[bytes, Tensor]:
        values = torch.empty(flat.numel(), dtype=torch.float32)  # (numel,)
        return self._bytes(flat, values), values

    def encode_roundtrip_into(self, flat: Tensor, out: Tensor) -> bytes:
        self._check_out(flat, out)
        return self._bytes(flat, out)

    def roundtrip(self, flat: Tensor) -> Tensor:
        values = torch.empty(flat.numel(), dtype=torch.float32)  # (numel,)
        self._encode(flat, values, None)
        return values

    def roundtrip_into(self, flat: Tensor, out: Tensor) -> None:
        self._check_out(flat, out)
        self._encode(flat, out, None)

    def _check_out(self, flat: Tensor, out: Tensor) -> None:
        if out.dim() != 1 or out.numel() != flat.numel() or out.dtype != torch.float32 or not out.is_contiguous():
            raise ValueError(f"{self.name}: out must be a contiguous fp32 vector of {flat.numel()} values")

    def _decode_blocks(self, raw: np.ndarray, count: int, out: Tensor) -> None:
        # raw: (nb, 4 + code_bytes) uint8; out: (nb, count) fp32
        scale = torch.from_numpy(raw[:, :SCALE_BYTES].copy().view("<f4").astype(np.float32, copy=False))
        if not bool(torch.isfinite(scale).all()) or bool((scale < 0).any()):  # scale: (nb, 1)
            raise ValueError(f"{self.name}: a block scale is negative, NaN or Inf")
        if bool((scale > _MAX_SCALE[self.qmax]).any()):  # a code times it would overflow to Inf
            raise ValueError(f"{self.name}: a block scale exceeds {_MAX_SCALE[self.qmax]:.4g} (absmax beyond fp32)")
        q = self._unpack(raw[:, SCALE_BYTES:], count)  # (nb, count) int8
        # int8 code times fp32 scale: exact widening, one rounding; numpy reads the codes where they
        # lie (read-only bytes, which torch would first copy) and widens them as it multiplies
        np.multiply(q if isinstance(q, np.ndarray) else q.numpy(), scale.numpy(), out=out.numpy())

    def decode_into(self, data: bytes, out: Tensor) -> None:
        numel = out.numel()
        self._check_length(data, numel)
        buf = np.frombuffer(data, dtype=np.uint8)
        full, tail = divmod(numel, BLOCK)
        stride = SCALE_BYTES + self.spec.code_bytes(BLOCK)
        if full:
            self._decode_blocks(buf[: full * stride].reshape(full, stride), BLOCK, out[: full * BLOCK].view(full, BLOCK))
        if tail:
            self._decode_blocks(buf[full * stride :].reshape(1, -1), tail, out[full * BLOCK :].view(1, tail))

    def decode(self, data: bytes, numel: int) -> Tensor:
        self._check_length(data, numel)
        out = torch.empty(numel, dtype=torch.float32)  # (numel,)
        self.decode_into(data, out)
        return out


class Int8Codec(_BlockwiseCodec):
    """Blockwise absmax int8: one fp32 scale per :data:`BLOCK` values, codes in [-127, 127].
    Round-trip error per element is at most ``absmax(block) / 254``."""

    spec = SPECS["int8"]

    def _pack(self, q: Tensor) -> np.ndarray:
        return q.to(torch.int8).numpy().view(np.uint8)

    def _pack_into(self, q: Tensor, dst: np.ndarray) -> None:
        torch.from_numpy(dst.view(np.int8)).copy_(q)  # fp32 codes straight into the output, no temporary

    def _codes(self, packed: np.ndarray) -> Optional[np.ndarray]:
        return packed.view(np.int8)

    def _unpack(self, raw: np.ndarray, count: int) -> np.ndarray:
        codes = raw.view(np.int8)  # (nb, count): the bytes themselves, no copy
        if codes.size and int(codes.min()) == -128:
            raise ValueError("int8: code -128 is outside [-127, 127]")
        return codes


class Int4Codec(_BlockwiseCodec):
    """Blockwise absmax 4-bit: one fp32 scale per :data:`BLOCK` values, codes in [-7, 7] two per
    byte. Round-trip error per element is at most ``absmax(block) / 14``."""

    spec = SPECS["int4"]

    def _pack(self, q: Tensor) -> np.ndarray:
        nib = q.add(8).to(torch.uint8)  # (nb, count) in 1..15 (q is integral, so the sum is exact)
        if nib.shape[1] % 2:
            nib = torch.cat([nib, torch.full((nib.shape[0], 1), 8, dtype=torch.uint8)], dim=1)
        packed = nib[:, 0::2] | (nib[:, 1::2] << 4)  # (nb, code_bytes)
        return packed.numpy()

    def _pack_into(self, q: Tensor, dst: np.ndarray) -> None:
        if q.shape[1] % 2 or not _LITTLE_ENDIAN:  # an odd tail block: the padded general path
            dst[...] = self._pack(q)
            return
        # Even blocks (every full block): two neighbouring codes read as one little-endian int16
        # (low code | high code << 8); the same bytes as _pack at a third of its time, whole-buffer
        # ops with no strided access.
        nib = q.to(torch.int8)  # (nb, count): codes in [-7, 7]
        nib += 8  # 1..15
        pair = nib.view(torch.int16)  # (nb, code_bytes)
        pair |= pair >> 4  # low byte: low | high << 4 (the low code is below 16: it shifts out)
        torch.from_numpy(dst).copy_(pair)  # the low byte of each pair (int16 -> uint8 keeps it)

    def _unpack(self, raw: np.ndarray, count: int) -> Tensor:
        if count % 2 == 0 and _LITTLE_ENDIAN:
            # the inverse of _pack_into: each byte widened to an int16 whose two bytes are its nibbles
            pair = torch.from_numpy(raw.astype(np.int16))  # (nb, code_bytes), a writable copy of the read-only bytes
            high = pair >> 4
            pair &= 0x0F
            pair |= high.mul_(256)  # low nibble | high nibble << 8
            codes = pair.view(torch.int8)  # (nb, count) nibbles 0..15, low nibble first
            codes -= 8
        else:
            # one table lookup per byte gives both codes (low nibble first): (nb, code_bytes, 2) int8
            codes = torch.from_numpy(np.take(_NIBBLES, raw, axis=0).reshape(raw.shape[0], -1)[:, :count])
        if codes.numel() and int(codes.min()) == -8:
            raise ValueError("int4: nibble 0 (code -8) is outside [-7, 7]")
        if count % 2 and bool((raw[:, -1] >> 4 != 8).any()):
            raise ValueError("int4: the padding nibble of an odd-sized block is not zero")
        return codes


_CHUNK_BLOCKS = 256
"""Blocks an encoder's passes take at a time: 1 MiB of fp32 values (with the codes and the decoded
values, well within a core's L2 cache)."""

_FLT_MIN = float(np.finfo(np.float32).tiny)
"""The smallest normal fp32 value: below it a block scale is subnormal (see ``_encode_blocks``)."""

_ZERO = torch.zeros(())
"""+0.0, the addend of the encoders' round trip (:meth:`_BlockwiseCodec._encode_blocks`)."""

_LITTLE_ENDIAN = sys.byteorder == "little"
"""Whether int16 views of byte pairs read the first byte as the low one (the int4 fast paths)."""

_NIBBLES = np.array([[(b & 0x0F) - 8, (b >> 4) - 8] for b in range(256)], dtype=np.int8)
"""Byte -> its two 4-bit codes (low nibble, high nibble), each nibble minus 8: (256, 2) int8."""


VALUE_CODECS: tuple[Codec, ...] = (NoneCodec(), Fp16Codec(), Int8Codec(), Int4Codec())
"""One instance of each value codec, in the order of :data:`models.codec_spec.CODECS`."""
