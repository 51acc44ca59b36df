"""The averaging contract every module group follows: what a member contributes and gets back.

:class:`ModuleAverager` is what :class:`peer.diloco.DiLoCoOptimizer` calls once per module and round;
:class:`peer.averaging.LocalAverager` (threads of one process) and :class:`peer.averaging.NetAverager`
(peers over hivemind's P2P) implement it with the same reduction rule (``peer.averaging.aggregation``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Protocol

from torch import Tensor

from peer.compression import Codec

__all__ = ["AverageResult", "LinkTimes", "ModuleAverager", "SuspectHook", "require_codec", "LONE_HOLDER"]

LONE_HOLDER = "lone holder"
"""``AverageResult.reason`` of a round applied alone because we were the module's only live holder."""


@dataclass
class LinkTimes:
    """When the bytes of an exchange crossed this member's link, part by part: what
    :class:`peer.diloco.LinkRates` reads the link's own rates from, without the time spent waiting on
    other members (a slow member's parts end late, a fast member's early, and both are here).

    Each entry is ``(time.monotonic() when the bytes were through, bytes)``. Up: a contribution once
    its reducer acknowledged it (or, unacknowledged, answered), an average we reduced once its
    receiver hung up after reading it. Down: an average once read. Nothing of ours goes up before
    ``up_from``, nor does an average we asked for come down before ``down_from`` (both the
    all-reduce's start), so bytes through by time t over ``t - *_from`` is a lower bound of the
    link's rate in that direction. The contributions to parts we reduce are left out: their senders
    may start before the group is known here, and a daemon or a socket holds what they sent until
    this process reads it, so when it read them says nothing of when they crossed the link (counting
    them read download rates above what every sender's link together could carry)."""

    up_from: float = math.inf
    down_from: float = math.inf
    up: list[tuple[float, int]] = field(default_factory=list)
    down: list[tuple[float, int]] = field(default_factory=list)

    @classmethod
    def starting(cls, at: float) -> "LinkTimes":
        return cls(up_from=at, down_from=at)

    def went_up(self, n: int, at: Optional[float] = None) -> None:
        if n > 0:
            self.up.append((time.monotonic() if at is None else at, n))

    def came_down(self, n: int, at: Optional[float] = None) -> None:
        if n > 0:
            self.down.append((time.monotonic() if at is None else at, n))

    def merge(self, other: "LinkTimes") -> "LinkTimes":
        """Both exchanges' parts, as one measurement of the link they shared (a new object)."""
        return LinkTimes(min(self.up_from, other.up_from), min(self.down_from, other.down_from),
                         [*self.up, *other.up], [*self.down, *other.down])


@dataclass
class AverageResult:
    """What one member gets back from one module's exchange."""

    averaged: Optional[list[Tensor]]
    """Weighted mean every member applies (identical bits on all); None if the round failed."""
    own_decoded: Optional[list[Tensor]]
    """What the group received from us after the codec (for error feedback); None if not sent."""
    group_size: int
    """Members whose contributions are in ``averaged``."""
    peers: list[str]
    """Peer ids that contributed, sorted."""
    bytes_sent: int
    bytes_received: int
    reason: str = ""
    """Why the round failed, or who was dropped from it."""
    suspects: dict[str, str] = field(default_factory=dict)
    """Peer id -> why its contribution was dropped or clipped, in the parts this peer reduced."""
    adopt: str = ""
    """Set when the round failed because other holders at this round hold a different state (a fork)
    and theirs is the one kept: the :func:`peer.outer.state_digest` to re-sync to."""
    ahead: int = -1
    """Set when the round failed because other holders applied rounds this member missed: the round
    they are at (:attr:`peer.averaging.matchmaking.Match.ahead`); -1 otherwise."""
    ahead_left: bool = False
    """With ``ahead``: those holders left, so no live holder can send their state."""
    transfer_seconds: float = 0.0
    """Seconds from the group's forming to the end of its all-reduce (every level of a split round):
    the time ``bytes_sent`` and ``bytes_received`` took, the peer's link measurement
    (:class:`peer.diloco.LinkRates` uses it where ``link_times`` is None); 0 where nothing crossed a
    network."""
    link_times: Optional[LinkTimes] = None
    """When the bytes crossed our link, part by part (None where nothing crossed a network, or where
    only the totals are known)."""
    buffers: tuple = field(default=(), repr=False, compare=False)
    """The round-sized vectors ``averaged`` and ``own_decoded`` are views of, which the averager reuses
    in a later round once the caller hands them back (``give_back(result)``, where the averager has
    it) after its last read of them; empty where there is nothing to reuse."""

    @property
    def ok(self) -> bool:
        return self.averaged is not None


class ModuleAverager(Protocol):
    """Averages one module's pseudo-gradient with the other holders of that module.

    :class:`peer.diloco.DiLoCoOptimizer` calls :meth:`average` for all its modules at once, from
    several threads (one exchange per module), so implementations must be thread-safe across
    modules: a slow or missing member of one module's group must not delay another module's round.
    An averager may also offer ``give_back(result)``, which the optimizer calls once it applied a
    result and reads its tensors no more (:attr:`AverageResult.buffers`).
    """

    def average(
        self, module_id: str, round_no: int, tensors: list[Tensor], weight: float, codec: Codec, timeout: float,
        digest: str = "",
    ) -> AverageResult:
        """Contribute ``tensors`` with ``weight`` to round ``round_no`` of ``module_id``'s group and
        return the group's weighted mean, or a failed result after at most ``timeout`` seconds.
        ``codec``: the run's wire codec, resolved once by the caller (every member of a group must
        use the same one). ``digest`` (:func:`peer.outer.state_digest` of the state the mean will be
        applied to): only members holding the same state may average together."""
        ...


def require_codec(codec: Codec) -> Codec:
    """``codec``, or TypeError when a caller passed something else (e.g. a codec name: resolve it
    once with :func:`peer.compression.get_codec`), before anything is sent."""
    if not isinstance(codec, Codec):
        raise TypeError(f"expected a Codec (peer.compression.get_codec(name)), got {type(codec).__name__} {codec!r}")
    return codec


SuspectHook = Callable[[str, str, int, str], None]
"""``on_suspect(peer_id, module_id, round_no, why)``: called once per (peer, module, round) whose
contribution a reducer here dropped or clipped, e.g. to report the peer to the coordinator."""
