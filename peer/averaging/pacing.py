"""``WaitingCheck``: whether another holder already waits in matchmaking for a round we still compute.

The first holder to compute its whole round paces the rest: ``DiLoCoOptimizer`` asks between inner
steps (:meth:`peer.averaging.net_averager.NetAverager.others_waiting`) and ends its round early when
someone waits. The answer must never block the training loop, so it comes from the declarations
holders pushed us, else from a DHT read made in the background. Separate from
:mod:`peer.averaging.net_averager`, which runs the rounds themselves: this is read by the training
thread, with its own poll state.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any, Mapping, Optional

from peer.averaging.matchmaking import Matchmaker
from peer.network import GroupDeclaration, group_key, records_from_value

__all__ = ["WaitingCheck", "WAITING_POLL", "PUSHED_WAITING_POLL"]

WAITING_POLL = 1.0
"""Seconds between the DHT checks behind :meth:`WaitingCheck.others_waiting`."""
PUSHED_WAITING_POLL = 10.0
"""Seconds between those checks while every live holder of the modules asked about pushes us its
declarations (:meth:`peer.averaging.declaration_push.DeclarationPush.all_push`): a push answers first,
and a check is a DHT read of every module's group key; it stays for a push that failed."""


class WaitingCheck:
    """Answers :meth:`others_waiting` for one averager: from its matchmaker's pushed declarations
    (``matchmaker``, set once the averager started) or from DHT reads run on the averager's ``loop``."""

    def __init__(self, dht: Any, run_id: str, peer_id: str, config_hash: str, data_hash: str,
                 loop: asyncio.AbstractEventLoop):
        self.dht, self.run_id, self.peer_id = dht, run_id, peer_id
        self.config_hash, self.data_hash = config_hash, data_hash
        self._loop = loop
        self.matchmaker: Optional[Matchmaker] = None
        self._waiting_check: Optional[Any] = None
        self._waiting_checked = -math.inf
        self.last_waiting: Optional[tuple[str, int, str]] = None
        """(module, round, peer) of the last declaration :meth:`others_waiting` answered True for."""
        self._paced: dict[str, int] = {}
        """module -> the round :meth:`others_waiting` last answered True for: our declaration of
        that round says it was paced (:attr:`peer.network.records.GroupDeclaration.paced`)."""
        self._paced_sparse = False
        """That answer was for a peer whose steps are far apart (``paced_too``): our paced declaration
        says so too (:attr:`peer.network.records.GroupDeclaration.sparse`)."""

    def paced(self, module_id: str, round_no: int) -> bool:
        """Whether :meth:`others_waiting` last answered True for ``module_id``'s round ``round_no``."""
        return self._paced.get(module_id) == round_no

    def sparse(self, module_id: str, round_no: int) -> bool:
        """Whether that answer, for ``module_id``'s round ``round_no``, was a sparse stepper's (``paced_too``)."""
        return self.paced(module_id, round_no) and self._paced_sparse

    def others_waiting(self, rounds: Mapping[str, int], paced_too: bool = False) -> bool:
        """True when another holder of our config already declared itself ready for the current round
        of one of these modules (``module_id -> round``) after computing its whole round (a declaration
        that was itself paced does not count, :attr:`peer.network.records.GroupDeclaration.paced`,
        unless ``paced_too``: for a peer whose steps are far apart, the one every round waits on, which
        counts a paced declaration too unless it came from another such peer,
        :attr:`peer.network.records.GroupDeclaration.sparse`): it waits in matchmaking, so
        ``DiLoCoOptimizer`` ends its round now with the tokens it has, and our declaration of it says
        so. Never blocks the training loop: it answers from the declarations holders pushed us
        (:meth:`peer.averaging.declaration_push.DeclarationPush._push`), else from a DHT check at most
        ``WAITING_POLL`` seconds old (``PUSHED_WAITING_POLL`` while every live holder of these modules
        pushes us its declarations), refreshed in the background (False until a check for exactly these
        rounds has come back)."""
        key = tuple(sorted(rounds.items()))
        matchmaker = self.matchmaker
        for module_id, round_no in key if matchmaker is not None else ():  # declarations pushed to us
            told = sorted(p for p, d in matchmaker.pushed_to(group_key(self.run_id, module_id, round_no)).items()
                          if not d.paced or (paced_too and not d.sparse))
            if told:
                return self._answer((module_id, round_no, told[0]), key, paced_too)
        now = time.monotonic()
        pending = self._waiting_check
        pushed = matchmaker is not None and all(matchmaker.all_push(module_id, group_key(self.run_id, module_id, r))
                                                for module_id, r in key)
        interval = PUSHED_WAITING_POLL if pushed else WAITING_POLL
        if (pending is None or pending.done()) and now - self._waiting_checked >= interval:
            self._waiting_checked = now
            self._waiting_check = asyncio.run_coroutine_threadsafe(self._check_waiting(key), self._loop)
        if pending is not None and pending.done() and pending.exception() is None:
            checked_key, unpaced, dense = pending.result()
            waiting = (unpaced or dense) if paced_too else unpaced
            if waiting is not None and checked_key == key:
                return self._answer(waiting, key, paced_too)
        return False

    def _answer(self, waiting: tuple[str, int, str], key: tuple, paced_too: bool) -> bool:
        """Remember that ``waiting`` (module, round, peer) waits on the rounds of ``key``: our declarations
        of them say they were paced, and sparse when we answered as a sparse stepper (``paced_too``)."""
        self.last_waiting = waiting
        self._paced, self._paced_sparse = dict(key), paced_too
        return True

    async def _check_waiting(self, key: tuple) -> tuple[tuple, Optional[tuple[str, int, str]],
                                                       Optional[tuple[str, int, str]]]:
        """``key`` and the first holder waiting on one of its rounds whose declaration was not paced, and
        the first whose declaration was paced but not by a peer whose steps are far apart."""
        # every module's key at once: one DHT round trip, not one per module, before a slower peer
        # notices that the group waits for it
        # (in a split round the members that computed their whole round declare here too, whatever
        # their bucket: Matchmaker.announce_full_round)
        found = await asyncio.gather(*(self.dht.get(group_key(self.run_id, module_id, round_no), latest=True,
                                                    return_future=True) for module_id, round_no in key))
        dense: Optional[tuple[str, int, str]] = None
        for (module_id, round_no), value in zip(key, found):
            for peer, decl in records_from_value(value, GroupDeclaration).items():
                if peer != self.peer_id and decl.config_hash == self.config_hash and decl.data_hash == self.data_hash:
                    if not decl.paced:
                        return key, (module_id, round_no, peer), dense
                    if not decl.sparse:
                        dense = dense or (module_id, round_no, peer)
        return key, None, dense
