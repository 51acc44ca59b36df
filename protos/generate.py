"""Regenerate the committed gRPC stubs: ``python -m protos.generate``.

Every contract lives here, compiled from the repository root so the generated modules import each
other as ``protos.hivepath.*`` and never shadow the ``hivepath`` command package:

- ``protos/hivepath/coordinator/v1/coordinator.proto``: the peer-coordinator service (package
  ``hivepath.coordinator.v1``), with ``_pb2_grpc.py`` stubs.
- ``protos/hivepath/peer/v1/net.proto``: the peers' averaging messages (matchmaking, all-reduce parts,
  state transfer); ``protos/hivepath/peer/v1/stage.proto``: stage mode's activations and gradients;
  ``protos/hivepath/peer/v1/data.proto``: a dataset's chunks between seeders and fetchers. All are
  package ``hivepath.peer.v1`` and carried over hivemind's P2P streams: their services (``Averaging``,
  ``Stage``, ``Data``) describe the peers' stream handlers and get no gRPC stubs.

``tests/protos/test_protos_drift.py`` fails when the committed files differ from a fresh generation.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
import tempfile
from pathlib import Path

__all__ = ["PROTO_FILES", "SERVICE_PROTOS", "generate", "outputs", "main"]

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent.parent
PROTO_FILES = [
    "protos/hivepath/coordinator/v1/coordinator.proto",
    "protos/hivepath/peer/v1/net.proto",
    "protos/hivepath/peer/v1/stage.proto",
    "protos/hivepath/peer/v1/data.proto",
]
SERVICE_PROTOS = frozenset({"protos/hivepath/coordinator/v1/coordinator.proto"})
"""Protos that define a gRPC service and so also get a ``_pb2_grpc.py``."""


def outputs(proto: str) -> list[str]:
    """Paths (relative to the repository root) that ``proto`` compiles to."""
    stem = proto[: -len(".proto")]
    suffixes = ("_pb2.py", "_pb2.pyi") + (("_pb2_grpc.py",) if proto in SERVICE_PROTOS else ())
    return [stem + s for s in suffixes]


def generate(out_dir: Path) -> list[Path]:
    """Compile every proto into ``out_dir`` (mirroring the repository layout); return the files written."""
    from grpc_tools import protoc

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    include = Path(protoc.__file__).resolve().parent / "_proto"
    for proto in PROTO_FILES:
        args = [
            "grpc_tools.protoc",
            f"-I{ROOT}",
            f"-I{include}",
            f"--python_out={out_dir}",
            f"--pyi_out={out_dir}",
            *([f"--grpc_python_out={out_dir}"] if proto in SERVICE_PROTOS else []),
            str(ROOT / proto),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {proto}")
    return [out_dir / path for proto in PROTO_FILES for path in outputs(proto)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m protos.generate", description=__doc__.splitlines()[0])
    parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        for path in generate(Path(tmp)):
            dest = ROOT / path.relative_to(tmp)
            if dest.exists() and dest.read_bytes() == path.read_bytes():
                continue  # unchanged: leave the file (and its mtime) alone
            shutil.copyfile(path, dest)
            log.info("wrote %s", dest.relative_to(ROOT))
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    sys.exit(main())
