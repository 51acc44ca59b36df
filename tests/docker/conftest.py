"""Fixtures of the container tests (marker ``docker``).

Without a reachable engine every test here skips with the reason; ``HIVEPATH_REQUIRE_DOCKER=1`` (CI)
turns that skip into a failure. Images are built once per session (Docker's layer cache makes a
rebuild of unchanged sources take seconds) from ``HIVEPATH_BASE_IMAGE``: the locally built
``local/hivepath-base:bookworm`` when it exists (CI: deploy/ci/docker-setup.sh), else the public
``python:3.11-slim-bookworm``.
"""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from dockerctl import ROOT, Docker, engine_problem

TAG = "test"
LOCAL_BASE = "local/hivepath-base:bookworm"


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.docker)
            # the first test also builds the images (a cold peer image takes minutes on 2 cores)
            item.add_marker(pytest.mark.timeout(1500))


@dataclass
class Images:
    coordinator: str
    peer: str
    base: str
    build_seconds: dict


@pytest.fixture(scope="session")
def docker_engine() -> None:
    problem = engine_problem()
    if problem:
        if os.environ.get("HIVEPATH_REQUIRE_DOCKER") == "1":
            pytest.fail(f"HIVEPATH_REQUIRE_DOCKER=1 but {problem}")
        pytest.skip(problem)


@pytest.fixture(scope="session")
def docker(docker_engine):
    d = Docker(f"s{uuid.uuid4().hex[:8]}")
    swept = d.sweep_stale()
    if swept:
        print(f"removed {len(swept)} leftovers of interrupted test sessions: {', '.join(swept)}")
    try:
        yield d
    finally:
        d.cleanup()


def base_image(docker: Docker) -> str:
    explicit = os.environ.get("HIVEPATH_BASE_IMAGE")
    if explicit:
        return explicit
    if docker("image", "inspect", LOCAL_BASE, check=False).returncode == 0:
        return LOCAL_BASE
    return "python:3.11-slim-bookworm"


def _build(docker: Docker, name: str, base: str) -> float:
    """Build ``hivepath/{name}:test`` from ``deploy/Dockerfile.{name}``; returns the seconds it took."""
    start = time.monotonic()
    docker("build", "-q", "-f", str(ROOT / "deploy" / f"Dockerfile.{name}"), "--build-arg", f"BASE_IMAGE={base}",
           "-t", f"hivepath/{name}:{TAG}", str(ROOT), timeout=900)
    return round(time.monotonic() - start, 1)


@pytest.fixture(scope="session")
def coordinator_image(docker) -> str:
    """The coordinator image alone (no torch to install: tests of that image need not wait for the peer's)."""
    _build(docker, "coordinator", base_image(docker))
    return f"hivepath/coordinator:{TAG}"


@pytest.fixture(scope="session")
def images(docker, coordinator_image) -> Images:
    base = base_image(docker)
    took = {"peer": _build(docker, "peer", base)}
    return Images(coordinator_image, f"hivepath/peer:{TAG}", base, took)
