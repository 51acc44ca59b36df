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
import threading
from typing import Callable, Mapping, Optional

import numpy as np
import torch
from torch import Tensor

from models.codec_spec import BLOCK, SCALE_BYTES, SPECS, CodecSpec
from peer.averaging.phases import phase, tick

__all__ = ["Codec", "NoneCodec", "Fp16Codec", "Int8Codec", "Int4Codec", "Prepared", "VALUE_CODECS"]


def _max_scale(qmax: int) -> float:
    """The largest fp32 scale whose code ``qmax`` decodes to a finite fp32 value."""
    s = np.float32(np.finfo(np.float32).max) / np.float32(qmax)
    with np.errstate(over="ignore"):
        while not np.isfinite(s * np.float32(qmax)):
            s = np.nextafter(s, np.float32(0))
    return float(s)


_MAX_SCALE = {s.qmax: _max_scale(s.qmax) for s in SPECS.values() if s.blockwise}
"""Per qmax, the largest block scale: decoded values are always finite (larger scales are refused)."""


def _check_flat(flat: Tensor, finite: bool = True) -> Tensor:
    """Return ``flat`` as a contiguous CPU fp32 1-D tensor, or raise ValueError (also on NaN/Inf,
    unless ``finite`` is False: the blockwise codecs check their block extremes instead, in the pass
    they make anyway)."""
    if not isinstance(flat, Tensor):
        raise ValueError(f"expected a tensor, got {type(flat).__name__}")
    if flat.dim() != 1:
        raise ValueError(f"expected a flat 1-D tensor, got shape {tuple(flat.shape)}")
    flat = flat.detach().to(device="cpu", dtype=torch.float32).contiguous()
    if finite and not bool(torch.isfinite(flat).all()):
        raise ValueError("cannot encode a vector holding NaN or Inf")
    return flat


class Codec(abc.ABC):
    """Encodes a flat fp32 vector to bytes and back (formats: :mod:`models.codec_spec`).

    Codecs hold no per-exchange state: one object per codec name serves every module and thread
    (:func:`peer.averaging.get_codec`)."""

    name: str = ""

    @abc.abstractmethod
    def encoded_size(self, numel: int) -> int:
        """Number of bytes :meth:`encode` produces for ``numel`` values (an upper bound for a codec
        with an entropy stage)."""

    def size_ok(self, length: int, numel: int) -> bool:
        """Whether ``length`` bytes can be an encoding of ``numel`` values (a fixed size unless the
        codec has an entropy stage, whose sizes vary up to :meth:`encoded_size`)."""
        return length == self.encoded_size(numel)

    @abc.abstractmethod
    def encode(self, flat: Tensor) -> bytes:
        """Encode a finite fp32 1-D tensor; raises ValueError on NaN/Inf or a wrong shape."""

    @abc.abstractmethod
    def decode(self, data: bytes, numel: int) -> Tensor:
        """Decode ``numel`` values to a CPU fp32 1-D tensor; raises ValueError on malformed bytes."""

    def decode_into(self, data: bytes, out: Tensor) -> None:
        """Decode ``out.numel()`` values into ``out`` (a contiguous CPU fp32 1-D tensor), bit for bit
        what :meth:`decode` returns, without an intermediate tensor where the codec can; raises
        ValueError on malformed bytes (``out`` may then hold part of them)."""
        out.copy_(self.decode(data, out.numel()))

    def roundtrip(self, flat: Tensor) -> Tensor:
        """``decode(encode(flat))``: what a receiver of ``flat`` gets."""
        return self.encode_roundtrip(flat)[1]

    def encode_roundtrip(self, flat: Tensor) -> tuple[bytes, Tensor]:
        """``(encode(flat), decode(encode(flat)))``, bit for bit, in one pass where the codec can: a
        sender needs both (the bytes go out, the decoded values feed error feedback)."""
        data = self.encode(flat)
        return data, self.decode(data, flat.numel())

    def encode_roundtrip_into(self, flat: Tensor, out: Tensor) -> bytes:
        """:meth:`encode_roundtrip` whose decoded values are written into ``out`` (a contiguous CPU
        fp32 1-D tensor of ``flat.numel()`` values), bit for bit, without a temporary where the codec
        can: the all-reduce keeps what the group receives from it in one round-sized vector."""
        data, values = self.encode_roundtrip(flat)
        out.copy_(values)
        return data

    def roundtrip_into(self, flat: Tensor, out: Tensor) -> None:
        """:meth:`roundtrip` written into ``out`` (as :meth:`encode_roundtrip_into`), without making
        the bytes where the codec can: a reducer's own part is never sent."""
        out.copy_(self.roundtrip(flat))

    def prepare(self, numel: int) -> Optional["Prepared"]:
        """A :class:`Prepared` encoding of a vector of ``numel`` values, to be filled in a thread
        (:meth:`Prepared.fill`) before the group is known, or None where a part's bytes are not a slice
        of the whole vector's (the sparse codec chooses its values per part)."""
        return None

    def _check_length(self, data: bytes, numel: int) -> None:
        if numel < 0:
            raise ValueError(f"numel must be >= 0, got {numel}")
        expected = self.encoded_size(numel)
        if len(data) != expected:
            raise ValueError(f"{self.name}: {len(data)} bytes do not encode {numel} values (expected {expected})")

    # The average a reducer sends back: the codec's own encoding unless it overrides these (the sparse
    # codec sends the union of the contributions, :mod:`peer.averaging.sparse`).

    feedback_decay: float = 1.0
    """Error feedback keeps ``feedback_decay * residual`` from one round to the next."""

    def encode_average(self, value: Tensor, contributions: Optional[Mapping[str, tuple[Tensor, float]]] = None,
                       plain_mean: bool = False) -> bytes:
        """The bytes a reducer answers with for the aggregate ``value`` of ``contributions``
        (``plain_mean``: ``value`` is their weighted mean in sorted peer-id order)."""
        return self.encode(value)

    def decode_average(self, data: bytes, numel: int) -> Tensor:
        """What every member applies from a reducer's answer."""
        return self.decode(data, numel)

    def decode_average_into(self, data: bytes, out: Tensor) -> None:
        """:meth:`decode_average` into ``out`` (see :meth:`decode_into`); a codec whose answer is its
        :meth:`decode` needs no intermediate tensor."""
        self.decode_into(data, out)

    def encode_average_into(self, value: Tensor, contributions: Optional[Mapping[str, tuple[Tensor, float]]],
                            plain_mean: bool, out: Tensor) -> bytes:
        """:meth:`encode_average`, with what :meth:`decode_average_into` makes of its bytes written into
        ``out``: the reducer's own copy of the average. Here the answer is the codec's encoding, so
        its round trip (:meth:`encode_roundtrip_into`), with no decode of what was just encoded; a
        codec that answers otherwise overrides this with them."""
        return self.encode_roundtrip_into(value, out)

    def average_size_ok(self, length: int, numel: int) -> bool:
        """Whether ``length`` bytes can be a reducer's answer for ``numel`` values."""
        return self.size_ok(length, numel)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


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
        return _check_flat(flat).numpy().astype("<f4", copy=False).tobytes()

    def encode_roundtrip(self, flat: Tensor) -> tuple[bytes, Tensor]:
        flat = _check_flat(flat)
        return flat.numpy().astype("<f4", copy=False).tobytes(), flat.clone()

    def encode_roundtrip_into(self, flat: Tensor, out: Tensor) -> bytes:
        flat = _check_flat(flat)
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
        half = _check_flat(flat).to(torch.float16)
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
        flat = _check_flat(flat, finite=False)  # checked per block in _encode_blocks
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
        flat = _check_flat(flat, finite=False)
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


class Prepared:
    """A vector's encoding made before its group is known (the all-reduce then only cuts it into parts
    and, with an entropy stage, compresses each): :meth:`fill` encodes the whole vector in a thread,
    chunk by chunk, while matchmaking runs; :meth:`part` gives the bytes of a block-aligned part as
    soon as the encoding got past it. A part's bytes are those the codec makes of the part alone:
    blocks start at element 0 and each lies whole in the bytes (:mod:`models.codec_spec`).

    ``codec``: the value codec whose layout the bytes have (a :class:`_SpecCodec`); ``pack``: what a part's bytes go through
    on their way out (the entropy stage, :class:`peer.averaging.entropy.EntropyCoded`), if anything."""

    WAIT = 60.0
    """Most seconds :meth:`part` waits for :meth:`fill` to get past its part."""

    def __init__(self, codec: "_SpecCodec", numel: int, pack: Optional[Callable[[memoryview], bytes]] = None):
        self.codec = codec
        self.numel = numel
        self.pack = pack
        self.raw = np.empty(codec.encoded_size(numel), dtype=np.uint8)
        self._done = 0
        self._error: Optional[BaseException] = None
        self._changed = threading.Condition()

    def fill(self, flat: Tensor, out: Tensor) -> None:
        """Encode ``flat`` (``numel`` values) and write what a receiver decodes into ``out``; raises
        ValueError as :meth:`Codec.encode` does (then every :meth:`part` raises it too)."""
        if flat.numel() != self.numel:
            raise ValueError(f"{self.codec.name}: prepared for {self.numel} values, got {flat.numel()}")
        try:
            with phase("encode"):  # counted chunk by chunk (_advance): a snapshot sees it as it runs
                self.codec._prepare_into(flat, out, self.raw, self._advance)
        except BaseException as e:
            with self._changed:
                self._error = e
                self._changed.notify_all()
            raise

    def _advance(self, done: int) -> None:
        tick()
        with self._changed:
            self._done = done
            self._changed.notify_all()

    def wait(self, upto: int) -> None:
        """Return once the first ``upto`` values are encoded (their bytes and decoded values written);
        ValueError if the encoding failed, TimeoutError after :data:`WAIT` seconds."""
        with self._changed:
            if not self._changed.wait_for(lambda: self._done >= upto or self._error is not None, self.WAIT):
                raise TimeoutError(f"{self.codec.name}: the vector's encoding did not reach {upto} in {self.WAIT:.0f}s")
            if self._error is not None:
                raise ValueError(f"{self.codec.name}: the vector could not be encoded: {self._error}")

    def part(self, a: int, b: int) -> bytes:
        """The encoded bytes of values ``[a, b)`` (``a`` and ``b`` multiples of ``BLOCK``, or ``b`` the
        vector's end), through :attr:`pack`; waits for :meth:`fill` to get past ``b``."""
        if not (0 <= a <= b <= self.numel and a % BLOCK == 0 and (b % BLOCK == 0 or b == self.numel)):
            raise ValueError(f"[{a}, {b}) is not a block-aligned part of {self.numel} values")
        self.wait(b)
        view = memoryview(self.raw)[self.codec.encoded_size(a) : self.codec.encoded_size(b)]
        return self.pack(view) if self.pack is not None else view.tobytes()


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
