"""Circuit relays for peers behind NAT (libp2p circuit relay v2, served by hivemind's p2p daemon).

Every peer's p2p daemon is a relay (circuit relay v2). A peer that the coordinator found unreachable
at join is handed a few reachable peers as relays; it restarts its DHT with them as static relays,
reserves a slot on each, and announces the circuits ``<relay multiaddr>/p2p-circuit`` as its only
addresses. Peers that dial it then go through a relay, and the daemons' hole punching (DCUtR, on with
AutoNAT) may upgrade such a connection to a direct one where both sides have public addresses.

The relay's limits. hivemind's daemon configures a relay service with generous limits (4 GiB each
way and 30 minutes per relayed connection), but go-libp2p starts that service only once AutoNAT
finds the host publicly reachable, and the daemon also registers a second relay service with
go-libp2p's defaults at start: 128 KiB each way and 2 minutes per relayed connection, after which
the relay resets it (the next dial opens a new one). On the internet a public peer's AutoNAT should
confirm it within minutes, and the generous service then takes the protocol over (not measured here:
no public addresses on this machine); between private addresses (a LAN, the tests' namespaces)
AutoNAT never does, and each relayed connection carries at most 128 KiB.
Forcing the reachability public does not help: the two services then race for the protocol and the
default one often wins. So the averaging keeps bulk off relays: a
relayed peer reduces nothing next to a reachable member (``RELAYED_SHARE``), and its own parts go
over its direct connection to the reducer. A module's state, which a newcomer may have to fetch from
a relayed holder, crosses a relay in pieces: a transfer cut by a reset resumes from the byte it
reached, for the same state (``peer.averaging.state_transfer``). A group of relayed members alone knows it (each member's
join request says whether it is relayed, and the leader's group lists them): their parts go in pieces
of at most 32 KiB (``peer.averaging.partition.RELAY_PIECE_BYTES``), one at a time to each member, and
a piece cut by a reset is sent again over the next connection (``ReductionServer._ask_again``;
``tests/peer/network/test_relayed_peers.py`` averages a 300k-parameter module through two relayed peers, round after round).

hivemind's ``P2P.create`` has no argument for the daemon's ``-relayDiscovery``, and with discovery on
the daemon's auto-relay waits for four relay candidates, or three minutes, before it reserves any
slot (go-libp2p's boot delay). With discovery off and ``-trustedRelays`` given, the relays are static
and reserved within a second. :func:`use_static_relays` adds ``-relayDiscovery=0`` to every daemon
this process starts with trusted relays (the DHT runs in a forked child, which inherits it).
"""

from __future__ import annotations

import threading
from typing import Any, Sequence

__all__ = ["circuit_addrs", "use_static_relays"]

_lock = threading.Lock()
_installed = False


def circuit_addrs(relays: Sequence[str]) -> list[str]:
    """The addresses a peer behind NAT announces: a circuit through each relay (``.../p2p/RELAY``)."""
    return [f"{r.rstrip('/')}/p2p-circuit" for r in relays if "/p2p/" in r and "/p2p-circuit" not in r]


def use_static_relays() -> None:
    """From now on, a p2p daemon started with trusted relays uses them as static relays (see the module)."""
    global _installed
    from hivemind.p2p import P2P

    with _lock:
        if _installed:
            return
        build = P2P._make_process_args

        def make_process_args(*args: Any, **kwargs: Any) -> list[str]:
            if kwargs.get("trustedRelays"):
                kwargs["relayDiscovery"] = False
            return build(*args, **kwargs)

        P2P._make_process_args = staticmethod(make_process_args)
        _installed = True
