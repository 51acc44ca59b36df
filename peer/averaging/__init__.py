"""Averaging one module's pseudo-gradient among its holders, bit-identically.

The codecs it exchanges with are :mod:`peer.compression`'s (a :class:`~peer.compression.Codec`, resolved
once by whoever calls the averager).

The contract and the rule:
- ``contract``: :class:`ModuleAverager` (what the DiLoCo optimizer calls), :class:`AverageResult`.
- ``vectors``: :func:`flatten` / :func:`unflatten` / :func:`flat_view`, a module's tensors as the flat
  vector codecs encode.
- ``memory``: round-sized vectors reused between rounds and glibc's thresholds pinned (page faults).
- ``aggregation``: the reduction rule every reducer applies (weighted mean, trimmed mean, centered
  clipping; :func:`reduce_part`), in a fixed order so every member gets the same bytes.
- ``local``: :class:`LocalAverager`, the contract between threads of one process.

Over the network (hivemind's P2P and DHT):
- ``group_decision``: who forms a round's group, as pure functions of what the holders declared (whom
  a gather waits for, forks kept by majority, who leads; the time passed in): ``Match``, ``LONE``.
- ``matchmaking``: groups per (module, round) from holder records and group declarations: the DHT reads
  and writes, pushes and waits around ``group_decision``.
- ``declaration_push``: the ``Declare`` rpc: a member's declaration pushed to the module's live holders
  before its DHT record lands, and the declarations pushed to us.
- ``holder_memory``: what earlier reads said of each module's holders (missed, vanished, waited for).
- ``compat``: :func:`wire_key`, the averaging bytes key: only holders of one key are grouped
  (releases whose exchanges give other bytes average apart).
- ``group_join``: the leader/follower protocol that turns a round's declared members into one group.
- ``partition``: how a module's flat vector is cut into block-aligned parts among reducers.
- ``reducer``: the reducer's half of the all-reduce: validating, reducing and answering the parts it reduces.
- ``allreduce``: :class:`ReductionServer`, a member's half of the all-reduce of one group's parts, with
  fallback reducers.
- ``group_round``: one member's round of a group's all-reduce as an object with a state: the cut, the
  pipeline of segments (``IN_FLIGHT``), the outcome.
- ``hierarchy``: split rounds (``outer.max_group_size``): a widely held module averaged in buckets, a top
  group of their delegates, and the top group's bytes passed down each bucket's tree.
- ``result_relay``: the ``Result`` rpc that carries a split round's average down each group's tree,
  checked part by part against the digest the top group agreed on.
- ``split_round``: one holder's side of a split round: its bucket, the climb of the bucket's mean to the top
  group, and the round's average back down the tree, against the round's deadlines.
- ``state_transfer``: serving and fetching a module's :class:`~peer.outer.ModuleState` (newcomers, re-sync).
- ``holder_records``: this peer's holder and archive records on the DHT, announced, refreshed and withdrawn.
- ``pacing``: whether another holder already waits for a round we still compute (the training loop's
  cue to end its round).
- ``net_averager``: :class:`NetAverager`, the contract over all of the above.

Imports ``peer.compression``, ``peer.outer`` and ``peer.network``.
"""

from models.codec_spec import BLOCK
from peer.averaging.aggregation import (AGGREGATORS, MEAN, Aggregation, Reduced, aggregate, encode_aggregate, reduce_encoded,
                                        reduce_part)
from peer.averaging.contract import AverageResult, ModuleAverager, SuspectHook
from peer.averaging.vectors import flat_view, flatten, unflatten
from peer.averaging.local import LocalAverager, LocalMember
from peer.averaging.net_averager import NetAverager
from peer.averaging.state_transfer import StateTransferError, fetch_module_state

__all__ = [
    "AGGREGATORS", "MEAN", "Aggregation", "Reduced", "aggregate", "encode_aggregate", "reduce_encoded", "reduce_part",
    "BLOCK", "flat_view", "flatten", "unflatten", "AverageResult", "ModuleAverager",
    "SuspectHook", "LocalAverager", "LocalMember", "NetAverager", "StateTransferError", "fetch_module_state",
]
