"""Container health check of the hivepath images (``HEALTHCHECK`` runs it; exit 0 healthy, 1 not).

- ``HIVEPATH_ROLE=coordinator``: the coordinator's gRPC health service on 127.0.0.1:``HIVEPATH_PORT``
  must answer SERVING (this is what the service itself reports: NOT_SERVING while it shuts down).
- ``HIVEPATH_ROLE=peer``/``archive``: the process's local status endpoint
  (``http://127.0.0.1:$HIVEPATH_STATUS_PORT/healthz``, default port 7702; ``peer.node.local_status``)
  must answer 200: the peer is in a waiting state (starting, joining, loading state, draining) or
  made progress within its ``HIVEPATH_STALL_TIMEOUT``; 503 (stuck) or no answer is unhealthy.
  With ``HIVEPATH_STATUS_PORT=0`` (the endpoint turned off) it falls back to checking that a live
  ``hivepath`` process of that role runs and its identity file exists.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def coordinator_healthy(timeout: float = 3.0) -> tuple[bool, str]:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    target = f"127.0.0.1:{os.environ.get('HIVEPATH_PORT', '7700')}"
    if os.environ.get("HIVEPATH_TLS_CERT"):
        return _http_healthy(timeout)
    with grpc.insecure_channel(target) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""),
                                                              timeout=timeout)
        except grpc.RpcError as e:
            return False, f"gRPC health check on {target} failed: {e.code().name}"
    ok = reply.status == health_pb2.HealthCheckResponse.SERVING
    return ok, f"gRPC health on {target}: {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}"


def _http_healthy(timeout: float) -> tuple[bool, str]:
    """A TLS coordinator's gRPC port needs its CA: ask the plain-HTTP status page's /healthz instead."""
    import urllib.request

    url = f"http://127.0.0.1:{os.environ.get('HIVEPATH_HTTP_PORT', '7701')}/healthz"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status == 200, f"{url}: {resp.status}"
    except OSError as e:
        return False, f"{url}: {e}"


def _live_processes(word: str) -> bool:
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and any(b"hivepath" in part for part in cmdline) and word.encode() in cmdline:
            return True
    return False


def status_healthy(port: int, timeout: float = 3.0) -> tuple[bool, str]:
    """Ask the peer's local status endpoint: 200 healthy, 503 stuck (the body says why)."""
    import urllib.error
    import urllib.request

    url = f"http://127.0.0.1:{port}/healthz"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status == 200, f"{url}: {resp.read().decode(errors='replace').strip()}"
    except urllib.error.HTTPError as e:
        return False, f"{url}: {e.code} {e.read().decode(errors='replace').strip()}"
    except OSError as e:
        return False, f"{url}: no answer ({getattr(e, 'reason', None) or e})"


def peer_healthy(role: str) -> tuple[bool, str]:
    port = os.environ.get("HIVEPATH_STATUS_PORT", "7702").strip() or "7702"
    if not port.isdigit():
        return False, f"HIVEPATH_STATUS_PORT={port!r} is not a port number"
    if int(port) != 0:
        return status_healthy(int(port))
    word = "join" if role == "peer" else "archive"
    if not _live_processes(word):
        return False, f"no live 'hivepath {word}' process"
    if role == "peer":
        work = Path(os.environ.get("HIVEPATH_WORK_DIR", "~/.hivepath")).expanduser()
    else:
        work = Path(os.environ.get("HIVEPATH_ARCHIVE_DIR", "/data/archive"))
    identity = Path(os.environ.get("HIVEPATH_IDENTITY") or work / "identity.key")
    if not identity.exists():
        return False, f"{identity} not written yet: the DHT node is not up"
    return True, f"hivepath {word} running, identity {identity}"


def main() -> int:
    role = os.environ.get("HIVEPATH_ROLE", "peer")
    ok, why = coordinator_healthy() if role == "coordinator" else peer_healthy(role)
    sys.stdout.write(("healthy: " if ok else "unhealthy: ") + why + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
