"""gRPC's fork handlers off in every hivepath process and its children, set before grpc is imported.

From grpcio 1.80 on (grpc/grpc#43055), while a channel is in use, a child started by ``fork`` (a
``subprocess.Popen`` with ``preexec_fn`` forces it) can die between fork and exec: gRPC's fork
handler restarts its poller thread in the child, ``close_fds`` closes the poller's epoll descriptor,
and the child aborts on ``EBADF`` (at times, while a channel is busy). The parent sees a
child that started and exited at once: a peer of the demo, a peer restarted by a test. No hivepath
process uses gRPC in a forked child, so its fork handlers have nothing to do: every entry point (the
``hivepath`` command, the benchmarks, the tests) calls :func:`grpc_fork_safe` first, and
:class:`peer.node.lifetime.ChildProcesses` passes :data:`GRPC_FORK_ENV` to every child and uses no
``preexec_fn`` when grpc was imported with the handlers on (:func:`fork_is_safe`).

Standard library only: the coordinator's image copies this file alone.
"""

from __future__ import annotations

import os
import sys

__all__ = ["GRPC_FORK_ENV", "grpc_fork_safe", "fork_is_safe"]

GRPC_FORK_ENV = {"GRPC_ENABLE_FORK_SUPPORT": "0"}
"""The environment that turns gRPC's fork handlers off (read once, when grpc is imported)."""

_in_time = False


def grpc_fork_safe() -> bool:
    """Turn gRPC's fork handlers off for this process and its children. Returns whether it was in
    time: grpc not imported yet, or imported with the handlers already off."""
    global _in_time
    in_time = "grpc" not in sys.modules or all(os.environ.get(k) == v for k, v in GRPC_FORK_ENV.items())
    os.environ.update(GRPC_FORK_ENV)
    _in_time = _in_time or in_time
    return in_time


def fork_is_safe() -> bool:
    """Whether this process may start a child by ``fork`` without gRPC's handlers aborting it."""
    return "grpc" not in sys.modules or _in_time
