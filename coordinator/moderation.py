"""Reports and bans: how :class:`coordinator.core.Coordinator` removes peers from a run.

Peers report misbehaving peers and seeders; the operator bans and unbans. The decision itself is the
pure :func:`coordinator.bans.ban_decision`; the reports and bans are kept in a
:class:`coordinator.bans.BanBook`.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections import Counter
from typing import Callable

from coordinator.bans import BANS_META_KEY, BanBook, Report, ban_decision
from coordinator.credentials import CredentialBook
from coordinator.errors import InvalidArgument, LeaseNotFound, PeerNotFound
from coordinator.leases import LeaseTable
from coordinator.records import PeerRecord
from coordinator.results import ReportResult
from coordinator.settings import CoordinatorSettings
from coordinator.store import WriteBatch
from models.config import RunConfig

__all__ = ["Moderation"]

log = logging.getLogger(__name__)


class Moderation:
    """``report``, ``report_seeder``, ``ban`` and ``unban``, each under the coordinator's lock.

    Given the coordinator's lock, clock, settings and run, its peer table and lease table (read: a
    reporter needs a live lease), the ban book, the credentials (a banned peer's is forgotten)
    and the event counters; ``release`` drops a peer's lease and frees its work (under the lock) and
    ``durable`` commits each change before the call returns."""

    def __init__(
        self,
        *,
        lock: threading.RLock,
        clock: Callable[[], float],
        settings: CoordinatorSettings,
        run: RunConfig,
        peers: dict[str, PeerRecord],
        leases: LeaseTable,
        bans: BanBook,
        credentials: CredentialBook,
        counters: Counter[str],
        release: Callable[[PeerRecord, WriteBatch], None],
        durable: Callable[[WriteBatch], None],
    ):
        self._lock = lock
        self._clock = clock
        self._settings = settings
        self._run = run
        self._module_ids = frozenset(run.lattice.module_ids())
        self._peers = peers
        self._leases = leases
        self._bans = bans
        self._credentials = credentials
        self._counters = counters
        self._release = release
        self._durable = durable

    def _check_reporter(self, lease_id: str, reporter: str, suspect: str, now: float) -> None:
        """A report needs the reporter's live lease and a suspect other than the reporter (under the lock)."""
        lease = self._leases.get(lease_id)
        if lease is None or lease.peer_id != reporter or lease.expires_at <= now:
            raise LeaseNotFound(f"lease_id: no live lease {lease_id[:8]}... for {reporter}; join again")
        if suspect == reporter:
            raise InvalidArgument("suspect_peer_id", "a peer cannot report itself")

    def report(self, lease_id: str, reporter: str, suspect: str, module_id: str, round_no: int,
               reason: str) -> ReportResult:
        """A peer holding a live lease reports ``suspect`` for misbehaving in one module's round; the
        suspect is banned when :func:`coordinator.bans.ban_decision` says so. Durable on return."""
        batch = WriteBatch()
        with self._lock:
            now = self._clock()
            self._check_reporter(lease_id, reporter, suspect, now)
            if module_id not in self._module_ids:
                raise InvalidArgument("module_id", f"{module_id!r} is not a module of this run's lattice")
            if suspect not in self._peers:
                raise PeerNotFound(f"suspect_peer_id: no peer {suspect} has joined this run")
            if self._bans.is_banned(suspect):
                return ReportResult(True, f"{suspect} is already banned")
            self._counters["reports"] += 1
            recent = self._bans.add_report(Report(reporter, suspect, module_id, round_no, reason, now),
                                           self._settings.ban_window)
            s = self._settings
            banned, why = ban_decision(recent, now, s.ban_window, s.ban_reporters, s.ban_reports)
            if banned:
                self._apply_ban(suspect, why, now, False, batch)
        self._durable(batch)
        log.info("%s reported %s (%s round %d: %s): %s", reporter, suspect, module_id, round_no, reason, why)
        return ReportResult(banned, why)

    def report_seeder(self, lease_id: str, reporter: str, suspect: str, manifest_hash: str, file: str, chunk: int,
                      reason: str) -> ReportResult:
        """A peer holding a live lease reports a seeder of the run's dataset that sent bytes of ``file``
        (chunk ``chunk``) not matching the manifest. The seeder need not have joined (a ``hivepath data
        serve`` process never does); it is banned on the same rule as a module report
        (:func:`coordinator.bans.ban_decision`: distinct reporters within the window), and a banned
        seeder that is a peer of the run loses its lease. Durable on return."""
        batch = WriteBatch()
        with self._lock:
            now = self._clock()
            self._check_reporter(lease_id, reporter, suspect, now)
            run_hash = self._run.data.manifest_hash
            if not run_hash or manifest_hash != run_hash:
                raise InvalidArgument("manifest_hash", f"{manifest_hash[:64]!r} is not this run's dataset "
                                                       f"({run_hash or 'the run pins none'})")
            if self._bans.is_banned(suspect):
                return ReportResult(True, f"{suspect} is already banned")
            self._counters["seeder_reports"] += 1
            recent = self._bans.add_report(Report(reporter, suspect, f"data:{file}", chunk, reason, now),
                                           self._settings.ban_window)
            s = self._settings
            banned, why = ban_decision(recent, now, s.ban_window, s.ban_reporters, s.ban_reports)
            if banned:
                self._apply_ban(suspect, f"seeder of dataset {manifest_hash}: {why}", now, False, batch)
        self._durable(batch)
        log.warning("%s reported seeder %s (chunk %d of %s: %s): %s", reporter, suspect, chunk, file, reason, why)
        return ReportResult(banned, why)

    def ban(self, peer_id: str, reason: str = "") -> str:
        """Operator: ban ``peer_id`` (known or not); its lease is dropped and its joins refused."""
        batch = WriteBatch()
        with self._lock:
            self._apply_ban(peer_id, reason or "banned by the operator", self._clock(), True, batch)
        self._durable(batch)
        return "banned"

    def unban(self, peer_id: str) -> str:
        """Operator: lift a ban; the peer may join again. Returns its state afterwards."""
        batch = WriteBatch()
        with self._lock:
            if not self._bans.unban(peer_id):
                raise PeerNotFound(f"peer_id: {peer_id} is not banned")
            peer = self._peers.get(peer_id)
            if peer is not None and peer.state == "banned":
                peer.state = "left"
                batch.peers[peer_id] = copy.copy(peer)
            batch.meta[BANS_META_KEY] = self._bans.to_json()
            state = peer.state if peer is not None else "unknown"
        self._durable(batch)
        log.info("unbanned %s", peer_id)
        return state

    def _apply_ban(self, peer_id: str, reason: str, now: float, by_operator: bool, batch: WriteBatch) -> None:
        """Ban under the lock: lease dropped, work freed, credential never renewed, ban persisted."""
        self._bans.ban(peer_id, reason, now, by_operator)
        self._credentials.forget(peer_id)
        peer = self._peers.get(peer_id)
        if peer is not None:
            self._release(peer, batch)
            peer.state = "banned"
            batch.peers[peer_id] = copy.copy(peer)
        batch.meta[BANS_META_KEY] = self._bans.to_json()
        self._counters["bans"] += 1
        log.warning("banned %s: %s", peer_id, reason)
