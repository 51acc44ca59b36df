"""``HolderRecords``: this peer's holder and archive records on the DHT, announced, refreshed and withdrawn.

A :class:`~peer.network.records.HolderRecord` says that we hold a module, which round of it we average
next and with which state; an :class:`~peer.network.records.ArchiveRecord` that we serve its state
without averaging it. Groups wait for holders and newcomers fetch from both, so the records are stored
again every third of their time to live while held, and replaced by a
:func:`~peer.network.records.withdrawal` when released. Separate from
:mod:`peer.averaging.net_averager`, which drives the rounds: announcing is the same whichever way a
round averages, and it has its own state, lock and refresh thread.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any, Callable, Optional

from peer.averaging.compat import wire_key
from peer.network import (STORE_TIMEOUT, ArchiveRecord, HolderRecord, OwnExpirations, archive_key, holders_key,
                          to_value, withdrawal)

__all__ = ["HolderRecords"]

log = logging.getLogger(__name__)


class HolderRecords:
    """Our records of the modules we hold or archive (what :class:`peer.averaging.net_averager.NetAverager`
    announces), each stored under our peer id as subkey and living ``holder_ttl`` seconds unless
    refreshed; the refresh thread runs from :meth:`start` to :meth:`stop`."""

    def __init__(self, dht: Any, run_id: str, peer_id: str, config_hash: str, data_hash: str, throughput: float,
                 bandwidth: float, credential: Callable[[], bytes], holder_ttl: float):
        self.dht, self.run_id, self.peer_id = dht, run_id, peer_id
        self.config_hash, self.data_hash = config_hash, data_hash
        self.throughput, self.bandwidth = throughput, bandwidth
        self._credential = credential
        self.holder_ttl = holder_ttl
        self._held: dict[str, tuple[int, str]] = {}
        """module -> (the round we average next, the digest of our state at it, '' if unknown)."""
        self._archived: dict[str, int] = {}
        self._paused: set[str] = set()
        """Modules we announce as held but idle (:meth:`pause`)."""
        self._lock = threading.Lock()
        self._stored = OwnExpirations()
        """The expiration of our last record or withdrawal under each key: the next one there outlives it."""
        self._stopping = threading.Event()
        self._refresher: Optional[threading.Thread] = None
        self._digests = False
        """Whether a hold gave a digest yet: from then on a bare announcement of a new round may wait
        for that round's digest (:meth:`hold`'s ``digest_wait``)."""

    def start(self) -> None:
        """Store every record again every third of ``holder_ttl`` until :meth:`stop`."""
        self._refresher = threading.Thread(target=self._refresh_loop, name="holder-refresh", daemon=True)
        self._refresher.start()

    def stop(self) -> None:
        self._stopping.set()

    @property
    def stopped(self) -> bool:
        return self._stopping.is_set()

    def hold(self, module_id: str, round_no: int, wait: bool = True, digest: str = "",
             digest_wait: float = 0.0) -> None:
        """Announce that we hold ``module_id`` and will average its round ``round_no`` next, with the
        state of ``digest`` when known (``wait``: until the DHT stored it, at most
        :data:`peer.network.records.STORE_TIMEOUT` seconds: a DHT process that stopped answering must not
        hang the training thread; the refresh loop stores the record again). Re-announcing the same
        round costs nothing; a digest is kept until the round changes.

        ``digest_wait``: a new round announced without a ``digest`` and without waiting, once our holds
        give digests (the trainer announces each round's state with its digest once it applied it,
        :func:`peer.diloco.resync_after_round`), is stored only if no hold of that round with its digest
        (nor of another round) comes within ``digest_wait`` seconds: a round's record is then stored once,
        round and digest together, not once as its group forms and again with the digest."""
        with self._lock:
            held = self._held.get(module_id)
            if held is not None and held[0] == int(round_no) and (not digest or held[1] == digest):
                return
            self._held[module_id] = (int(round_no), digest)
            later = digest_wait > 0 and not digest and not wait and self._digests
            self._digests = self._digests or bool(digest)
        if later:
            timer = threading.Timer(digest_wait, self._publish_bare, (module_id, int(round_no)))
            timer.daemon = True
            timer.start()
            return
        future = self._publish(module_id, int(round_no), digest)
        if wait:
            try:
                future.result(STORE_TIMEOUT)
            except TimeoutError:
                log.warning("announcing module %s round %d: the DHT did not store it within %.0fs (retried by "
                            "the refresh loop)", module_id, round_no, STORE_TIMEOUT)

    def pause(self, module_id: str) -> None:
        """Announce ``module_id`` as held but idle until :meth:`resume`: other holders neither wait for us
        to declare its rounds nor to catch up with them (:attr:`peer.network.records.HolderRecord.idle`).
        A stage server nobody drives, or a trainer whose pipeline lacks a level, pauses so that the
        module's other holders average without it; it re-syncs when it trains again and is behind."""
        with self._lock:
            if module_id in self._paused:
                return
            self._paused.add(module_id)
            held = self._held.get(module_id)
        if held is not None:
            self._publish(module_id, *held)

    def resume(self, module_id: str, round_no: int) -> None:
        """Hold ``module_id`` in its rounds again, at ``round_no``, after :meth:`pause` (announced in the
        background)."""
        with self._lock:
            was = module_id in self._paused
            self._paused.discard(module_id)
            held = self._held.get(module_id)
        if was and held is not None and held[0] == int(round_no):
            self._publish(module_id, *held)
        else:
            self.hold(module_id, round_no, wait=False)

    def holding(self, module_id: str) -> bool:
        """Whether we announce ``module_id`` as held and not idle now (:meth:`hold`; not paused or
        released since)."""
        with self._lock:
            return module_id in self._held and module_id not in self._paused

    def announce_archive(self, module_id: str, round_no: int) -> None:
        """Announce that we serve ``module_id``'s state at ``round_no`` without averaging it (an archive
        peer): newcomers may fetch from us, but groups never wait for us. Refreshed in the background."""
        with self._lock:
            self._archived[module_id] = int(round_no)
        self._publish_archive(module_id, int(round_no)).result()

    def _publish_archive(self, module_id: str, round_no: int) -> Any:
        from hivemind.utils import get_dht_time

        record = ArchiveRecord(self.config_hash, self.data_hash, round_no, self._credential())
        key = archive_key(self.run_id, module_id)
        return self.dht.store(key, to_value(record), self._stored.take(key, get_dht_time() + self.holder_ttl),
                              subkey=self.peer_id, return_future=True)

    def forget(self, module_id: str) -> list[tuple[str, int]]:
        """Stop announcing and refreshing ``module_id``; returns the keys of the records we stored for it,
        each with the round to withdraw it at (:meth:`withdraw`)."""
        with self._lock:
            held = self._held.pop(module_id, None)
            archived = self._archived.pop(module_id, None)
        # each key's withdrawal says the round we left at: holders still behind it re-sync instead of
        # stepping alone into a second state at a round we already applied
        return ([(holders_key(self.run_id, module_id), held[0])] if held is not None else []) + \
               ([(archive_key(self.run_id, module_id), archived)] if archived is not None else [])

    async def withdraw(self, module_id: str, keys: list[tuple[str, int]]) -> None:
        """Replace our records under ``keys`` (from :meth:`forget`) by withdrawals that outlive them."""
        from hivemind.utils import get_dht_time

        # read for a record's lifetime, and past the record's own expiration: it replaces it on every node
        now, credential = get_dht_time(), self._credential()
        await asyncio.gather(*(self.dht.store(k, withdrawal(credential, r, self.config_hash, self.data_hash),
                                              self._stored.take(k, now + self.holder_ttl), subkey=self.peer_id,
                                              return_future=True) for k, r in keys))

    def modules(self) -> list[str]:
        """The modules we hold or archive, sorted."""
        with self._lock:
            return sorted(set(self._held) | set(self._archived))

    def _publish(self, module_id: str, round_no: int, digest: str = "") -> Any:
        from hivemind.utils import get_dht_time

        record = HolderRecord(self.config_hash, self.data_hash, round_no, self.throughput, self.bandwidth,
                              self._credential(), digest, idle=module_id in self._paused, wire=wire_key())
        # held again soon after a withdrawal (a reassignment keeping a module): ours expires after it
        key = holders_key(self.run_id, module_id)
        return self.dht.store(key, to_value(record), self._stored.take(key, get_dht_time() + self.holder_ttl),
                              subkey=self.peer_id, return_future=True)

    def _publish_bare(self, module_id: str, round_no: int) -> None:
        """Store the record of a round announced without its digest (:meth:`hold`'s ``digest_wait``), unless
        a later hold replaced it or we stopped."""
        with self._lock:
            if self._held.get(module_id) != (round_no, "") or self.stopped:
                return
        try:
            self._publish(module_id, round_no)
        except Exception as e:  # the DHT may be shutting down; the refresh loop stores it again
            log.debug("announcing module %s round %d failed: %r", module_id, round_no, e)

    def _refresh_loop(self) -> None:
        while not self._stopping.wait(self.holder_ttl / 3):
            with self._lock:
                held, archived = dict(self._held), dict(self._archived)
            try:
                for module_id, (round_no, digest) in held.items():
                    self._publish(module_id, round_no, digest)
                for module_id, round_no in archived.items():
                    self._publish_archive(module_id, round_no)
            except Exception as e:  # the DHT may be shutting down
                log.debug("refreshing records failed: %r", e)
