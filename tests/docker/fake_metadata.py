"""A fake cloud metadata server playing AWS IMDSv2 and GCP's metadata server (stdlib only).

Used two ways: in-process by ``tests/peer/node/test_spot.py`` (``FakeMetadata`` on 127.0.0.1:0), and as a
container on a test network by ``tests/docker`` (``python3 fake_metadata.py --port 80``), where the
test posts a notice through ``POST /_control`` with a JSON body such as
``{"aws_action": "terminate", "aws_in": 30}`` or ``{"gcp_preempted": true}``.

Behaviour follows the real endpoints: AWS answers 404 on ``spot/instance-action`` until an action is
scheduled and 401 to a missing or expired token once ``require_token`` is set; GCP answers 403 to a
request without ``Metadata-Flavor: Google`` and returns ``FALSE``/``TRUE`` with that header set.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional


class MetadataState:
    """What the fake server announces; mutate it (under ``lock``) to post a notice."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.aws_action: Optional[str] = None
        self.aws_time: Optional[float] = None
        self.aws_raw: Optional[str] = None
        """When set, returned verbatim (with 200) instead of a well-formed instance action."""
        self.require_token = True
        self.token_enabled = True
        """False plays an IMDSv1-only instance: the token PUT answers 403."""
        self.valid_tokens: set[str] = set()
        self.gcp_preempted = False
        self.gcp_flavor_header = True
        self.hang = threading.Event()
        """Set: every request blocks until ``release`` is set (an endpoint that does not answer)."""
        self.release = threading.Event()
        self.requests: list[tuple[str, str, dict]] = []

    def control(self, doc: dict) -> None:
        with self.lock:
            if "aws_action" in doc:
                self.aws_action = doc["aws_action"]
                self.aws_time = time.time() + float(doc.get("aws_in", 120))
            if "gcp_preempted" in doc:
                self.gcp_preempted = bool(doc["gcp_preempted"])
            if "expire_tokens" in doc:
                self.valid_tokens.clear()


def make_handler(state: MetadataState) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _send(self, code: int, body: str, headers: Optional[dict] = None) -> None:
            data = body.encode()
            self.send_response(code)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(data)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(data)

        def _record(self) -> None:
            with state.lock:
                state.requests.append((self.command, self.path, {k.lower(): v for k, v in self.headers.items()}))
            if state.hang.is_set():
                state.release.wait(60.0)

        def do_PUT(self) -> None:  # noqa: N802
            self._record()
            if self.path != "/latest/api/token":
                return self._send(404, "not found")
            ttl = self.headers.get("X-aws-ec2-metadata-token-ttl-seconds")
            if not state.token_enabled:
                return self._send(403, "forbidden")
            if not ttl:
                return self._send(400, "missing ttl")
            token = f"tok-{time.monotonic_ns()}"
            with state.lock:
                state.valid_tokens.add(token)
            self._send(200, token)

        def do_POST(self) -> None:  # noqa: N802
            if self.path != "/_control":
                return self._send(404, "not found")
            length = int(self.headers.get("Content-Length") or 0)
            state.control(json.loads(self.rfile.read(length) or b"{}"))
            self._send(200, "ok")

        def do_GET(self) -> None:  # noqa: N802
            self._record()
            if self.path == "/latest/meta-data/spot/instance-action":
                return self._aws()
            if self.path == "/computeMetadata/v1/instance/preempted":
                return self._gcp()
            if self.path == "/_health":
                return self._send(200, "ok")
            self._send(404, "not found")

        def _aws(self) -> None:
            token = self.headers.get("X-aws-ec2-metadata-token")
            with state.lock:
                if state.require_token and state.token_enabled and token not in state.valid_tokens:
                    return self._send(401, "unauthorized")
                if state.aws_raw is not None:
                    return self._send(200, state.aws_raw)
                if state.aws_action is None:
                    return self._send(404, "not found")
                when = datetime.fromtimestamp(state.aws_time or time.time(), tz=timezone.utc)
                body = json.dumps({"action": state.aws_action, "time": when.strftime("%Y-%m-%dT%H:%M:%SZ")})
            self._send(200, body)

        def _gcp(self) -> None:
            if self.headers.get("Metadata-Flavor") != "Google":
                return self._send(403, "missing Metadata-Flavor header")
            headers = {"Metadata-Flavor": "Google"} if state.gcp_flavor_header else {}
            self._send(200, "TRUE" if state.gcp_preempted else "FALSE", headers)

        def log_message(self, fmt: str, *args) -> None:
            pass

    return Handler


class MetadataServer(ThreadingHTTPServer):
    """A threading HTTP server that stays quiet about clients that hung up: the timeout tests hold a
    request until the client gave up, and the late answer then meets a closed socket (socketserver
    would print that traceback into the test output)."""

    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        if isinstance(sys.exc_info()[1], ConnectionError):
            return
        super().handle_error(request, client_address)


class FakeMetadata:
    """The fake server in a background thread; ``url`` is its base URL."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0):
        self.state = MetadataState()
        self.server = MetadataServer((host, port), make_handler(self.state))
        self.url = f"http://{host}:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def __enter__(self) -> "FakeMetadata":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.state.release.set()
        self.server.shutdown()
        self.server.server_close()


def main() -> None:
    parser = argparse.ArgumentParser(description="fake AWS/GCP metadata server for hivepath's tests")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=80)
    args = parser.parse_args()
    server = MetadataServer((args.host, args.port), make_handler(MetadataState()))
    server.serve_forever()


if __name__ == "__main__":
    main()
