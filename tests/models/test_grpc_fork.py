"""Children started while a gRPC channel is busy all run (grpc/grpc#43055, :mod:`models.grpc_fork`).

With grpcio's fork handlers on, about one child in twenty started by ``fork`` with a busy channel in
the parent aborts before exec (a demo peer or a restarted test peer that never starts). Each case runs
in a fresh interpreter with a real gRPC server and a channel busy in a thread, and starts 200 children
through :class:`peer.node.lifetime.ChildProcesses` (each child echoes, so one that died before exec
shows): with the handlers turned off before grpc is imported (every entry point does that), and with
grpc imported first (the children then start without a ``preexec_fn``). 200 children are enough that,
without the defence, some of them almost surely die.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from helpers.procs import ROOT

SCRIPT = r"""
import sys, threading
from concurrent import futures
order = sys.argv[1]
if order == "safe-first":
    from models.grpc_fork import grpc_fork_safe
    assert grpc_fork_safe()
import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
if order == "grpc-first":
    from models.grpc_fork import fork_is_safe, grpc_fork_safe
    assert not grpc_fork_safe() and not fork_is_safe()
from peer.node.lifetime import ChildProcesses

server = grpc.server(futures.ThreadPoolExecutor(2))
health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
port = server.add_insecure_port("127.0.0.1:0")
server.start()
stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
stop = threading.Event()
def busy():
    while not stop.is_set():
        stub.Check(health_pb2.HealthCheckRequest())
threading.Thread(target=busy, daemon=True).start()
stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
from pathlib import Path
logs = Path(sys.argv[3])
procs = ChildProcesses(logs, watchdog=False)
ran = 0
for i in range(int(sys.argv[2])):
    code = procs.start(f"c{i}", ["echo", "ran"]).wait(timeout=30)
    ran += code == 0 and (logs / f"c{i}.log").read_text() == "ran\n"
stop.set()
print(ran)
"""


@pytest.mark.parametrize("order", ["safe-first", "grpc-first"])
def test_children_started_beside_a_busy_grpc_channel_all_run(order, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRPC_")}  # a fresh process's environment
    env["PYTHONPATH"] = str(ROOT)
    n = 200
    out = subprocess.run([sys.executable, "-c", SCRIPT, order, str(n), str(tmp_path)], capture_output=True,
                         text=True, env=env, cwd=ROOT, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout.split()[-1]) == n, f"children that died before exec: {n - int(out.stdout.split()[-1])}"
