"""Averaging one module's pseudo-gradient among its holders, bit-identically.

The contract and the rule:
- ``contract``: :class:`ModuleAverager` (what the DiLoCo optimizer calls), :class:`AverageResult`.
- ``codecs``: the pseudo-gradient codecs by wire name (:func:`get_codec`: none, fp16, int8, int4, each
  optionally zstd-coded, and the sparse ``topk{K}b{B}``), as specified by :mod:`models.codec_spec`
  and :mod:`models.sparse_spec` (names, :data:`BLOCK`, sizes);
  implemented by ``quantizers`` (the value codecs, :class:`Codec`), ``entropy`` (the zstd stage) and
  ``sparse`` (:class:`SparseCodec`: per-chunk top-k at 2 or 4 bits, averages sent exactly).
- ``vectors``: :func:`flatten` / :func:`unflatten` / :func:`flat_view`, a module's tensors as the flat
  vector codecs encode.
- ``memory``: round-sized vectors reused between rounds and glibc's thresholds pinned (page faults).
- ``error_feedback``: :class:`ErrorFeedback`, what the codec dropped carried into the next round.
- ``aggregation``: the reduction rule every reducer applies (weighted mean, trimmed mean, centered
  clipping; :func:`reduce_part`), in a fixed order so every member gets the same bytes.
- ``local``: :class:`LocalAverager`, the contract between threads of one process.

Over the network (hivemind's P2P and DHT):
- ``matchmaking``: groups per (module, round) from holder records and group declarations.
- ``compat``: :func:`wire_key`, the averaging bytes key: only holders of one key are grouped
  (releases whose exchanges give other bytes average apart).
- ``group_join``: the leader/follower protocol that turns a round's declared members into one group.
- ``partition``: how a module's flat vector is cut into block-aligned parts among reducers.
- ``reducer``: the reducer's half of the all-reduce: validating, reducing and answering the parts it reduces.
- ``allreduce``: :class:`ReductionServer`, a member's half of the all-reduce of one group's parts, with
  fallback reducers.
- ``hierarchy``: split rounds (``outer.max_group_size``): a widely held module averaged in buckets, a top
  group of their delegates, and the top group's bytes passed down each bucket's tree.
- ``state_transfer``: serving and fetching a module's :class:`~peer.outer.ModuleState` (newcomers, re-sync).
- ``net_averager``: :class:`NetAverager`, the contract over all of the above.
- ``phases``: the exchange's CPU seconds by phase (encode, entropy, decode, reduce, copy), for benchmarks.

Imports ``peer.outer`` and ``peer.network``.
"""

from models.codec_spec import BLOCK
from peer.averaging.aggregation import (AGGREGATORS, MEAN, Aggregation, Reduced, aggregate, encode_aggregate, reduce_encoded,
                                        reduce_part, weighted_mean)
from peer.averaging.codecs import get_codec
from peer.averaging.contract import AverageResult, ModuleAverager, SuspectHook
from peer.averaging.error_feedback import ErrorFeedback
from peer.averaging.quantizers import Codec
from peer.averaging.sparse import SparseCodec
from peer.averaging.vectors import flat_view, flatten, unflatten
from peer.averaging.local import LocalAverager, LocalMember
from peer.averaging.net_averager import NetAverager
from peer.averaging.state_transfer import StateTransferError, fetch_module_state

__all__ = [
    "AGGREGATORS", "MEAN", "Aggregation", "Reduced", "aggregate", "encode_aggregate", "reduce_encoded", "reduce_part",
    "weighted_mean", "SparseCodec",
    "BLOCK", "Codec", "ErrorFeedback", "flat_view", "flatten", "get_codec", "unflatten", "AverageResult", "ModuleAverager",
    "SuspectHook", "LocalAverager", "LocalMember", "NetAverager", "StateTransferError", "fetch_module_state",
]
