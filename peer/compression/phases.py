"""CPU seconds of the exchange by phase: where a round's CPU goes (``bench.comm`` reports them).

The all-reduce does its heavy work in executor threads (encode, entropy coding, decode, reduce);
each such call is timed with :func:`time.thread_time`, the CPU of the thread that ran it, so time a
thread spends waiting for the GIL or a core is not counted. Phases nest: an inner phase's seconds are
taken from the outer one (``entropy`` inside a codec's ``encode`` is counted once, as ``entropy``).
The event loop's own CPU (streams to the p2p daemon, framing, asyncio) is not a phase here: it is
the CPU of the averager's loop thread (:meth:`peer.averaging.NetAverager.loop_thread_id`).

Counters are process-wide and only ever grow: a reader takes :func:`snapshot` before and after.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Iterator

__all__ = ["PHASES", "phase", "snapshot", "tick"]

PHASES = ("encode", "entropy", "decode", "reduce", "copy")
"""``encode``: quantising values to a codec's bytes; ``entropy``: the zstd stage, both ways;
``decode``: bytes back to values; ``reduce``: the aggregation rule over a part's contributions;
``copy``: moving bytes and values between buffers outside the codecs (none in the all-reduce since
codecs write a sender's decoded values straight into the round's vector, ``Codec.encode_roundtrip_into``)."""

_lock = threading.Lock()
_totals = dict.fromkeys(PHASES, 0.0)
_local = threading.local()


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Count the calling thread's CPU seconds inside the block as ``name`` (minus nested phases)."""
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    now = time.thread_time()
    if stack:  # pause the enclosing phase
        outer, start = stack[-1]
        _add(outer, now - start)
    stack.append((name, now))
    try:
        yield
    finally:
        now = time.thread_time()
        _, start = stack.pop()
        _add(name, now - start)
        if stack:
            stack[-1] = (stack[-1][0], now)


def tick() -> None:
    """Count the calling thread's CPU seconds in its current phase so far, without leaving it: a long
    phase (a vector encoded while the group forms) is seen by a :func:`snapshot` as it runs."""
    stack = getattr(_local, "stack", None)
    if stack:
        now = time.thread_time()
        name, start = stack[-1]
        _add(name, now - start)
        stack[-1] = (name, now)


def _add(name: str, seconds: float) -> None:
    with _lock:
        _totals[name] += seconds


def snapshot() -> dict[str, float]:
    """The CPU seconds counted so far, per phase of :data:`PHASES`."""
    with _lock:
        return dict(_totals)
