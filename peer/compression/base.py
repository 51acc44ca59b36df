"""The codec base class: a flat fp32 vector to bytes and back (hivemind's ``CompressionBase`` is the model).

Every codec of the pseudo-gradient is a :class:`Codec`: the value codecs (:mod:`peer.compression.quantizers`),
the entropy stage over them (:mod:`peer.compression.entropy`) and the sparse codec
(:mod:`peer.compression.sparse`). Besides encoding and decoding, a codec says what a reducer answers
with (:meth:`Codec.encode_average`) and what every member applies from it (:meth:`Codec.decode_average`),
so that the all-reduce needs to know nothing of a codec's layout.
"""

from __future__ import annotations

import abc
from typing import Mapping, Optional

import numpy as np
import torch
from torch import Tensor

from peer.compression.prepared import Prepared

__all__ = ["Codec", "check_flat", "max_scale"]


def max_scale(qmax: int) -> float:
    """The largest fp32 scale whose code ``qmax`` decodes to a finite fp32 value."""
    s = np.float32(np.finfo(np.float32).max) / np.float32(qmax)
    with np.errstate(over="ignore"):
        while not np.isfinite(s * np.float32(qmax)):
            s = np.nextafter(s, np.float32(0))
    return float(s)


def check_flat(flat: Tensor, finite: bool = True) -> Tensor:
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
    (:func:`peer.compression.get_codec`)."""

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

    def prepare(self, numel: int) -> Optional[Prepared]:
        """A :class:`~peer.compression.prepared.Prepared` encoding of a vector of ``numel`` values, to be filled in a thread
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
    # codec sends the union of the contributions, :mod:`peer.compression.sparse`).

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
