"""Which peers a run admits by version: pure decisions, and the versions of the live peers.

At join a peer states its release (``JoinRequest.peer_version``) and the protocol version of each
contract it speaks (``JoinRequest.protocols``, :mod:`protos.versions`). :func:`join_refusal` refuses
one that speaks another major of any contract (it could not read the others' records or messages),
and one whose release is below the run config's ``[coordinator] min_peer_version``. A peer already in
the run when the operator raises ``min_peer_version`` (a coordinator restarted with a new run
config) learns it from its next heartbeat: :func:`upgrade_reason` makes the coordinator tell it to
drain, with the release to install (``HeartbeatResponse.required_version``).
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Mapping

from protos import versions

__all__ = ["join_refusal", "upgrade_reason", "follows_plans", "PeerVersions", "MAX_PROTOCOLS"]

MAX_PROTOCOLS = 32
"""Most contracts a join may state (the coordinator knows fewer; more is a malformed request)."""


def _install(least: str) -> str:
    return f"install hivepath {least} or newer (pip install -U 'hivepath>={least}', or that release's image)"


def join_refusal(peer_version: str, protocols: Mapping[str, str], min_peer_version: str) -> str:
    """Why a peer of release ``peer_version`` ('' when it states none) speaking ``protocols``
    (contract -> version; a contract it does not name: 1.0) is refused, in one line; '' to admit it."""
    for name in versions.NAMES:
        why = versions.refusal(name, protocols.get(name, ""), who="this peer", us="the coordinator")
        if why:
            return why
    if versions.older_than(peer_version, min_peer_version):
        return (f"this peer runs hivepath {peer_version or 'older than 0.2.0 (it states no version)'} and the run "
                f"requires {min_peer_version} or newer ([coordinator] min_peer_version); {_install(min_peer_version)} "
                "and join again")
    return ""


def follows_plans(protocols: Mapping[str, str]) -> bool:
    """Whether a peer stating ``protocols`` at join reads exchange plans (``HeartbeatResponse.plans``,
    coordinator protocol 1.2): a peer of 1.1 or of a release that states none ignores them."""
    try:
        return versions.parse_version(protocols.get("coordinator", "")) >= (1, 2)
    except ValueError:
        return False


def upgrade_reason(peer_version: str, min_peer_version: str) -> str:
    """Why a peer already in the run must leave now that the run requires ``min_peer_version``; ''
    when its release is recent enough."""
    if not versions.older_than(peer_version, min_peer_version):
        return ""
    return (f"the run now requires hivepath {min_peer_version} or newer and this peer runs "
            f"{peer_version or 'a release older than 0.2.0'}; {_install(min_peer_version)}, then join again")


class PeerVersions:
    """Peer id -> the release it stated at join or in its latest heartbeat (kept in memory: every
    heartbeat states it again, so a restarted coordinator knows it within one heartbeat interval)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._of: dict[str, str] = {}

    def note(self, peer_id: str, release: str) -> None:
        with self._lock:
            self._of[peer_id] = release

    def get(self, peer_id: str) -> str:
        with self._lock:
            return self._of.get(peer_id, "")

    def counts(self, peer_ids: list[str]) -> dict[str, int]:
        """Release ('' for not stated) -> how many of ``peer_ids`` run it."""
        with self._lock:
            return dict(Counter(self._of.get(p, "") for p in peer_ids))
