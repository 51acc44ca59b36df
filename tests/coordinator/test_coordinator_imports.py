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


def _image_sources() -> list[str]:
    """The source paths deploy/Dockerfile.coordinator copies into its wheel (its build stage's COPYs)."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "deploy" / "Dockerfile.coordinator").read_text()
    build = text.split("AS build", 1)[1].split("\nFROM ", 1)[0]
    return [src for line in build.splitlines() if line.startswith("COPY ") for src in line.split()[1:-1]]


def test_what_the_coordinator_image_copies_runs_serve_without_the_peer(tmp_path):
    """The files the coordinator image is built from (read from its Dockerfile) are enough to import the
    service and run ``hivepath coordinator serve --help``; ``peer`` is not among them, and the client
    commands, which need it, refuse in one line. (tests/docker runs the same in the real image.)"""
    import shutil
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    sources = _image_sources()
    assert "peer" not in sources and "models" not in sources and "coordinator" in sources and "protos" in sources
    for src in sources:
        if (root / src).is_dir():
            shutil.copytree(root / src, tmp_path / src, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            (tmp_path / src).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(root / src, tmp_path / src)
    import sysconfig

    # -S: no site, so no editable install of this checkout; the installed packages are added by hand
    packages = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    code = (
        "import sys\n"
        f"sys.path[:0] = [{str(tmp_path)!r}]\n"
        f"sys.path += {packages!r}\n"
        "import importlib.util, coordinator.server\n"
        "assert importlib.util.find_spec('peer') is None and 'torch' not in sys.modules\n"
        "from hivepath.cli import main\n"
        "assert main(['coordinator', 'status', '--token', 't']) == 2\n"
        "main(['coordinator', 'serve', '--help'])\n"
    )
    import os

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # a checkout on it would bring the peer back
    out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path, env=env)
    assert out.returncode == 0 and "--run-config" in out.stdout, out.stderr
    assert "'hivepath coordinator status' is a client and needs the peer package" in out.stderr
