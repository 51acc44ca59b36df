"""The all-reduce's pacing of segments (``peer.averaging.group_round.IN_FLIGHT``), over real DHTs and p2p
daemons on loopback: a member hands its next segment to a reducer only once that reducer acknowledged
the one before the last. Handing over alone says little: a daemon or a socket's buffer takes whole
segments at once, and every segment of a round then shares the link in the kernel.

The reducer holds its first acknowledgement (its loop stalls in the event hook, as a busy peer's
would); while it does, the member may hand over at most ``IN_FLIGHT`` segments."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from helpers.averagers import loopback_holders

STALL_S = 2.0
"""How long the reducer holds its first acknowledgement of a round: far longer than the member needs
to hand over every segment of this small vector if nothing held it."""


def _a_round_with_a_stall(name: str, config_hash: str, points: tuple[str, ...], numel: int, codec,
                          **options) -> tuple[list[tuple[float, str]], float]:
    """Two holders average one round of ``numel`` values over the daemons (a lane would be set up
    during the round, and the daemons buffer every segment); holder 1 holds its loop for
    :data:`STALL_S` at its first ``part_accepted``, and its acknowledgement with it. Returns holder
    0's events among ``points`` as (time, point), and when the stall began."""
    seen: list[tuple[float, str]] = []
    stalls: list[float] = []
    armed = threading.Event()

    def recorder(point: str) -> None:
        if point in points:
            seen.append((time.monotonic(), point))

    def staller(point: str) -> None:
        if point == "part_accepted" and armed.is_set():
            armed.clear()
            stalls.append(time.monotonic())
            time.sleep(STALL_S)

    deltas = [torch.randn(numel, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    hooks = [dict(direct_lanes=False, event_hook=hook, **options) for hook in (recorder, staller)]
    with loopback_holders(2, name, "L0M0", 0, config_hash, hooks) as avgs:
        armed.set()
        with ThreadPoolExecutor(2) as pool:
            results = list(pool.map(lambda i: avgs[i].average("L0M0", 0, [deltas[i]], 1.0, codec, 60.0), range(2)))
    for res in results:
        assert res.group_size == 2, res.reason
    assert torch.equal(results[0].averaged[0], results[1].averaged[0])
    assert stalls, "holder 1 never accepted a part"
    return seen, stalls[0]


def test_a_member_hands_a_reducer_no_more_than_two_unacknowledged_segments():
    from peer.averaging import BLOCK
    from peer.compression import get_codec
    from peer.averaging.group_round import IN_FLIGHT
    from peer.averaging.partition import MAX_SEGMENTS, SEGMENT_BLOCKS, segment_bounds

    numel = MAX_SEGMENTS * SEGMENT_BLOCKS * BLOCK  # (numel,): the smallest vector cut into every segment
    assert len(segment_bounds(numel)) == MAX_SEGMENTS > IN_FLIGHT
    # holder 0 is the member (its own parts' events), holder 1 the reducer that stalls
    seen, stalled = _a_round_with_a_stall("pacing", "cccc0000cccc0000", ("part_handed", "part_acknowledged"),
                                          numel, get_codec("int8"))
    handed = [t for t, p in seen if p == "part_handed"]
    acknowledged = [t for t, p in seen if p == "part_acknowledged"]
    # the member contributes one part per segment to its one reducer, every one handed and acknowledged
    assert len(handed) == len(acknowledged) == MAX_SEGMENTS, seen
    assert acknowledged[0] > stalled + STALL_S / 2, "an acknowledgement came while the reducer was stalled"
    for k in range(IN_FLIGHT, MAX_SEGMENTS):
        # segment k went once segment k - IN_FLIGHT was acknowledged: never more than IN_FLIGHT unacknowledged
        assert handed[k] >= acknowledged[k - IN_FLIGHT], (k, seen)
    # and while the acknowledgement was held, the member had handed over exactly IN_FLIGHT
    assert sum(t < acknowledged[0] for t in handed) == IN_FLIGHT, seen


def test_a_reducer_returns_an_average_only_after_its_own_contributions_a_segment_ahead():
    """A reducer's link carries its contributions, which the other reducers wait on, and its averages,
    which nobody waits on: the average of segment s goes out once its own contributions through
    segment s + CONTRIBUTIONS_AHEAD are handed over. The other member stalls its first acknowledgement,
    so the reducer cannot hand its third segment (pacing) while it already holds the first two
    segments' contributions: without the rule, the second average would go out during the stall."""
    from peer.averaging import BLOCK
    from peer.compression import get_codec
    from peer.averaging.group_round import IN_FLIGHT
    from peer.averaging.partition import MAX_SEGMENTS, SEGMENT_BLOCKS
    from peer.averaging.reducer import CONTRIBUTIONS_AHEAD, HOLD_SEGMENTS

    numel = MAX_SEGMENTS * SEGMENT_BLOCKS * BLOCK  # (numel,): cut into every segment
    codec = get_codec("int8")
    # a held average waits at most HOLD_SEGMENTS segments' time at the holder's bandwidth: a bandwidth
    # (both members', so the parts stay even) at which that is three stalls
    bandwidth = HOLD_SEGMENTS * codec.encoded_size(numel // MAX_SEGMENTS // 2) / (3 * STALL_S)
    # holder 0 is the reducer (its contributions handed, its averages out), holder 1 the member that stalls
    seen, stalled = _a_round_with_a_stall("ahead", "cccc0000cccc0001", ("part_handed", "average_out"), numel, codec,
                                          bandwidth=bandwidth)
    handed = [t for t, p in seen if p == "part_handed"]
    out = [t for t, p in seen if p == "average_out"]
    # two members: one contribution and one average of ours per segment
    assert len(handed) == len(out) == MAX_SEGMENTS, seen
    assert IN_FLIGHT + 1 <= MAX_SEGMENTS and handed[IN_FLIGHT] > stalled + STALL_S / 2, \
        "the reducer handed its third segment while the member was stalled: nothing was held"
    for k in range(1, MAX_SEGMENTS + 1):
        # the k first averages include one of segment k - 1 or later: our contributions through
        # segment k - 1 + CONTRIBUTIONS_AHEAD went before it
        through = min(k + CONTRIBUTIONS_AHEAD, MAX_SEGMENTS)
        assert out[k - 1] >= handed[through - 1], (k, seen)


def test_a_held_average_goes_once_our_contributions_a_segment_ahead_went_or_its_time_is_up():
    """``GroupState.hold_average`` on its own: released by the contributions it waits for, by the end
    of our first phase, and by ``hold_for`` when they never come (a dial that hangs)."""
    import asyncio

    from peer.compression import get_codec
    from peer.averaging.partition import Group
    from peer.averaging.reducer import GroupState

    async def main() -> None:
        state = GroupState(Group("g", ("a", "b", "c"), (1.0, 1.0, 1.0), 60.0), [], get_codec("int8"))
        state.to_hand = {0: 2, 1: 2, 2: 2}
        state.hold_until = time.monotonic() + 3600
        state.hold_for = 3600.0
        held = asyncio.ensure_future(state.hold_average(0))  # waits for segments 0 and 1
        for segment in (0, 0, 1):
            state.handed(segment)
            await asyncio.sleep(0)
            await asyncio.sleep(0)
            assert not held.done(), f"released before segment 1's second contribution (after {segment})"
        state.handed(1)
        await asyncio.wait_for(held, 30)
        # the last segment waits for itself only; the end of our first phase releases it too
        last = asyncio.ensure_future(state.hold_average(2))
        await asyncio.sleep(0)
        assert not last.done()
        state.release_averages()
        await asyncio.wait_for(last, 30)
        # contributions that never go: released after hold_for, long before hold_until
        state.to_hand = {0: 1, 1: 1}
        state.hold_for = 0.05
        await asyncio.wait_for(state.hold_average(0), 30)
        assert state._holding(0)

    asyncio.run(main())
