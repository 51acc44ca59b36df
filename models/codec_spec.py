"""What every side must agree on about the pseudo-gradient codecs, torch-free: names, layout, sizes.

The codecs are implemented in ``peer.averaging`` (with torch), but two places decide things about
them without torch: the run config validates a codec's name (:mod:`models.config`) and the
coordinator's scheduler estimates how many bytes a peer exchanges per round (``coordinator.scheduler``).
Both read this module, and the implementation takes its names, :data:`BLOCK` and sizes from here, so
a codec's layout is written down once.

============  =================================================  ==================================
 name          encoding of a flat fp32 vector of n values          bytes
============  =================================================  ==================================
 ``none``      little-endian fp32                                  ``4 n``
 ``fp16``      little-endian IEEE half                             ``2 n``
 ``int8``      per block of :data:`BLOCK` values: an fp32 absmax   ``n + 4 ceil(n / BLOCK)``
               scale, then int8 codes in [-127, 127]
 ``int4``      per block: an fp32 absmax scale, then codes in      ``sum over blocks of ceil(len / 2)``
               [-7, 7] packed two per byte (low nibble first,      ``+ 4 ceil(n / BLOCK)``
               stored as code + 8)
============  =================================================  ==================================

On the wire a codec's bytes may go through a lossless entropy stage (:data:`ENTROPY_STAGES`): the
wire codec ``int8+zstd`` (:func:`wire_name`) is ``int8`` behind a one-byte tag, compressed when that
shrinks it. Its size varies with the data, bounded by :func:`encoded_size` of its wire name (the raw
size plus the tag). Sizes are :meth:`CodecSpec.encoded_size` (a codec alone) and :func:`encoded_size`
(a wire name).

The sparse codecs ``topk{K}b{B}`` (top-K of every 1024 values at B bits) are specified in
:mod:`models.sparse_spec`; :func:`codec_spec` and :func:`wire_name` accept their names too (no
entropy stage applies to them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from models.sparse_spec import SparseSpec, is_sparse, sparse_spec

__all__ = [
    "CODECS",
    "ENTROPY_STAGES",
    "BLOCK",
    "SCALE_BYTES",
    "TAG_BYTES",
    "CodecSpec",
    "SPECS",
    "codec_spec",
    "wire_name",
    "split_wire_name",
    "encoded_size",
    "is_codec",
]

BLOCK = 1024
"""Values per quantisation block of the blockwise codecs (int8, int4). Parts of a vector cut at
multiples of it encode to the same bytes as the whole vector (the all-reduce relies on it)."""

SCALE_BYTES = 4
"""Bytes of a block's scale (one little-endian fp32)."""

TAG_BYTES = 1
"""Bytes of the entropy stage's tag (raw or zstd) in front of a codec's bytes."""


@dataclass(frozen=True)
class CodecSpec:
    """The layout of one codec: how many bits each value's code takes, and whether values come in
    blocks of :data:`BLOCK` that each carry an fp32 scale."""

    name: str
    """The codec's name in the run config and on the wire."""
    bits: int
    """Bits per value's code (codes of a block are packed, the last byte padded)."""
    blockwise: bool = False
    """True: each block of :data:`BLOCK` values is laid out as ``scale | codes``."""
    qmax: int = 0
    """Blockwise codecs: codes lie in ``[-qmax, qmax]``, the block's absmax maps to ``qmax``."""

    def code_bytes(self, count: int) -> int:
        """Bytes of the packed codes of ``count`` values (one block, or a whole unblocked vector)."""
        return (count * self.bits + 7) // 8

    def encoded_size(self, numel: int) -> int:
        """The exact number of bytes the codec encodes ``numel`` values to."""
        if numel < 0:
            raise ValueError(f"numel must be >= 0, got {numel}")
        if not self.blockwise:
            return self.code_bytes(numel)
        full, tail = divmod(numel, BLOCK)
        size = full * (SCALE_BYTES + self.code_bytes(BLOCK))
        if tail:
            size += SCALE_BYTES + self.code_bytes(tail)
        return size


SPECS: dict[str, CodecSpec] = {
    s.name: s
    for s in (
        CodecSpec("none", 32),
        CodecSpec("fp16", 16),
        CodecSpec("int8", 8, blockwise=True, qmax=127),
        CodecSpec("int4", 4, blockwise=True, qmax=7),
    )
}
"""Every codec's layout by name, from exact to smallest."""

CODECS: tuple[str, ...] = tuple(SPECS)
"""Pseudo-gradient codecs, from exact to smallest."""

ENTROPY_STAGES = ("none", "zstd")
"""Lossless stages applied to a codec's bytes on the wire: none, or zstd (level 1; a part that does not
shrink is sent raw). Quantised codes are far from uniform, so zstd's Huffman stage shrinks them."""


def is_codec(name: object) -> bool:
    """Whether ``name`` names a codec: one of :data:`CODECS` or a sparse ``topk{K}b{B}``."""
    return (isinstance(name, str) and name in SPECS) or is_sparse(name)


def codec_spec(name: str) -> Union[CodecSpec, SparseSpec]:
    """The layout of codec ``name`` (one of :data:`CODECS`, or a sparse codec of
    :mod:`models.sparse_spec`); ValueError otherwise."""
    if is_sparse(name):
        return sparse_spec(name)
    try:
        return SPECS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown codec '{name}'; use one of {', '.join(CODECS)} or a sparse topk{{K}}b{{B}} "
                         "(e.g. topk16b2)") from None


def wire_name(codec: str, entropy: str) -> str:
    """The name peers exchange ``codec`` under: ``int8`` with entropy stage ``none``, ``int8+zstd``
    with ``zstd``; a sparse codec under its own name whatever the stage (its bytes are bit-packed).
    ValueError for an unknown codec or stage."""
    codec_spec(codec)
    if entropy not in ENTROPY_STAGES:
        raise ValueError(f"unknown entropy stage '{entropy}'; use one of {', '.join(ENTROPY_STAGES)}")
    return codec if entropy == "none" or is_sparse(codec) else f"{codec}+{entropy}"


def split_wire_name(name: str) -> tuple[str, str]:
    """``int8+zstd`` -> ``("int8", "zstd")``, ``int8`` -> ``("int8", "none")``: the inverse of
    :func:`wire_name`. ValueError for anything it does not produce."""
    if is_sparse(name):
        return str(name), "none"
    codec, plus, entropy = str(name).partition("+")
    if codec in SPECS and ((not plus and not entropy) or (entropy in ENTROPY_STAGES and entropy != "none")):
        return codec, entropy or "none"
    raise ValueError(f"unknown codec '{name}'; use one of {', '.join(CODECS)} "
                     f"(optionally followed by {' or '.join('+' + s for s in ENTROPY_STAGES if s != 'none')})")


def encoded_size(name: str, numel: int) -> int:
    """Bytes that ``numel`` values take on the wire under the wire codec ``name``: exact for a
    codec alone, an upper bound (the raw size plus the tag) with an entropy stage."""
    codec, entropy = split_wire_name(name)
    size = codec_spec(codec).encoded_size(numel)
    return size if entropy == "none" else TAG_BYTES + size
