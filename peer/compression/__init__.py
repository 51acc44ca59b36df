"""Codecs: a flat fp32 vector to bytes and back, bit-identically on every machine.

The pseudo-gradient's codecs, as specified by :mod:`models.codec_spec` and :mod:`models.sparse_spec`
(names, :data:`BLOCK`, layouts and sizes), one module per family (hivemind's ``compression`` package
is the model):

- ``base``: :class:`Codec`, what every codec is (encode, decode, round trips, the reducer's answer).
- ``quantizers``: the value codecs: none (fp32), fp16, and the blockwise absmax int8 and int4.
- ``entropy``: the lossless zstd stage over a value codec's bytes (``int8+zstd``).
- ``sparse``: :class:`SparseCodec`, per-chunk top-k at 2 or 4 bits (``topk{K}b{B}``), averages sent exactly.
- ``codecs``: the codecs by wire name (:func:`get_codec`) and the one rule by which a run's outer
  config becomes its codec (:func:`resolve_codec`: codec and entropy stage), which peers
  (``peer.diloco``) and the simulator (``peer.simulator``) both resolve theirs with.
- ``mean``: :func:`weighted_mean`, the fp32 weighted mean of decoded values in a fixed order.
- ``error_feedback``: :class:`ErrorFeedback`, what the codec dropped carried into the next round.
- ``prepared``: :class:`Prepared`, a vector encoded in a thread while its group forms, cut into
  block-aligned parts as the all-reduce needs them.
- ``phases``: the CPU seconds of codec work by phase (encode, entropy, decode, reduce, copy), for benchmarks.
- ``activation``: the codecs of activations and gradients in stage mode by name
  (:data:`ACTIVATION_CODECS`: the value codecs on the flat vector, per-token codes behind zstd).

Imports nothing of ``peer``: only ``models``.
"""

from models.codec_spec import BLOCK
from peer.compression.base import Codec
from peer.compression.codecs import get_codec, resolve_codec
from peer.compression.entropy import EntropyCoded
from peer.compression.error_feedback import ErrorFeedback
from peer.compression.mean import weighted_mean
from peer.compression.prepared import Prepared
from peer.compression.sparse import SparseCodec
from peer.compression.activation import ACTIVATION_CODECS, ActivationCodec

__all__ = [
    "BLOCK", "Codec", "get_codec", "resolve_codec", "EntropyCoded", "ErrorFeedback", "weighted_mean", "Prepared",
    "SparseCodec", "ACTIVATION_CODECS", "ActivationCodec",
]
