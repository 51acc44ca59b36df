"""``hivepath demo``: a whole network on this machine, and its report. Not the volunteer node.

- ``launcher``: :func:`run_demo` starts a coordinator, an archive and N peers as real processes on
  the built-in corpus, shows a live table and stops them all.
- ``report``: the live table (:class:`DemoMonitor`), routed bits per byte before and after, the bytes
  exchanged against synchronous data-parallel training, and ``report.md``.

Imports ``peer.node`` and ``peer.coordinator_client``.
"""

from peer.demo.launcher import DemoOptions, run_demo
from peer.demo.report import DemoMonitor, ddp_bytes_equivalent, write_report

__all__ = ["DemoOptions", "run_demo", "DemoMonitor", "ddp_bytes_equivalent", "write_report"]
