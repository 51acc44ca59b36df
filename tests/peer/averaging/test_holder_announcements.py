"""How a member announces a module's next round (``HolderRecords.hold``), counted on real loopback DHTs.

Each store of a holder record is a request to every node of a small swarm with its own framing. A
round's record was stored twice: as the round's group formed (the next round, for the others to see
early) and again once the trainer applied the round (with the digest of the new state, which the
archive checks against the holders' majority).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from helpers.averagers import loopback_holders
from peer.averaging import BLOCK
from peer.compression import get_codec
from peer.localnet import wait_for
from peer.network import HolderRecord, holders_key, parse_record, read_records

CONFIG = "aaaa0000aaaa0000"


class _CountedStores:
    """A DHT that keeps the holder records stored through it (parsed)."""

    def __init__(self, dht):
        self._dht = dht
        self.records: list[HolderRecord] = []

    def __getattr__(self, name):
        return getattr(self._dht, name)

    def store(self, key, value, *args, **kwargs):
        if key.endswith("_holders"):
            self.records.append(parse_record(HolderRecord, kwargs.get("subkey"), value))
        return self._dht.store(key, value, *args, **kwargs)


@pytest.mark.integration
def test_a_round_applied_by_a_trainer_stores_its_next_round_record_once_with_the_digest():
    """Two holders average round 5 and, as a trainer does after applying it, announce round 6 with the
    digest of their new state: ``a``'s record of round 6 is stored once, carrying that digest, and
    the DHT says so. Checked by hand: without waiting for the digest it is stored twice, first
    without it as the group forms."""
    with loopback_holders(2, "one-store", "L0M0", 4, CONFIG) as avgs:
        a, b = avgs
        int8 = get_codec("int8")
        deltas = [torch.randn(3 * BLOCK, generator=torch.Generator().manual_seed(i)) for i in range(2)]
        with ThreadPoolExecutor(2) as pool:
            first = list(pool.map(lambda i: avgs[i].average("L0M0", 4, [deltas[i]], 1.0, int8, 20.0), range(2)))
        assert all(r.group_size == 2 for r in first), [r.reason for r in first]
        for avg in avgs:
            avg.hold("L0M0", 5, wait=False, digest="d5")
        stores = a._records.dht = _CountedStores(a._records.dht)
        try:
            with ThreadPoolExecutor(2) as pool:
                second = list(pool.map(lambda i: avgs[i].average("L0M0", 5, [deltas[i]], 1.0, int8, 20.0),
                                       range(2)))
            assert all(r.group_size == 2 for r in second), [r.reason for r in second]
            for avg in avgs:
                avg.hold("L0M0", 6, wait=False, digest="d6")
            wait_for(lambda: read_records(b.dht, holders_key("one-store", "L0M0"), HolderRecord)[a.peer_id].digest
                     == "d6", 30, "a's record of round 6 with its digest")
        finally:
            a._records.dht = stores._dht
    assert [(r.round_no, r.digest) for r in stores.records if r.round_no == 6] == [(6, "d6")], stores.records
