"""gRPC contracts between peers and the coordinator, with their generated (committed) stubs.

``protos/hivepath/coordinator/v1/coordinator.proto`` is the source; ``python -m protos.generate``
rewrites the generated ``*_pb2.py``, ``*_pb2.pyi`` and ``*_pb2_grpc.py`` beside it (and
``peer/net_pb2.py``/``.pyi`` from ``peer/net.proto``, the peers' averaging messages).

- :mod:`protos.hivepath.coordinator.v1.coordinator_pb2` (messages, exported as ``coordinator_pb2``)
- :mod:`protos.hivepath.coordinator.v1.coordinator_pb2_grpc` (stubs, exported as ``coordinator_pb2_grpc``)
- :mod:`protos.credential`: the admission credential's byte format, signing and verification
  (shared by the coordinator, which signs, and peers, which check each other)
"""

from protos import credential
from protos.hivepath.coordinator.v1 import coordinator_pb2, coordinator_pb2_grpc

__all__ = ["coordinator_pb2", "coordinator_pb2_grpc", "credential"]
