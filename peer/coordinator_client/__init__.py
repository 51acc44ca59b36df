"""The peer's side of the coordinator API (gRPC): join, heartbeats, status, bandwidth probes.

- ``client``: :class:`CoordinatorClient`, synchronous, retrying with backoff while the coordinator is away.
- ``calls``: the channel to the coordinator and every call's retries, with a diagnosis of an address
  where no coordinator answers.
- ``messages``: the replies as dataclasses (:class:`WorkAssignment`, :class:`HeartbeatReply`, ...) and
  the errors a user can act on (:class:`CoordinatorRefused`, :class:`PeerBanned`, ...).
- ``transport``: the heartbeat stream, keepalive options and bandwidth probes.

Imports no torch and no hivemind (the coordinator's image tests import it), and nothing else of ``peer``.
"""

from peer.coordinator_client.client import CoordinatorClient
from peer.coordinator_client.messages import (
    CoordinatorRefused,
    CoordinatorUnavailable,
    Evaluation,
    ExchangePlan,
    HeartbeatReply,
    IncompatibleRun,
    JoinInfo,
    NoAssignmentFits,
    NotACoordinator,
    PeerBanned,
    PeerInfo,
    Progress,
    RunSpec,
    VersionMismatch,
    WorkAssignment,
    check_address,
)

__all__ = [
    "CoordinatorClient", "CoordinatorRefused", "CoordinatorUnavailable", "Evaluation", "ExchangePlan", "HeartbeatReply",
    "IncompatibleRun",
    "JoinInfo", "NoAssignmentFits", "NotACoordinator", "PeerBanned", "PeerInfo", "Progress", "RunSpec", "VersionMismatch",
    "WorkAssignment", "check_address",
]
