"""Fixtures of the chaos suite: network namespaces behind one bridge (skipped, with the reason, where
they cannot be made: they need root, ``ip`` and ``tc``)."""

from __future__ import annotations

import pytest

from chaos.scenario import CHAOS_PREFIX, CHAOS_SUBNET


@pytest.fixture
def bridge():
    """Four namespaces ``hpc<pid>-p0..3`` (coordinator in 0, peers in 1-3), 100 Mbit/s links."""
    from peer.localnet.netns import NetnsBridge, netns_available

    why = netns_available()
    if why:
        pytest.skip(f"network namespaces unavailable: {why}")
    with NetnsBridge(4, rate="100mbit", subnet=CHAOS_SUBNET, prefix=CHAOS_PREFIX) as b:
        yield b
