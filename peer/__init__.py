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
- ``peer.credentials``: admission credentials signed by the coordinator, checked by every member.
- ``peer.partition``: how a module's flat vector is split into parts among reducers.
- Robust aggregation lives in ``peer.averaging`` (``Aggregation``, ``aggregate``, ``reduce_part``;
  ``AverageResult.suspects`` names contributors that were clipped or dropped).

Stage mode (SWARM):
- ``peer.stage_records``, ``peer.stage_wire``, ``peer.stage_server``, ``peer.stage_client``,
  ``peer.stage_node``: pipeline-stage servers of one module and the trainers that drive them.

The peer itself:
- ``peer.node`` (``hivepath peer join``), ``peer.trainer`` (one path assignment),
  ``peer.checkpoint``, ``peer.resources``, ``peer.progress``, ``peer.archive``, ``peer.demo``.
- ``peer.resync``: re-aligning a module with its group after a missed round or a lost fork.
- ``peer.local_status``: the local ``/status`` and ``/healthz`` page behind container health checks.
"""

__all__ = [
    "compression", "outer", "averaging", "diloco", "simulator", "identity", "dht", "records", "matchmaking",
    "allreduce", "net_averager", "state_transfer", "coordinator_client", "node", "trainer", "checkpoint",
    "resources", "progress", "archive", "demo", "credentials", "partition", "stage_records", "stage_wire",
    "stage_server", "stage_client", "stage_node", "spot", "resync", "local_status",
]
