"""A part whose stream was cut is asked again of the same reducer, through the dials that fail after a cut.

A relay resets a relayed connection after 128 KiB each way (``peer.network.relays``); the daemon's next
dial through that relay can fail ("connect failed") for a moment although the reducer is alive and
serving the other parts. Giving up on the first such dial sent the part to its fallback reducer, which
had nothing to adopt, and the round was lost. Here ``_exchange`` is scripted: each call takes the next
outcome of a list, so the rule of :meth:`ReductionServer._ask_again` is checked on its own.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from hivemind.p2p.p2p_daemon_bindings.utils import ControlFailure

from peer.averaging.allreduce import DIALS_AFTER_CUT, ReductionServer
from peer.averaging.partition import Group
from peer.averaging.reducer import GroupState
from peer.compression import get_codec

ME, REDUCER = "QmMe", "QmReducer"
AVERAGE = (b"average", [ME, REDUCER])


class _Scripted(ReductionServer):
    """A reduction server whose exchanges raise or return the scripted outcomes in turn."""

    def __init__(self, outcomes: list) -> None:
        super().__init__(p2p=None, peer_id=ME, prefix="test")
        self.outcomes, self.calls = list(outcomes), 0

    async def _exchange(self, state, peer, segment, part, attempt, payload, weight, deadline, sent=None,
                        acked=None):
        self.calls += 1
        outcome = self.outcomes.pop(0)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome


def _state() -> GroupState:
    group = Group("g", (ME, REDUCER), (1.0, 1.0), 30.0, relayed=(True, True))
    return GroupState(group, [[(0, 4), (4, 8)]], get_codec("none"))


def _ask(server: _Scripted, first: Exception, seconds: float = 30.0):
    return asyncio.run(server._ask_again(_state(), 0, 1, b"part", 1.0, first, time.monotonic() + seconds))


def _connect_failed() -> ControlFailure:
    return ControlFailure("Connect failed. msg=connection failed")


def test_dials_that_fail_after_a_cut_are_tried_again_and_the_part_gets_its_average():
    server = _Scripted([_connect_failed(), ConnectionResetError("cut"), _connect_failed(), _connect_failed(),
                        AVERAGE])
    assert _ask(server, EOFError("0 bytes read")) == AVERAGE
    assert server.calls == 5


def test_a_reducer_that_cannot_be_dialled_after_a_cut_is_given_up_after_a_few_dials():
    server = _Scripted([_connect_failed()] * (DIALS_AFTER_CUT + 1) + [AVERAGE])
    with pytest.raises(ControlFailure):
        _ask(server, EOFError("0 bytes read"))
    assert server.calls == DIALS_AFTER_CUT + 1


def test_a_failed_dial_without_a_cut_before_it_is_asked_once_more_only():
    server = _Scripted([_connect_failed(), AVERAGE])
    with pytest.raises(ControlFailure):
        _ask(server, _connect_failed())
    assert server.calls == 1


def test_a_refusal_after_a_cut_goes_to_the_fallback():
    server = _Scripted([RuntimeError("unknown group"), AVERAGE])
    with pytest.raises(RuntimeError, match="unknown group"):
        _ask(server, EOFError("0 bytes read"))
    assert server.calls == 1
