"""The pseudo-gradient codecs by name: the one place a codec name, or a run's outer config, becomes a :class:`Codec`.

DiLoCo (Douillard et al. 2023) exchanges one pseudo-gradient per outer step; these codecs shrink it.
The names, layouts and sizes are specified in :mod:`models.codec_spec` (torch-free, so the run
config and the coordinator read them too); the value codecs are in :mod:`peer.compression.quantizers`,
the lossless entropy stage in :mod:`peer.compression.entropy` and the sparse codec in
:mod:`peer.compression.sparse`.

A wire codec name is a codec of :data:`models.codec_spec.CODECS`, optionally followed by an entropy
stage (``int8+zstd``). What a run exchanges is its config's codec under its config's entropy stage
(:meth:`models.config.OuterConfig.wire_codec`): :func:`resolve_codec` is that rule, and whoever runs a
run's outer steps (a peer's :class:`peer.diloco.DiLoCoOptimizer`, the one-process
:class:`peer.simulator.DiLoCoSimulator`) resolves its codec with it, so both encode the same bytes. A
peer resolves its codec once, when its optimizer is built, and passes the :class:`Codec` down to the
averager; the name travels on the wire only so that a reducer can refuse a part encoded with another codec.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from models.codec_spec import CODECS, ENTROPY_STAGES, split_wire_name, wire_name
from models.config import OuterConfig
from models.sparse_spec import is_sparse, sparse_spec
from peer.compression.base import Codec
from peer.compression.entropy import ENTROPY_CODERS
from peer.compression.quantizers import VALUE_CODECS
from peer.compression.sparse import SparseCodec

__all__ = ["get_codec", "resolve_codec"]

_CODECS: dict[str, Codec] = {c.name: c for c in VALUE_CODECS}
assert tuple(_CODECS) == CODECS
assert set(ENTROPY_CODERS) == set(ENTROPY_STAGES) - {"none"}
_CODECS.update({wire_name(name, stage): coder(_CODECS[name]) for name in CODECS
                for stage, coder in ENTROPY_CODERS.items()})


def get_codec(name: str) -> Codec:
    """The codec called ``name``: one of :data:`models.codec_spec.CODECS`, optionally followed by
    ``+zstd`` (its bytes through the lossless entropy stage), or a sparse ``topk{K}b{B}``
    (:mod:`peer.compression.sparse`); ValueError otherwise."""
    codec = _CODECS.get(name) if isinstance(name, str) else None
    if codec is None and is_sparse(name):
        codec = _CODECS[name] = SparseCodec(sparse_spec(name))
    if codec is None:
        split_wire_name(name)  # every name it accepts is registered: it raises, naming the known codecs
    return codec


def resolve_codec(outer: OuterConfig, codec: Optional[str] = None) -> Codec:
    """The codec a run with outer config ``outer`` exchanges pseudo-gradients with: ``codec`` (a name of
    :data:`models.codec_spec.CODECS` or a sparse one; default: ``outer.codec``, an exchange plan may
    name another) under ``outer.entropy`` (:meth:`models.config.OuterConfig.wire_codec`);
    :class:`models.errors.ConfigError` (a ValueError) for an unknown codec, as the config itself gives."""
    if codec is not None and codec != outer.codec:
        outer = dataclasses.replace(outer, codec=codec)  # checked as the config's own codec is
    return get_codec(outer.wire_codec())
