"""What the coordinator client hands the peer: its replies as plain dataclasses, and its errors.

Each error a user can act on is a :class:`~models.errors.HivepathError` with its own exit code
(docs/cli.md); :func:`refusal` maps a gRPC status the coordinator answered to one of them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import grpc

from models.config import OuterConfig, RunConfig
from models.errors import HivepathError
from models.settings import COORDINATOR_PORT, check_address
from protos import versions
from protos.hivepath.coordinator.v1 import coordinator_pb2 as pb

__all__ = [
    "PeerInfo", "WorkAssignment", "JoinInfo", "RunSpec", "Progress", "Evaluation", "HeartbeatReply", "ExchangePlan",
    "CoordinatorUnavailable",
    "CoordinatorRefused", "NotACoordinator", "PeerBanned", "NoAssignmentFits", "IncompatibleRun", "VersionMismatch",
    "refusal", "check_coordinator",
    "check_address",
]


class CoordinatorUnavailable(HivepathError):
    """The coordinator did not answer within ``retry_timeout``."""

    exit_code = 3


class NotACoordinator(HivepathError):
    """Something other than a coordinator answers at the address (another protocol, another gRPC
    service, TLS where plain text was expected or the reverse): a wrong address or flag."""

    exit_code = 2


class CoordinatorRefused(HivepathError):
    """Wrong token or a request the coordinator rejected; the message says which field."""

    exit_code = 3


class PeerBanned(CoordinatorRefused):
    """The coordinator banned this peer id (other peers reported it, or the operator did)."""


class NoAssignmentFits(HivepathError):
    """No work fits this machine's memory."""

    exit_code = 5


class IncompatibleRun(HivepathError):
    """The peer's data or the run spec it received does not match the run."""

    exit_code = 4


class VersionMismatch(HivepathError):
    """This peer and the run cannot work together by version: the coordinator speaks another major
    of a contract, or the run requires a newer release (at join, or since: the peer drained). The
    message names both versions and what to install (docs/upgrade.md)."""

    exit_code = 7


@dataclass(frozen=True)
class PeerInfo:
    """What this peer tells the coordinator at join."""

    peer_id: str
    """libp2p peer id (base58)."""
    device: str
    memory_bytes: int
    tokens_per_s: float
    public_key: bytes = b""
    """libp2p public key behind ``peer_id`` (binds the id to this key at the coordinator)."""
    upload_bps: float = 0.0
    download_bps: float = 0.0
    multiaddrs: tuple[str, ...] = ()
    manifest_hash: str = ""
    archive: bool = False
    """An archive peer: the coordinator gives it no work and hands its addresses out first."""
    role: str = ""
    """The role asked for (``path``, ``stage`` or ``trainer``; '' lets the coordinator decide)."""


@dataclass(frozen=True)
class WorkAssignment:
    """A path to train (``mode == "path"``), a module to serve (``mode == "stage"``) or a path to drive
    through stage servers (``mode == "trainer"``)."""

    mode: str
    path: tuple[int, ...]
    module_id: str
    module_ids: tuple[str, ...]
    inner_steps: int
    """H for this peer (larger than the run's on a slow link); 0: the run's."""
    codec: str
    """The run's pseudo-gradient codec, as the coordinator decided it; '': the run's."""
    reason: str
    version: int

    def outer_config(self, run: OuterConfig) -> OuterConfig:
        """The run's outer config with this assignment's H and codec: what the peer builds its
        :class:`peer.diloco.DiLoCoOptimizer` with (ConfigError for a codec it does not know)."""
        return dataclasses.replace(run, inner_steps=self.inner_steps or run.inner_steps, codec=self.codec or run.codec)

    @classmethod
    def from_proto(cls, m: pb.Assignment) -> "WorkAssignment":
        mode = {pb.MODE_PATH: "path", pb.MODE_ARCHIVE: "archive", pb.MODE_TRAINER: "trainer"}.get(m.mode, "stage")
        return cls(mode, tuple(m.path), m.module_id, tuple(m.module_ids), m.inner_steps, m.codec, m.reason, m.version)

    def same_work(self, other: "WorkAssignment") -> bool:
        """True when ``other`` asks for exactly this work (mode, path or module, H and codec), whatever
        its reason and version say: a re-join that kept the peer's assignment."""
        return dataclasses.replace(other, reason=self.reason, version=self.version) == self

    def label(self) -> str:
        if self.mode in ("path", "trainer"):
            return self.mode + " " + ",".join(map(str, self.path))
        return "archive" if self.mode == "archive" else f"stage {self.module_id}"


@dataclass(frozen=True)
class RunSpec:
    """The run as the coordinator hands it out before joining."""

    run_config: RunConfig
    run_config_hash: str
    lattice_hash: str
    manifest_hash: str
    initial_peers: tuple[str, ...]
    coordinator_public_key: bytes = b""
    """Raw Ed25519 key that signs credentials (see :mod:`peer.network.credentials`)."""


@dataclass(frozen=True)
class JoinInfo:
    """The join reply: the run spec rebuilt as a typed config, bootstrap peers, lease and work."""

    run_config: RunConfig
    run_config_hash: str
    lattice_hash: str
    manifest_hash: str
    initial_peers: tuple[str, ...]
    lease_id: str
    lease_duration: float
    heartbeat_interval: float
    assignment: WorkAssignment
    rejoined: bool
    credential: bytes = b""
    """This peer's admission credential (renewed later by heartbeats: read :attr:`CoordinatorClient.credential`)."""
    coordinator_public_key: bytes = b""
    """Raw Ed25519 key that signs every peer's credential."""
    reachability: str = ""
    """The coordinator's dial-back of our announced addresses: ``reachable``, ``relayed``, ``unreachable``
    or ``not_listening`` ('' from a coordinator that does not dial back)."""
    reachable_addr: str = ""
    observed_addr: str = ""
    """Where the coordinator saw our join come from (behind NAT: the router's address)."""
    relays: tuple[str, ...] = ()
    """When unreachable: multiaddrs of peers the coordinator chose to relay for us."""


@dataclass(frozen=True)
class Progress:
    """One module's progress for a heartbeat."""

    module_id: str
    round: int
    tokens: int
    loss: float


@dataclass(frozen=True)
class Evaluation:
    """One path's validation bits per byte for a heartbeat (an archive peer's only)."""

    path: tuple[int, ...]
    bpb: float
    round: int = 0
    """The lowest round among the path's modules in the snapshot evaluated."""


@dataclass(frozen=True)
class ExchangePlan:
    """One module's exchange plan from the coordinator: every holder uses ``inner_steps`` and ``codec``
    in the module's rounds from ``from_round`` on (until a plan with a later ``from_round``)."""

    module_id: str
    inner_steps: int
    codec: str
    from_round: int
    reason: str = ""
    overlap: bool = False
    """The holders' exchanges run behind their next round (a path peer's overlap mode)."""

    @classmethod
    def from_proto(cls, m: pb.ModulePlan) -> "ExchangePlan":
        return cls(m.module_id, m.inner_steps, m.codec, m.from_round, m.reason, m.overlap)


@dataclass(frozen=True)
class HeartbeatReply:
    lease_remaining: float
    assignment: Optional[WorkAssignment]
    """A new assignment to switch to (None: keep the current one)."""
    drain: bool
    drain_reason: str = ""
    rejoined: bool = False
    """True when the lease was gone and the client joined again to get this reply."""
    join: Optional[JoinInfo] = None
    credential: bytes = b""
    """A renewed credential (empty: the current one stays valid)."""
    required_version: str = ""
    """Set with ``drain``: the run now requires this release or newer, above ours."""
    refused: bool = False
    """Set with ``drain``: a re-join (our lease was gone) was refused by version (:class:`VersionMismatch`,
    whose message is ``drain_reason``): the run no longer takes this peer as it is."""
    plans: tuple[ExchangePlan, ...] = ()
    """The exchange plans of the modules this peer trains (empty: none, or nothing said)."""


def check_coordinator(reply: pb.JoinResponse) -> None:
    """:class:`VersionMismatch` when the coordinator that answered a join speaks another major of the
    coordinator protocol than this peer (one that states none speaks 1.0)."""
    why = versions.refusal("coordinator", reply.protocols.get("coordinator", ""),
                           who=f"the coordinator (hivepath {reply.coordinator_version or 'before 0.2.0'})",
                           us="this peer")
    if why:
        raise VersionMismatch(f"{why}; this peer cannot take part in its run")


def refusal(code: grpc.StatusCode, detail: str, address: str = "the coordinator") -> HivepathError:
    """The error a user can act on for a status the server at ``address`` answered."""
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return NotACoordinator(f"{address}: a gRPC server answers, but not hivepath's coordinator service "
                               f"({detail}); the coordinator's gRPC port is {COORDINATOR_PORT} unless "
                               "'coordinator serve --port' says otherwise")
    if code == grpc.StatusCode.FAILED_PRECONDITION and detail.startswith("capabilities.memory_bytes"):
        return NoAssignmentFits(f"no work fits this machine: {detail}")
    if code == grpc.StatusCode.FAILED_PRECONDITION and detail.startswith("version: "):
        return VersionMismatch(f"the coordinator refused this peer: {detail[len('version: '):]}")
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        return IncompatibleRun(f"the coordinator refused this peer: {detail}")
    if code == grpc.StatusCode.PERMISSION_DENIED:
        return PeerBanned(f"the coordinator refused this peer: {detail}")
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return CoordinatorRefused(f"the coordinator refused the run token: {detail}")
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        err = CoordinatorRefused(f"the coordinator rejected a field: {detail}")
        err.exit_code = 2
        return err
    return CoordinatorRefused(f"the coordinator answered {code.name}: {detail}")
