"""Why the coordinator refuses a request; the servicer maps each to one gRPC status code."""

from __future__ import annotations

from models.errors import HivepathError

__all__ = [
    "RequestError",
    "InvalidArgument",
    "Unauthenticated",
    "LeaseNotFound",
    "NoFit",
    "Incompatible",
    "Overloaded",
    "PeerNotFound",
    "Banned",
    "VersionRefused",
]


class RequestError(HivepathError):
    """A request the coordinator refuses; ``code`` names the gRPC status (grpc.StatusCode member)."""

    code = "INVALID_ARGUMENT"


class InvalidArgument(RequestError):
    """A field is malformed or out of range; the message names the field."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field}: {problem}")
        self.field = field


class Unauthenticated(RequestError):
    code = "UNAUTHENTICATED"
    exit_code = 3


class LeaseNotFound(RequestError):
    """Unknown or expired lease: the peer should join again."""

    code = "NOT_FOUND"


class PeerNotFound(RequestError):
    code = "NOT_FOUND"


class NoFit(RequestError):
    """No work fits the peer's memory."""

    code = "FAILED_PRECONDITION"
    exit_code = 5


class Incompatible(RequestError):
    """The peer's data does not match the run."""

    code = "FAILED_PRECONDITION"
    exit_code = 4


class Overloaded(RequestError):
    code = "RESOURCE_EXHAUSTED"


class Banned(RequestError):
    """The peer is banned from the run (reported by other peers, or by the operator)."""

    code = "PERMISSION_DENIED"
    exit_code = 3


class VersionRefused(RequestError):
    """The peer speaks another major version of a contract, or runs a release below the run's
    ``min_peer_version``; the message names both versions and what to install."""

    code = "FAILED_PRECONDITION"
    exit_code = 7

    def __init__(self, why: str):
        super().__init__(f"version: {why}")
