"""``HolderMemory``: what a member remembers of each module's holders from one matchmaking read to the next.

A read of a module's holders key can miss a holder (a DHT get that reached only some nodes), a holder
cut off by a partition vanishes without a withdrawal, and a holder behind us is waited for only so long.
Each of these judgements needs what earlier reads said: when each holder's record was last read, until
when it is valid, since when each holder behind us has been waited for. The judgements themselves are
:mod:`peer.averaging.group_decision`'s pure functions; this class keeps their memory, per module, for
:class:`peer.averaging.matchmaking.Matchmaker` (which does the reads).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Mapping, Optional

from peer.averaging import group_decision
from peer.network import HolderRecord

__all__ = ["HolderMemory"]

log = logging.getLogger(__name__)


class HolderMemory:
    """The per-module memory behind :func:`~peer.averaging.group_decision.vanished`,
    :func:`~peer.averaging.group_decision.missed` and :func:`~peer.averaging.group_decision.still_waiting`."""

    def __init__(self) -> None:
        self._behind_since: dict[str, dict[str, tuple[int, float, bool]]] = {}
        """module -> holder behind us -> (the round its record announces, when we began waiting for it,
        whether we logged giving up on it) (:func:`peer.averaging.group_decision.still_waiting`)."""
        self._seen: dict[str, dict[str, float]] = {}
        """module -> other holder -> when its holder record was last read: a holder whose record
        vanished without a withdrawal may be cut off from us, not gone (see :meth:`vanished`)."""
        self._read: dict[str, frozenset[str]] = {}
        """module -> every other holder whose record our last gather of it read, idle ones too."""
        self._last: dict[str, tuple[Any, float]] = {}
        """module -> our last read of its holders key (the value a DHT get returned) and when (monotonic)."""
        self._valid_until: dict[str, dict[str, float]] = {}
        """module -> other holder -> the DHT expiration of its holder record as we last read it: until
        then a record missing from a read was missed by the read (see :meth:`missed`)."""

    def waited(self, module_id: str) -> dict[str, tuple[int, float, bool]]:
        """The holders of ``module_id`` behind us that we wait for, as :meth:`still_waiting` last kept them."""
        return self._behind_since.get(module_id, {})

    def vanished(self, module_id: str, live: set[str], gone: dict[str, int], patience: float) -> dict[str, float]:
        """Holders of ``module_id`` whose record we read less than ``patience`` seconds ago and no
        longer read, with no withdrawal in its place: cut off from us by a partition, or dead
        (``kill -9``, a lost machine); each with when we last read its record. If we are the one cut
        off, stepping alone would race us ahead of them, one round per inner loop, and at the heal our
        lone lineage, further ahead, would win over theirs; so we keep training on our own progress
        and step alone only once they have been silent for ``patience``. Where the coordinator has
        answered us without a break since before they vanished, they are the ones gone, and we step
        alone at once as the only live holder (a cut-off peer reaches the coordinator again a few
        seconds after the heal, before its DHT finds the others: contact alone does not say it)."""
        out, self._seen[module_id] = group_decision.vanished(self._seen.get(module_id, {}), live, gone,
                                                             time.monotonic(), patience)
        return out

    def note_read(self, module_id: str, found: Any, records: Mapping[str, HolderRecord]) -> None:
        """Remember which holders of ``module_id`` a read of its holders key (``found``) returned, and
        until when each one's record is valid (its DHT expiration)."""
        self._last[module_id] = (found, time.monotonic())
        entries = getattr(found, "value", None)
        # every subkey read, a record of another config and a withdrawal too: none of them was missed
        self._read[module_id] = frozenset(entries) if isinstance(entries, dict) else frozenset()
        for peer in records:
            expiration = getattr(entries.get(peer), "expiration_time", None) if isinstance(entries, dict) else None
            if isinstance(expiration, (int, float)):
                self._valid_until.setdefault(module_id, {})[peer] = float(expiration)

    def last_read(self, module_id: str) -> Optional[tuple[Any, float]]:
        """Our last read of ``module_id``'s holders key (:meth:`note_read`) and when (monotonic), or None."""
        return self._last.get(module_id)

    def missed(self, module_id: str, vanished: Mapping[str, float], gone: Mapping[str, int]) -> dict[str, float]:
        """Of the ``vanished`` holders (:meth:`vanished`), those whose record, as we last read it, is
        still valid and was not withdrawn: the DHT still holds it, so our read missed it (a get that
        reached only some of the nodes, on a loaded host, merges a partial dictionary), and the holder
        may be at our round. Peer -> seconds its record stays valid. Stepping alone now would fork us
        from it; once its record expires unrefreshed, it is gone (a killed peer's record is read until
        then, so this never delays stepping on without a dead holder)."""
        from hivemind.utils import get_dht_time

        out, self._valid_until[module_id] = group_decision.missed(vanished, gone, self._read.get(module_id, frozenset()),
                                                                  self._valid_until.get(module_id, {}), get_dht_time())
        return out

    def still_waiting(self, module_id: str, behind: dict[str, int], patience: float) -> dict[str, int]:
        """The holders behind us worth waiting for (:func:`peer.averaging.group_decision.still_waiting`):
        those whose record announced a new round less than ``patience`` seconds ago. One that does not end
        its round in that time (idle, stuck, or gone with its record not yet expired) stops holding us back
        until its record moves again."""
        asked = group_decision.still_waiting(behind, self._behind_since.get(module_id, {}), time.monotonic(), patience)
        self.keep_waiting(module_id, asked, patience)
        return asked.waiting

    def keep_waiting(self, module_id: str, asked: group_decision.Waiting, patience: float) -> None:
        """Keep what :func:`peer.averaging.group_decision.still_waiting` answered for the next call, and
        log the holders it gave up on."""
        self._behind_since[module_id] = asked.since
        if asked.given_up:
            log.info("%s: holders %s stayed behind us for %.0fs; no longer waiting for them", module_id,
                     ", ".join(sorted(p[-8:] for p in asked.given_up)), patience)
