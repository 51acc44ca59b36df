"""An in-process stand-in for hivemind's DHT: dictionary values with subkeys and expirations.

Only the transport is replaced: values are the real records (:func:`peer.network.records.to_value`),
read back through the real parser (:func:`peer.network.records.records_from_value`), which takes a
``get`` result of this shape. Every call is counted, with the bytes of what it stores or returns
(msgpack, as on the wire); Kademlia's routing hops are not simulated (a modelled multiplier, see
``docs/BENCHMARKS.md``)."""

from __future__ import annotations

from collections import Counter
from typing import Any, NamedTuple

import msgpack

__all__ = ["SimDHT", "Entry", "Found"]


class Entry(NamedTuple):
    value: Any
    expiration_time: float


class Found(NamedTuple):
    """What ``dht.get(key, latest=True)`` returns for a dictionary value: ``.value`` maps subkeys to entries."""

    value: dict[str, Entry]
    expiration_time: float


class SimDHT:
    """Keys -> subkey -> (value, expiration, size); counts ``ops``, ``bytes`` and per-key ``key_ops``."""

    def __init__(self, clock, schedule=None):
        """``schedule(when, callback, *args)`` (the event loop's ``at``): with it, a subkey stored with
        ``expire=True`` is dropped at its expiration unless stored again meanwhile, as a DHT forgets an
        expired value (a departed holder leaves the holders key)."""
        self.clock = clock
        self.schedule = schedule
        self._data: dict[str, dict[str, tuple[Any, float, int]]] = {}
        self._size: dict[str, int] = {}
        self.ops = 0
        self.bytes = 0
        self.key_ops: Counter[str] = Counter()

    def store(self, key: str, subkey: str, value: Any, expiration: float, expire: bool = False) -> int:
        """Store one subkey; returns the bytes sent."""
        size = len(msgpack.packb(value, use_bin_type=True)) + len(key) + len(subkey)
        entries = self._data.setdefault(key, {})
        old = entries.get(subkey)
        entries[subkey] = (value, expiration, size)
        self._size[key] = self._size.get(key, 0) + size - (old[2] if old else 0)
        self.ops += 1
        self.bytes += size
        self.key_ops[key] += 1
        if expire and self.schedule is not None:
            self.schedule(expiration, self.expire, key, subkey)
        return size

    def expire(self, key: str, subkey: str) -> None:
        """Drop a subkey whose expiration has passed (a later store of it moved its expiration on)."""
        entries = self._data.get(key)
        if entries and subkey in entries and entries[subkey][1] <= self.clock():
            self.delete(key, subkey)

    def count(self, key: str) -> int:
        """Subkeys under ``key`` (a get's entry count, without building it; not an operation)."""
        return len(self._data.get(key, ()))

    def delete(self, key: str, subkey: str) -> None:
        """Drop a subkey (its expiration passed); not a network operation."""
        entries = self._data.get(key)
        if entries and subkey in entries:
            self._size[key] -= entries.pop(subkey)[2]
            if not entries:
                self.drop_key(key)

    def size(self, key: str) -> int:
        """The bytes one get of ``key`` returns now (nothing counted)."""
        return self._size.get(key, 0) + len(key)

    def get_size(self, key: str, polls: int = 1) -> int:
        """Count ``polls`` gets of ``key`` without building their results (the matchmaking polls
        between two changes of the key return the same value); returns the bytes of one."""
        size = self._size.get(key, 0) + len(key)
        self.ops += polls
        self.bytes += size * polls
        self.key_ops[key] += polls
        return size

    def get(self, key: str) -> Found | None:
        """One get: every unexpired subkey, in the shape :func:`records_from_value` reads."""
        self.get_size(key)
        now = self.clock()
        entries = self._data.get(key)
        if not entries:
            return None
        live = {s: Entry(v, e) for s, (v, e, _) in entries.items() if e > now}
        return Found(live, max((e.expiration_time for e in live.values()), default=now)) if live else None

    def drop_key(self, key: str) -> None:
        self._data.pop(key, None)
        self._size.pop(key, None)
