"""What the coordinator image holds: ``coordinator/``, ``protos/``, the command line and the
torch-free ``models.config`` and ``models.errors``; not the peer, not torch, not the rest of ``models``.

Builds only the coordinator image (no peer image, no torch), so it is the quick container test.
"""

from __future__ import annotations

import json

from dockerctl import DockerError


def _python(docker, image: str, code: str, check: bool = True):
    """Run ``python -c code`` in a throwaway container of ``image`` (the image's venv is first on PATH)."""
    return docker("run", "--rm", "--entrypoint", "python", image, "-c", code, timeout=120, check=check)


def test_the_coordinator_image_cannot_import_the_peer(docker, coordinator_image):
    out = _python(docker, coordinator_image, "import peer", check=False)
    assert out.returncode == 1 and "ModuleNotFoundError: No module named 'peer'" in out.stderr, out.stderr
    probe = ("import importlib.util, json, sys; import coordinator.server, hivepath.cli; "
             "spec = lambda m: importlib.util.find_spec(m) is not None; "
             "print(json.dumps({m: spec(m) for m in ('peer', 'torch', 'hivemind', 'bench', 'models.lattice', "
             "'models.checkpoint', 'models.config', 'coordinator', 'protos')}))")
    found = json.loads(_python(docker, coordinator_image, probe).stdout)
    assert found == {"peer": False, "torch": False, "hivemind": False, "bench": False, "models.lattice": False,
                     "models.checkpoint": False, "models.config": True, "coordinator": True, "protos": True}


def test_the_coordinator_image_serves_and_refuses_client_commands_in_one_line(docker, coordinator_image):
    out = docker("run", "--rm", "-e", "HIVEPATH_TOKEN=t", coordinator_image, "coordinator", "serve", "--help",
                 timeout=120)
    assert "--run-config" in out.stdout and "--db" in out.stdout, out.stdout
    try:
        docker("run", "--rm", "-e", "HIVEPATH_TOKEN=t", coordinator_image, "coordinator", "status",
               "--coordinator", "127.0.0.1:1", timeout=120)
    except DockerError as e:
        refused = str(e)
    else:
        raise AssertionError("the status client ran in an image without the peer package")
    assert "failed (2)" in refused and "hivepath: error: 'hivepath coordinator status' is a client" in refused
    assert "Traceback" not in refused
