"""The volunteer node. Submodules are imported where needed, so importing ``peer`` alone pulls in
neither torch nor hivemind.

Numerics (pure torch, identical bits on every replica):
- ``peer.compression``: pseudo-gradient codecs (none, fp16, int8, int4; blockwise absmax) and
  ``ErrorFeedback``.
- ``peer.outer``: ``OuterOptimizer``, DiLoCo's Nesterov step on a CPU fp32 global copy.
- ``peer.averaging``: the ``ModuleAverager`` contract, ``AverageResult``, the in-process
  ``LocalAverager`` and the reduction rule (``weighted_mean``, ``reduce_encoded``).
- ``peer.diloco``: ``DiLoCoOptimizer``, the optimizer-like wrapper running outer rounds per module.
- ``peer.simulator``: the single-process K-worker DiLoCo simulator behind ``hivepath train-local``.

Network:
- ``peer.identity``, ``peer.dht``, ``peer.records``: identity files, DHT start-up, DHT record schemas.
- ``peer.matchmaking``, ``peer.allreduce``, ``peer.net_averager``: groups per (module, round) and the
  bit-identical all-reduce over hivemind's P2P; ``peer.state_transfer`` serves module states.
- ``peer.coordinator_client``: the coordinator's gRPC client with retries.

The peer itself:
- ``peer.node`` (``hivepath peer join``), ``peer.trainer`` (one path assignment),
  ``peer.checkpoint``, ``peer.resources``, ``peer.progress``, ``peer.archive``, ``peer.demo``.
"""

__all__ = [
    "compression", "outer", "averaging", "diloco", "simulator", "identity", "dht", "records", "matchmaking",
    "allreduce", "net_averager", "state_transfer", "coordinator_client", "node", "trainer", "checkpoint",
    "resources", "progress", "archive", "demo",
]
