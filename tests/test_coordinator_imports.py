"""The coordinator runs in a small image: none of its modules, nor the peer's coordinator client,
pulls in torch or hivemind; and the coordinator never imports the peer package."""

from __future__ import annotations

import subprocess
import sys

MODULES = [
    "coordinator", "coordinator.core", "coordinator.scheduler", "coordinator.server", "coordinator.servicer",
    "coordinator.sqlite_store", "coordinator.web", "coordinator.status", "coordinator.settings",
    "hivepath.cmd_coordinator", "peer.coordinator_client", "protos",
]


def test_no_torch_no_hivemind_no_peer_in_coordinator():
    code = (
        "import sys\n"
        f"for m in {MODULES!r}: __import__(m)\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'hivemind'))\n"
        "assert not bad, bad\n"
        "coordinator_mods = [m for m in sys.modules if m.startswith('coordinator')]\n"
        "print('ok', len(coordinator_mods))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("ok"), out.stderr


def test_coordinator_package_does_not_import_peer():
    code = (
        "import sys, coordinator.server, coordinator.core\n"
        "assert not [m for m in sys.modules if m == 'peer' or m.startswith('peer.')]\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
