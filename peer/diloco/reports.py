"""What an outer round reports: per module, and for the whole round (:meth:`DiLoCoOptimizer.step`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from peer.averaging.contract import LinkTimes

__all__ = ["ModuleReport", "RoundReport"]


@dataclass
class ModuleReport:
    """One module's outer step in one round."""

    module_id: str
    round_no: int
    """The group's round number of this exchange."""
    applied: bool
    """True when the group's average was applied to the global copy."""
    reason: str = ""
    """Why it was not applied, or who was dropped."""
    group_size: int = 0
    peers: list[str] = field(default_factory=list)
    bytes_sent: int = 0
    bytes_received: int = 0
    tokens: float = 0.0
    """Our weight in the average: tokens processed in the round."""
    wait_seconds: float = 0.0
    """Seconds the training loop was blocked waiting on this exchange."""
    transfer_seconds: float = 0.0
    """Seconds the exchange's all-reduce took once its group formed (0: nothing crossed a network)."""
    exchange_seconds: float = 0.0
    """Seconds from the exchange's launch to its end (matchmaking, waiting for the group, the
    all-reduce): what it would block a round that waits for it, whether this one did or not."""
    adopt: str = ""
    """Not applied because the other holders at this round hold another state (a fork): the digest
    (:func:`peer.outer.state_digest`) of the state to re-sync to."""
    ahead: int = -1
    """Not applied because other holders applied rounds we missed: the round they are at; -1 otherwise."""
    ahead_left: bool = False
    """With ``ahead``: those holders left, so no live holder can send their state."""
    link_times: Optional[LinkTimes] = field(default=None, repr=False, compare=False)
    """When the exchange's bytes crossed our link, part by part (None: only the totals are known)."""

    @property
    def left_at(self) -> int:
        """The round the holders ahead of us were at when they left (``ahead`` when ``ahead_left``), -1
        when they did not leave: :func:`peer.diloco.resync.resync_module` numbers our state on from it."""
        return self.ahead if self.ahead_left else -1


@dataclass
class RoundReport:
    """What :meth:`DiLoCoOptimizer.step` returns when an outer round ran."""

    round: int
    """This peer's round index (in overlap mode: the round whose exchange was applied now)."""
    inner_steps: int
    tokens: float
    seconds: float
    """Clock seconds of inner work in the round that just ended."""
    modules: dict[str, ModuleReport]
    overlap: bool = False
    """The round's exchange ran behind the next round's steps (overlap mode): a module it did not apply
    is re-synced before its next launch (:func:`peer.diloco.install_resync`), not after this report."""

    @property
    def applied(self) -> bool:
        return bool(self.modules) and all(m.applied for m in self.modules.values())

    @property
    def wait_seconds(self) -> float:
        return sum(m.wait_seconds for m in self.modules.values())

    @property
    def blocking_seconds(self) -> float:
        """Seconds the round's exchanges block, or would block, training when it waits for them: the
        time it waited, or in overlap mode (where it waits for none, as they ran behind the next
        round's steps) the longest exchange (all of a round's modules exchange at once)."""
        if not self.overlap:
            return self.wait_seconds
        return max((m.exchange_seconds for m in self.modules.values()), default=0.0)
