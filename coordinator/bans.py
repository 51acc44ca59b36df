"""Reports of misbehaving peers and the decision to ban one.

Members of an averaging group catch a peer sending NaN, huge or random pseudo-gradients (robust
aggregation) and report it with ``ReportPeer``. One report is not enough to ban: a hostile
peer could report honest ones. :func:`ban_decision` bans a suspect reported by at least
``ban_reporters`` distinct peers, or ``ban_reports`` times in all, within ``ban_window`` seconds; it is
pure, takes the clock as an argument and returns ``(ban, reason)``.

:class:`BanBook` keeps the recent reports (in memory: after a coordinator restart the window starts
afresh, which only delays a ban) and the bans themselves (persisted as JSON in the store's meta
table, so a restart never unbans anyone). A banned peer's join is refused, its lease is dropped and
its credential is never renewed, so it drops out of every group once its credential expires.
"""

from __future__ import annotations

import json
import logging
from collections import deque
from dataclasses import dataclass
from typing import Iterable, Optional

from models import strict_json

__all__ = ["Report", "Ban", "ban_decision", "BanBook", "BANS_META_KEY"]

log = logging.getLogger(__name__)

BANS_META_KEY = "bans"
_MAX_REPORTS_PER_SUSPECT = 256


@dataclass(frozen=True)
class Report:
    """One peer's report that another misbehaved in one module's round."""

    reporter: str
    suspect: str
    module_id: str
    round_no: int
    reason: str
    at: float
    """Coordinator clock when the report arrived."""


@dataclass(frozen=True)
class Ban:
    peer_id: str
    reason: str
    at: float
    by_operator: bool = False


def ban_decision(reports: Iterable[Report], now: float, window: float, min_reporters: int,
                 min_reports: int) -> tuple[bool, str]:
    """Whether the reports against one suspect justify a ban at ``now``; with the reason either way.

    Only reports within ``window`` seconds count. A reporter's repeated reports of the same
    (module, round) count once, so one peer cannot ban another alone by repeating itself unless
    ``min_reporters`` is 1 or it catches the suspect in ``min_reports`` distinct rounds."""
    recent = [r for r in reports if now - window <= r.at <= now]
    if not recent:
        return False, "no reports within the window"
    reporters = {r.reporter for r in recent}
    distinct = {(r.reporter, r.module_id, r.round_no) for r in recent}
    suspect = recent[0].suspect
    if len(reporters) >= min_reporters:
        return True, (f"{suspect} reported by {len(reporters)} distinct peers within {window:.0f}s "
                      f"(threshold {min_reporters}): {recent[-1].reason}")
    if min_reports and len(distinct) >= min_reports:
        return True, (f"{suspect} reported {len(distinct)} times within {window:.0f}s "
                      f"(threshold {min_reports}): {recent[-1].reason}")
    return False, (f"{len(reporters)} distinct reporters of {min_reporters} and {len(distinct)} reports of "
                   f"{min_reports or 'unlimited'} within {window:.0f}s: not banned")


class BanBook:
    """Recent reports per suspect and the set of banned peers (not thread-safe: the caller locks)."""

    def __init__(self, stored_json: Optional[str] = None):
        self._reports: dict[str, deque[Report]] = {}
        self.bans: dict[str, Ban] = {}
        if stored_json:
            try:
                for pid, b in json.loads(stored_json).items():
                    self.bans[pid] = Ban(pid, str(b["reason"]), float(b["at"]), bool(b.get("by_operator", False)))
            except (ValueError, TypeError, KeyError, AttributeError):
                log.error("the stored ban list is unreadable; starting with no bans")

    def is_banned(self, peer_id: str) -> Optional[Ban]:
        return self.bans.get(peer_id)

    def add_report(self, report: Report, window: float) -> list[Report]:
        """Record ``report`` and return the suspect's reports still inside the window."""
        q = self._reports.setdefault(report.suspect, deque(maxlen=_MAX_REPORTS_PER_SUSPECT))
        while q and q[0].at < report.at - window:
            q.popleft()
        q.append(report)
        return list(q)

    def ban(self, peer_id: str, reason: str, now: float, by_operator: bool = False) -> Ban:
        ban = Ban(peer_id, reason, now, by_operator)
        self.bans[peer_id] = ban
        self._reports.pop(peer_id, None)
        return ban

    def unban(self, peer_id: str) -> bool:
        self._reports.pop(peer_id, None)
        return self.bans.pop(peer_id, None) is not None

    def to_json(self) -> str:
        return strict_json.dumps({b.peer_id: {"reason": b.reason, "at": b.at, "by_operator": b.by_operator}
                           for b in self.bans.values()}, sort_keys=True)
