"""The contracts between peers and the coordinator, and between peers, with their generated stubs.

The ``.proto`` files are the source; ``python -m protos.generate`` rewrites the committed ``*_pb2.py``,
``*_pb2.pyi`` and ``*_pb2_grpc.py`` beside them (a test fails when they drift):

- :mod:`protos.hivepath.coordinator.v1.coordinator_pb2` and ``coordinator_pb2_grpc``: the coordinator's
  gRPC service (exported here as ``coordinator_pb2`` and ``coordinator_pb2_grpc``).
- :mod:`protos.hivepath.peer.v1.net_pb2`: the peers' averaging messages (matchmaking, all-reduce, state).
- :mod:`protos.hivepath.peer.v1.stage_pb2`: stage mode's activations and gradients.
- :mod:`protos.credential`: the admission credential's byte format, signing and verification
  (shared by the coordinator, which signs, and peers, which check each other).
- :mod:`protos.versions`: the release and each contract's protocol version (major.minor), the rule
  for reading another version, and the count of unknown fields read past.

Imports nothing of ``models``, ``peer`` or ``coordinator``.
"""

from protos import credential
from protos.hivepath.coordinator.v1 import coordinator_pb2, coordinator_pb2_grpc

__all__ = ["coordinator_pb2", "coordinator_pb2_grpc", "credential"]
