"""Dependency direction (DESIGN.md): ``models`` imports no networking and nothing else of ours;
``models.config`` and the ``coordinator`` package import no torch. Checked in fresh interpreters."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from helpers.procs import ROOT

NETWORKING = ("hivemind", "grpc", "google.protobuf", "aiohttp", "requests", "urllib3", "zmq", "multiaddr")
OURS = ("peer", "coordinator", "protos", "hivepath", "bench")
MODELS = ("models", "models.config", "models.codec_spec", "models.presets", "models.errors", "models.lattice",
          "models.tokenizer", "models.corpus", "models.data", "models.routing", "models.evaluate", "models.checkpoint",
          "models.training")


def _loaded_after(code: str) -> set[str]:
    """Top-level and dotted names in ``sys.modules`` after running ``code`` in a fresh interpreter."""
    script = code + "\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    return set(json.loads(r.stdout.strip().splitlines()[-1]))


def _hits(loaded: set[str], prefixes: tuple[str, ...]) -> list[str]:
    return sorted(m for m in loaded if any(m == p or m.startswith(p + ".") for p in prefixes))


def test_models_imports_no_networking_and_nothing_of_ours():
    loaded = _loaded_after("\n".join(f"import {m}" for m in MODELS))
    assert "torch" in loaded  # the check is real: the heavy modules were imported
    assert _hits(loaded, NETWORKING) == []
    assert _hits(loaded, OURS) == []


@pytest.mark.parametrize("module", ["models", "models.config", "models.codec_spec", "models.presets",
                                    "models.errors"])
def test_torch_free_parts_of_models(module):
    loaded = _loaded_after(f"import {module}")
    assert _hits(loaded, ("torch", "numpy", "hivemind")) == []


def test_coordinator_imports_neither_torch_nor_hivemind():
    code = (
        "import importlib, pkgutil, coordinator\n"
        "for info in pkgutil.walk_packages(coordinator.__path__, 'coordinator.'):\n"
        "    importlib.import_module(info.name)\n"
    )
    loaded = _loaded_after(code)
    assert "coordinator" in loaded
    assert _hits(loaded, ("torch", "hivemind", "peer")) == []
