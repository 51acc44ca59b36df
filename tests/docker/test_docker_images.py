"""The images build and are what a deployment needs: small torch-free coordinator, CPU torch peer, non-root,
``hivepath`` behind the entrypoint, one-line errors for missing variables, CUDA image up to torch."""

from __future__ import annotations

import json

from dockerctl import ROOT


def _run(docker, image, *args, entrypoint=None, env=None):
    cmd = ["run", "--rm", "--init"]
    for k, v in (env or {}).items():
        cmd += ["-e", f"{k}={v}"]
    if entrypoint:
        cmd += ["--entrypoint", entrypoint]
    return docker(*cmd, image, *args, check=False, timeout=120)


PROBE = ("import importlib.util as u, json, os, shutil; print(json.dumps({'uid': os.getuid(), "
         "'torch': u.find_spec('torch') is not None, 'hivemind': u.find_spec('hivemind') is not None, "
         "'hivepath': shutil.which('hivepath')}))")


def test_coordinator_image_is_small_torch_free_and_non_root(docker, images):
    size = docker.inspect(images.coordinator)["Size"]
    assert size < 400e6, f"coordinator image is {size / 1e6:.0f} MB"
    out = _run(docker, images.coordinator, "-c", PROBE, entrypoint="python3")
    info = json.loads(out.stdout)
    assert info == {"uid": 10001, "torch": False, "hivemind": False, "hivepath": "/opt/hivepath/bin/hivepath"}
    cfg = docker.inspect(images.coordinator)["Config"]
    assert cfg["Healthcheck"]["Test"][-1] == "/usr/local/bin/hivepath-healthcheck"
    assert "/data" in cfg["Volumes"] and cfg["User"] == "10001:10001"


def test_peer_image_has_the_cpu_torch_and_the_cli(docker, images):
    out = _run(docker, images.peer, "-c", "import torch, hivemind.dht; print(torch.__version__, torch.cuda.is_available())",
               entrypoint="python3")
    assert out.returncode == 0, out.stderr
    version, cuda = out.stdout.split()
    assert version.startswith("2.13.0") and cuda == "False"
    out = _run(docker, images.peer, "--help")
    assert out.returncode == 0 and "peer" in out.stdout and "archive" in out.stdout and "coordinator" in out.stdout


def test_missing_required_variable_stops_the_container_with_one_line(docker, images):
    out = _run(docker, images.peer)  # CMD peer join, no variables
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "HIVEPATH_COORDINATOR is not set" in out.stderr
    out = _run(docker, images.peer, env={"HIVEPATH_COORDINATOR": "coordinator:7700"})
    assert out.returncode == 2 and "HIVEPATH_TOKEN is not set" in out.stderr
    out = _run(docker, images.coordinator)
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "HIVEPATH_TOKEN is not set" in out.stderr


def test_cuda_image_builds_up_to_the_torch_layer(docker, images):
    """Without a GPU the CUDA Dockerfile is built to its ``deps`` stage (everything but torch) on the
    same base (its first layers are Dockerfile.peer's, so this is mostly cache); the full image needs
    PyPI's CUDA torch and a GPU to be worth checking."""
    tag = "hivepath/peer-cuda:test-deps"
    docker("build", "-q", "-f", str(ROOT / "deploy" / "Dockerfile.peer-cuda"), "--target", "deps",
           "--build-arg", f"BASE_IMAGE={images.base}", "-t", tag, str(ROOT), timeout=900)
    out = _run(docker, tag, "-c", "import importlib.metadata as m, importlib.util as u; "
               "print(m.version('hivemind'), m.version('grpcio'), u.find_spec('torch'))", entrypoint="/opt/hivepath/bin/python")
    assert out.stdout.split() == ["1.1.12", "1.85.1", "None"], out.stdout + out.stderr
    # the tag is kept: its layers are the build cache of the next run (shared with Dockerfile.peer)
