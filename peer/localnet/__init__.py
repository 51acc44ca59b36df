"""A local network of real ``hivepath`` processes on this machine, the one way ``hivepath demo``, the
benchmarks and the tests start one.

- :mod:`peer.localnet.procs`: :class:`ProcessGroup` (named children, always reaped, their logs and
  JSON events read back), :func:`wait_for` (a condition with a deadline), :func:`free_port`,
  :func:`hivepath_cmd` (the installed command);
- :mod:`peer.localnet.network`: :class:`LocalNetwork` (coordinator, archives, peers; on loopback or in
  network namespaces; the run config written from a ``RunConfig``);
- :mod:`peer.localnet.netns`: :class:`NetnsBridge` (namespaces behind one bridge, rate-limited links,
  home routers with NAT) and a link's sent-bytes counter (:func:`tx_bytes`, :func:`sample_tx`).
"""

from peer.localnet.netns import (NetnsBridge, link_idle, nat_available, netns_available, read_samples, sample_tx,
                                 tx_bytes)
from peer.localnet.network import (SHORT_RUN_ARCHIVE_FLAGS, SHORT_RUN_COORDINATOR, SHORT_RUN_ENV, SHORT_RUN_PEER_FLAGS,
                                   LocalNetwork, preset_network)
from peer.localnet.procs import ProcessGroup, free_port, hivepath_cmd, wait_for

__all__ = ["LocalNetwork", "SHORT_RUN_ARCHIVE_FLAGS", "SHORT_RUN_COORDINATOR", "SHORT_RUN_ENV", "SHORT_RUN_PEER_FLAGS",
           "NetnsBridge", "ProcessGroup", "free_port", "hivepath_cmd", "link_idle",
           "nat_available", "netns_available", "read_samples", "sample_tx", "preset_network", "tx_bytes", "wait_for"]
