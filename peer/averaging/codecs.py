"""The pseudo-gradient codecs by name: the one place a codec name becomes a :class:`Codec`.

DiLoCo (Douillard et al. 2023) exchanges one pseudo-gradient per outer step; these codecs shrink it.
The names, layouts and sizes are specified in :mod:`models.codec_spec` (torch-free, so the run
config and the coordinator read them too); the value codecs are in :mod:`peer.averaging.quantizers`
and the lossless entropy stage in :mod:`peer.averaging.entropy`.

A wire codec name is a codec of :data:`models.codec_spec.CODECS`, optionally followed by an entropy
stage (``int8+zstd``). A peer resolves its run's wire codec once, when its
:class:`peer.diloco.DiLoCoOptimizer` is built, and passes the :class:`Codec` down to the averager;
the name travels on the wire only so that a reducer can refuse a part encoded with another codec.
"""

from __future__ import annotations

from models.codec_spec import CODECS, ENTROPY_STAGES, split_wire_name, wire_name
from models.sparse_spec import is_sparse, sparse_spec
from peer.averaging.entropy import ENTROPY_CODERS
from peer.averaging.quantizers import VALUE_CODECS, Codec
from peer.averaging.sparse import SparseCodec

__all__ = ["get_codec"]

_CODECS: dict[str, Codec] = {c.name: c for c in VALUE_CODECS}
assert tuple(_CODECS) == CODECS
assert set(ENTROPY_CODERS) == set(ENTROPY_STAGES) - {"none"}
_CODECS.update({wire_name(name, stage): coder(_CODECS[name]) for name in CODECS
                for stage, coder in ENTROPY_CODERS.items()})


def get_codec(name: str) -> Codec:
    """The codec called ``name``: one of :data:`models.codec_spec.CODECS`, optionally followed by
    ``+zstd`` (its bytes through the lossless entropy stage), or a sparse ``topk{K}b{B}``
    (:mod:`peer.averaging.sparse`); ValueError otherwise."""
    codec = _CODECS.get(name) if isinstance(name, str) else None
    if codec is None and is_sparse(name):
        codec = _CODECS[name] = SparseCodec(sparse_spec(name))
    if codec is None:
        split_wire_name(name)  # every name it accepts is registered: it raises, naming the known codecs
    return codec
