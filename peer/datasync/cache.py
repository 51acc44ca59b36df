"""A peer's fetched shards under a disk budget: the least recently trained path goes first.

A peer reassigned to another path fetches the new path's shards and keeps the old ones, so that a
peer sent back to a path it trained before does not fetch it again. :class:`ShardCache` bounds what
is kept: before a path's shards are fetched, :meth:`ShardCache.make_room` removes other paths'
shards, least recently used first (the time each path was last trained is kept in ``.used.json`` in
the dataset directory; a path on disk without an entry counts as the oldest), until the kept shards
and the new path's fit the budget. The path being trained is never removed; when it alone is larger
than the budget it is fetched anyway, with a warning. The router, tokenizer and manifest are never
removed.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

from models import strict_json
from models.durable import atomic_write_text
from models.manifest import path_name, shard_files

__all__ = ["ShardCache", "USED_FILE"]

log = logging.getLogger(__name__)

USED_FILE = ".used.json"
"""When each path of a fetched dataset was last trained (unix seconds, by path name)."""


class ShardCache:
    """The shards of one fetched dataset directory under ``max_bytes`` (None: no budget)."""

    def __init__(self, directory: Path, manifest: dict, max_bytes: Optional[int] = None,
                 clock: Callable[[], float] = time.time):
        self.dir = Path(directory)
        self.manifest = manifest
        self.max_bytes = max_bytes
        self.clock = clock
        self._sizes = {name: int(entry["size"]) for name, entry in manifest.get("chunks", {}).items()}

    def files(self, path: Sequence[int]) -> list[str]:
        """The shard files of ``path`` that the manifest names."""
        return [f for f in shard_files(path) if f in self._sizes]

    def size(self, path: Sequence[int]) -> int:
        return sum(self._sizes[f] for f in self.files(path))

    def holds(self, path: Sequence[int]) -> bool:
        """Every shard file of ``path`` is in place (files are renamed into place only when verified)."""
        return all((self.dir / f).is_file() for f in self.files(path))

    def on_disk(self) -> list[tuple[int, ...]]:
        """The paths with at least one shard file in place."""
        out = []
        for name in sorted(self.manifest.get("shards", {})):
            path = tuple(int(i) for i in name.split("-"))
            if any((self.dir / f).is_file() for f in self.files(path)):
                out.append(path)
        return out

    def _used(self) -> dict[str, float]:
        try:
            data = json.loads((self.dir / USED_FILE).read_text())
        except (OSError, ValueError):
            return {}
        return {k: float(v) for k, v in data.items() if isinstance(k, str) and isinstance(v, (int, float))} \
            if isinstance(data, dict) else {}

    def touch(self, path: Sequence[int]) -> None:
        """Record that ``path`` is being trained now."""
        used = self._used()
        used[path_name(path)] = self.clock()
        # a fresh temporary name each write: peers on one machine share the data directory, and two
        # writing one fixed name at once would rename each other's file away
        atomic_write_text(self.dir / USED_FILE, strict_json.dumps(used, sort_keys=True))

    def make_room(self, path: Sequence[int]) -> list[str]:
        """Remove other paths' shards, least recently used first, until they and ``path``'s fit the
        budget; returns the files removed (for the seeder to stop announcing them)."""
        if self.max_bytes is None:
            return []
        keep = tuple(path)
        used = self._used()
        others = [p for p in self.on_disk() if p != keep]
        total = self.size(keep) + sum(self._held_bytes(p) for p in others)
        removed: list[str] = []
        for victim in sorted(others, key=lambda p: (used.get(path_name(p), 0.0), p)):
            if total <= self.max_bytes:
                break
            total -= self._held_bytes(victim)
            for f in self.files(victim):
                (self.dir / f).unlink(missing_ok=True)
                removed.append(f)
            used.pop(path_name(victim), None)
            log.info("removed path %s's shards to stay within the data budget of %d bytes", path_name(victim),
                     self.max_bytes)
        if total > self.max_bytes:
            log.warning("path %s's shards (%d bytes) exceed the data budget of %d bytes (--max-data-gb); keeping "
                        "them anyway: the path being trained is never removed", path_name(keep), self.size(keep),
                        self.max_bytes)
        return removed

    def _held_bytes(self, path: Sequence[int]) -> int:
        return sum(self._sizes[f] for f in self.files(path) if (self.dir / f).is_file())
