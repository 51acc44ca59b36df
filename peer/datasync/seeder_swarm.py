"""``SeederSwarm``: the seeders of one dataset as one fetch knows them, found on the DHT.

A fetch asks every seeder that announces a file (:mod:`peer.datasync.records`), the least busy first;
a seeder that fails rests a while (doubling, at most :data:`MAX_REST` seconds), one that sends bytes
not matching the manifest is banned for the rest of the fetch and reported. Separate from
:mod:`peer.datasync.fetcher`, which decides what to ask for: this is whom to ask.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Iterable, Optional, Sequence

from peer.datasync.records import SeederRecord, seeders_from_value, seeders_key
from peer.network import unwrap_dht

__all__ = ["SeederSwarm", "KnownSeeder", "BadSeederCallback", "find_seeders", "MAX_REST"]

log = logging.getLogger(__name__)

MAX_REST = 30.0
"""Most seconds a seeder rests after failed requests in a row."""

BadSeederCallback = Callable[[str, str], None]
"""``(peer_id, what it did)``: a seeder sent bytes that do not match the manifest."""


async def find_seeders(dht: Any, manifest_hash: str) -> dict[str, SeederRecord]:
    """The valid seeder records of a dataset on the DHT, by peer id."""
    found = await unwrap_dht(dht).get(seeders_key(manifest_hash), latest=True, return_future=True)
    return seeders_from_value(found)


class KnownSeeder:
    """A fetcher's view of one seeder."""

    def __init__(self, peer_id: str):
        self.peer_id = peer_id
        self.holds: set[str] = set()
        self.inflight = 0
        self.failures = 0
        self.rest_until = 0.0
        self.banned = False

    def ready(self, now: float, limit: int) -> bool:
        return not self.banned and self.inflight < limit and now >= self.rest_until

    def failed(self, now: float, retry_after: float) -> None:
        self.failures += 1
        self.rest_until = now + min(MAX_REST, retry_after * 2 ** (self.failures - 1))


class SeederSwarm:
    """The seeders of one dataset as this fetch knows them; refreshed from the DHT."""

    def __init__(self, dht: Any, manifest_hash: str, own_peer_id: str, on_bad: Optional[BadSeederCallback],
                 exclude: Iterable[str] = ()):
        self.dht, self.manifest_hash, self.own = dht, manifest_hash, own_peer_id
        self.exclude = frozenset(exclude)
        self.seeders: dict[str, KnownSeeder] = {}
        self.asked: dict[str, set[str]] = {}
        """file -> seeders asked for a chunk of it (for the error naming how many were tried)."""
        self.on_bad = on_bad
        self.last_refresh = float("-inf")

    async def refresh(self, names: Optional[Sequence[str]]) -> None:
        self.last_refresh = time.monotonic()
        try:
            found = await find_seeders(self.dht, self.manifest_hash)
        except Exception as e:  # the DHT may be busy: the next look may find them
            log.debug("looking for seeders failed: %r", e)
            return
        for peer, record in found.items():
            if peer == self.own or peer in self.exclude:
                continue
            s = self.seeders.setdefault(peer, KnownSeeder(peer))
            s.holds = record.holds(names) if names is not None else set()

    def live(self) -> list[KnownSeeder]:
        return [s for s in self.seeders.values() if not s.banned]

    def pick(self, name: str, now: float, limit: int, avoid: set[str]) -> Optional[KnownSeeder]:
        """The least busy ready seeder holding ``name``, preferring those not in ``avoid``."""
        ready = [s for s in self.seeders.values() if name in s.holds and s.ready(now, limit)]
        fresh = [s for s in ready if s.peer_id not in avoid] or ready
        return min(fresh, key=lambda s: (s.inflight, s.failures, s.peer_id), default=None)

    def ban(self, seeder: KnownSeeder, what: str) -> None:
        seeder.banned = True
        log.warning("dropping seeder %s: %s", seeder.peer_id, what)
        if self.on_bad is not None:
            try:
                self.on_bad(seeder.peer_id, what)
            except Exception as e:  # the report is advice: the fetch goes on
                log.warning("reporting seeder %s failed: %r", seeder.peer_id, e)

    def tried(self, name: str) -> str:
        """How many seeders were tried for ``name`` and why none sent it (for :class:`NoSeeder`)."""
        asked = self.asked.get(name, set())
        if not asked:
            return f"0 seeders tried: none of the {len(self.seeders)} seeder(s) found announces it"
        bad = sum(1 for p in asked if self.seeders[p].banned)
        return f"{len(asked)} seeder(s) tried" + (f", {bad} of them sent bad bytes" if bad else ", none answered")
