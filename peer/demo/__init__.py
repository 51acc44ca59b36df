"""``hivepath demo``: a whole network on this machine, and its report. Not the volunteer node.

- ``launcher``: :func:`run_demo` starts a coordinator, an archive, N peers and any small peers as real
  processes on the built-in corpus, shows a live table and stops them all.
- ``roles``: the ``--max-memory`` of a small peer (:func:`small_peer_memory`: a stage server and a
  trainer fit, a path does not) and each peer's role and tokens from its progress lines (:class:`PeerLines`).
- ``report``: the live table (:class:`DemoMonitor`), routed bits per byte before and after, the bytes
  exchanged against synchronous data-parallel training, each peer's role and tokens, and ``report.md``.

Imports ``peer.node`` and ``peer.coordinator_client``.
"""

from peer.demo.launcher import DemoOptions, run_demo
from peer.demo.report import DemoMonitor, ddp_bytes_equivalent, role_lines, write_report
from peer.demo.roles import PeerLines, SmallPeerMemory, small_peer_memory

__all__ = ["DemoOptions", "run_demo", "DemoMonitor", "ddp_bytes_equivalent", "role_lines", "write_report",
           "PeerLines", "SmallPeerMemory", "small_peer_memory"]
