"""The sparse pseudo-gradient codecs' names, layouts and sizes, torch-free.

A sparse codec is named ``topk{K}b{B}``: in every chunk of :data:`CHUNK` values (the last chunk may
be shorter) the K values of largest magnitude are kept, quantised to B bits, and sent with their
positions; the rest is left to error feedback (SparseLoCo, Sarfi et al. 2025; DeMo, Peng et al. 2024).
``topk16b2`` keeps 1.56% of the values at 2 bits. Like the other codecs, a run names it in
``OuterConfig.codec`` and the coordinator hands it to every peer in its assignment.

Uplink (a member's contribution), per chunk of ``c`` values keeping ``k_c = min(c, ceil(K c / CHUNK))``,
whose positions ``p_1 < ... < p_kc`` are Elias-Fano coded (Elias 1974, Fano 1971) with
``l = low_bits(c, k_c) = floor(log2(c / k_c))`` low bits each:

==========================  =============================================================
 scale                       little-endian fp32: the chunk's largest kept magnitude / 2^(B-1)
 then, bit-packed (MSB       the high parts: ``k_c + ((c - 1) >> l) + 1`` bits, with bit
 first, padded to a byte     ``(p_i >> l) + i`` set for i = 0..k_c-1 (exactly k_c ones);
 per chunk)                  the low parts: ``l`` bits of ``p_i`` per entry, in order;
                             the codes: B bits per entry, in order: a sign bit and B-1 bits
                             of ``level - 1``; the value is ``+-level * scale``, level in
                             1..2^(B-1)
==========================  =============================================================

so a chunk takes :meth:`SparseSpec.chunk_bytes` bytes, whatever the values: exact sizes. For
``topk16b2`` that is 4 + 20 bytes per 1024 values: 32 + 96 bits of positions where 10 bits each
would take 160 (within 9 bits of the ``log2 C(1024, 16)`` = 119 bits any set of 16 positions needs).

Downlink (a reducer's average of one part), behind a one-byte tag, whichever is smaller:

- ``GATHER``: the contributions themselves: a uint16 count m, m little-endian fp64 weights, then the
  m uplink encodings, in sorted peer-id order; every member decodes them and takes the weighted
  mean in that order (the same IEEE operations on every machine: bit-identical replicas);
- ``EXACT``: the reducer's aggregate as it is: one uint16 count of non-zeros per chunk, their
  positions (:data:`INDEX_BITS` bits each, ascending per chunk, bit-packed), then their fp32 values.

The entropy stage (``OuterConfig.entropy``) does not apply to sparse codecs: their bytes are
bit-packed already, and zstd would only add its tag.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Optional

__all__ = ["CHUNK", "INDEX_BITS", "SparseSpec", "sparse_spec", "is_sparse", "FEEDBACK_DECAY", "feedback_decay",
           "high_bits", "low_bits", "position_bits"]

CHUNK = 1024
"""Values per top-k chunk: :data:`models.codec_spec.BLOCK`, so parts of a vector cut at its multiples
encode to the same chunks as the whole vector (the all-reduce relies on it)."""

INDEX_BITS = 10
"""Bits of a position inside a chunk (``2 ** INDEX_BITS == CHUNK``) in an ``EXACT`` average."""

FEEDBACK_DECAY = 0.95
"""Error feedback decay of the sparse codecs: ``x = delta + 0.95 residual`` (SparseLoCo's beta)."""

_NAME = re.compile(r"topk(\d+)b(\d+)")
BITS = (2, 4)
"""Value bits a sparse codec may use."""


@dataclass(frozen=True)
class SparseSpec:
    """The layout of one sparse codec: ``k`` values kept per chunk, ``bits`` per value's code."""

    k: int
    bits: int

    @property
    def name(self) -> str:
        return f"topk{self.k}b{self.bits}"

    @property
    def levels(self) -> int:
        """Magnitude levels: codes are ``+-level``, level in 1..levels."""
        return 1 << (self.bits - 1)

    @property
    def density(self) -> float:
        return self.k / CHUNK

    def kept(self, count: int) -> int:
        """Values kept of a chunk of ``count`` values."""
        return min(count, -(-self.k * count // CHUNK))

    def chunk_bytes(self, count: int) -> int:
        kept = self.kept(count)
        return 4 + (position_bits(count, kept) + kept * self.bits + 7) // 8

    def encoded_size(self, numel: int) -> int:
        """The exact number of bytes a contribution of ``numel`` values takes."""
        if numel < 0:
            raise ValueError(f"numel must be >= 0, got {numel}")
        full, tail = divmod(numel, CHUNK)
        return full * self.chunk_bytes(CHUNK) + (self.chunk_bytes(tail) if tail else 0)

    @staticmethod
    def exact_size(numel: int, nonzeros: int) -> int:
        """Bytes of an ``EXACT`` average of ``numel`` values holding ``nonzeros`` non-zeros (with its tag)."""
        return 1 + 2 * math.ceil(numel / CHUNK) + (nonzeros * INDEX_BITS + 7) // 8 + 4 * nonzeros

    def average_size(self, numel: int) -> int:
        """The most bytes an average of ``numel`` values takes (an ``EXACT`` one with no zero)."""
        return self.exact_size(numel, numel)


def low_bits(count: int, kept: int) -> int:
    """Elias-Fano low bits per position of ``kept`` positions in a chunk of ``count`` values:
    ``floor(log2(count / kept))`` (0 when nearly every value is kept)."""
    if not 1 <= kept <= count:
        raise ValueError(f"cannot keep {kept} of {count} values")
    return max(0, (count // kept).bit_length() - 1)


def high_bits(count: int, kept: int) -> int:
    """Bits of the Elias-Fano high parts of ``kept`` ascending positions in a chunk of ``count``
    values: ``kept + ((count - 1) >> l) + 1``, a one per position and a zero per bucket boundary."""
    return kept + ((count - 1) >> low_bits(count, kept)) + 1


def position_bits(count: int, kept: int) -> int:
    """Bits of the Elias-Fano code of ``kept`` ascending positions in a chunk of ``count`` values:
    the high parts (:func:`high_bits`) and ``l`` low bits each."""
    return high_bits(count, kept) + kept * low_bits(count, kept)


def _parse(name: object) -> Optional[SparseSpec]:
    m = _NAME.fullmatch(name) if isinstance(name, str) else None
    if m is None:
        return None
    k, bits = int(m.group(1)), int(m.group(2))
    if not (1 <= k <= CHUNK and bits in BITS):
        return None
    return SparseSpec(k, bits)


def is_sparse(name: object) -> bool:
    """Whether ``name`` is a valid sparse codec name (``topk{K}b{B}``, 1 <= K <= 1024, B in 2, 4)."""
    return _parse(name) is not None


def sparse_spec(name: object) -> SparseSpec:
    """The layout of sparse codec ``name``; ValueError (one line, saying the form) otherwise."""
    spec = _parse(name)
    if spec is None:
        raise ValueError(f"unknown sparse codec '{name}'; use topk{{K}}b{{B}} with 1 <= K <= {CHUNK} values kept "
                         f"per {CHUNK} and B in {' or '.join(map(str, BITS))} bits, e.g. topk16b2")
    return spec


def feedback_decay(codec: str) -> float:
    """Error feedback decay for ``codec``: :data:`FEEDBACK_DECAY` for sparse codecs, 1 (none) otherwise."""
    return FEEDBACK_DECAY if is_sparse(codec) else 1.0
