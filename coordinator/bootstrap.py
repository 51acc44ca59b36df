"""``Bootstrap``: whom a joining peer dials first: live peers' DHT addresses, and relays for a peer behind NAT.

A joining peer's DHT bootstraps from the multiaddrs of a few live peers (archives first, since they live
longest, then the most recently joined); a peer nobody can dial is handed, as its circuit relays, the
reachable live peers that carry the fewest relayed peers. This keeps the dialable addresses of the live
peers in join order. Separate from :mod:`coordinator.core`, which admits peers and says when one comes
or goes: this only answers whom to dial. Called under the coordinator's lock, like the rest of its state.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Mapping

from coordinator.reachability import RELAYS_PER_PEER, relay_load
from coordinator.records import MODE_ARCHIVE, Assignment, PeerRecord
from coordinator.settings import CoordinatorSettings

__all__ = ["Bootstrap"]


class Bootstrap:
    """The live peers' dialable multiaddrs (``peers``: the coordinator's peer table, read for the
    relays' reachable addresses); ``assignments`` (peer id -> its work) says which are archives."""

    def __init__(self, peers: Mapping[str, PeerRecord], settings: CoordinatorSettings):
        self._peers = peers
        self.settings = settings
        self._live_addrs: OrderedDict[str, tuple[str, ...]] = OrderedDict()

    def add(self, peer_id: str, multiaddrs: tuple[str, ...]) -> None:
        """``peer_id`` is live and dialable at ``multiaddrs``: the most recently joined from now."""
        self._live_addrs[peer_id] = multiaddrs
        self._live_addrs.move_to_end(peer_id)

    def drop(self, peer_id: str) -> None:
        """``peer_id`` left, drained, expired or joined again: nobody bootstraps from it now."""
        self._live_addrs.pop(peer_id, None)

    def initial_peers(self, joining: str, assignments: Mapping[str, Assignment]) -> list[str]:
        """DHT bootstrap multiaddrs for ``joining`` ('' for anyone): archives first, then the most
        recently joined, up to ``settings.initial_peers`` peers."""
        out: list[str] = []
        archives = [p for p in self._live_addrs if (a := assignments.get(p)) and a.mode == MODE_ARCHIVE]
        for peer_id in archives + [p for p in reversed(self._live_addrs) if p not in archives]:
            if len(out) >= self.settings.initial_peers:
                break
            if peer_id == joining:
                continue
            # every address: the first may be loopback inside a container, useless to anyone else
            for addr in self._live_addrs[peer_id]:
                out.append(with_peer_id(addr, peer_id))
        return out

    def relays_for(self, joining: str, assignments: Mapping[str, Assignment]) -> list[str]:
        """One multiaddr each of the :data:`RELAYS_PER_PEER` live reachable peers carrying the fewest
        relayed peers (archives first among equals: they live longest)."""
        load = relay_load([p.reachable_addr for p in self._peers.values()
                           if p.state == "active" and p.peer_id != joining])
        archives = {p for p in self._live_addrs if (a := assignments.get(p)) and a.mode == MODE_ARCHIVE}
        candidates = [p for p in self._live_addrs if p != joining and self._peers[p].reachable_addr]
        candidates.sort(key=lambda p: (load.get(p, 0), p not in archives))
        return [with_peer_id(self._peers[p].reachable_addr, p) for p in candidates[:RELAYS_PER_PEER]]


def with_peer_id(addr: str, peer_id: str) -> str:
    """``addr`` as others dial it: ending in ``/p2p/<peer id>``."""
    return addr if "/p2p/" in addr else f"{addr}/p2p/{peer_id}"
