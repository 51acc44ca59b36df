"""In-process ``NetAverager`` holders on loopback DHTs, for tests that drive rounds from threads."""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from typing import Iterator, Optional, Sequence

from peer.localnet import wait_for

HOST = ["/ip4/127.0.0.1/tcp/0"]


@contextmanager
def loopback_holders(n: int, run_id: str, module_id: str, round_no: int,
                     config_hash: str = "aaaa0000aaaa0000", options: Optional[Sequence[dict]] = None) -> Iterator[list]:
    """``n`` averagers, each with its own DHT (the first bootstraps the others), holding ``module_id``
    at ``round_no``; yielded once every holder record is visible, shut down (averagers, then DHTs)
    after. ``options``: each averager's further ``NetAverager`` keyword arguments (an event hook,
    ``direct_lanes``)."""
    from peer.averaging.net_averager import NetAverager
    from peer.network import DHTOptions, HolderRecord, holders_key, read_records, start_dht

    with ExitStack() as stack:
        first = stack.enter_context(start_dht(DHTOptions(host_maddrs=HOST)))
        dhts = [first] + [stack.enter_context(start_dht(DHTOptions(host_maddrs=HOST, initial_peers=first.maddrs())))
                          for _ in range(n - 1)]
        avgs = [NetAverager(d, run_id, config_hash, **(options[i] if options else {})) for i, d in enumerate(dhts)]
        try:
            for avg in avgs:
                avg.hold(module_id, round_no)
            wait_for(lambda: len(read_records(first.dht, holders_key(run_id, module_id), HolderRecord)) == n, 30,
                     f"{n} holder records")
            yield avgs
        finally:
            for avg in avgs:
                avg.shutdown()
