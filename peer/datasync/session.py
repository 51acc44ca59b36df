"""How a data command (``hivepath data serve|fetch|info``) reaches the swarm without joining the run.

A seeder or fetcher is not a trainer: it takes no lease and sends no heartbeats. It needs only DHT
bootstrap peers, from ``--initial-peers`` and/or the coordinator's run spec (``GetRunSpec``, which
also names the run's manifest hash, so ``--coordinator`` alone is enough to fetch the run's data).
:func:`join_swarm` starts this process's DHT node from them (:func:`peer.network.start_dht`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from models.errors import HivepathError
from peer.network import DHTOptions, PeerDHT, start_dht

__all__ = ["SwarmAccess", "join_swarm"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SwarmAccess:
    """Where a data command finds the swarm, and how its own DHT node listens."""

    initial_peers: tuple[str, ...] = ()
    """DHT bootstrap multiaddrs given on the command line."""
    coordinator: str = ""
    """The coordinator's ``host:port``: its run spec adds bootstrap peers and names the manifest hash."""
    token: str = ""
    """The run token (with ``coordinator``)."""
    tls_ca: Optional[str] = None
    """CA certificate of a TLS coordinator."""
    host_maddrs: tuple[str, ...] = ("/ip4/0.0.0.0/tcp/0",)
    """Multiaddrs this node listens on."""
    announce_maddrs: tuple[str, ...] = ()
    """Multiaddrs other peers should dial."""
    identity: Optional[Path] = None
    """Identity key file for a stable peer id (a fresh one when None)."""

    def __post_init__(self) -> None:
        for flag, addrs in (("--initial-peers", self.initial_peers), ("--host-maddrs", self.host_maddrs),
                            ("--announce-maddrs", self.announce_maddrs)):
            for addr in addrs:
                _check_multiaddr(flag, addr)


def _check_multiaddr(flag: str, text: str) -> None:
    from hivemind.utils.multiaddr import Multiaddr

    try:
        Multiaddr(text)
    except Exception as e:  # the multiaddr package raises several types, all meaning "malformed"
        raise HivepathError(f"{flag} {text!r} is not a multiaddr ({e}); write one like "
                            "/ip4/203.0.113.5/tcp/7710/p2p/12D3KooW...") from None


def join_swarm(access: SwarmAccess, need_peers: bool) -> tuple[PeerDHT, str]:
    """This process's DHT node, bootstrapped from the flags and the coordinator; and the run's
    manifest hash ('' without a coordinator). ``need_peers``: refuse to start a swarm of one (a
    fetcher alone finds no seeder)."""
    peers, run_hash = list(access.initial_peers), ""
    if access.coordinator:
        from peer.coordinator_client import CoordinatorClient

        client = CoordinatorClient(access.coordinator, access.token, tls_ca=access.tls_ca, retry_timeout=30.0)
        try:
            spec = client.run_spec()
        finally:
            client.close()
        peers += [p for p in spec.initial_peers if p not in peers]
        run_hash = spec.manifest_hash
    if need_peers and not peers:
        raise HivepathError("no peers to reach the swarm through: pass --initial-peers (the multiaddrs 'hivepath data "
                            "serve' prints) or --coordinator HOST:PORT")
    dht = start_dht(DHTOptions(initial_peers=tuple(peers), host_maddrs=access.host_maddrs,
                               announce_maddrs=access.announce_maddrs,
                               identity_path=str(access.identity) if access.identity else None))
    return dht, run_hash
