"""A wrong coordinator address is named, not retried in silence: the client finds out what answers
there (nothing, TLS, an HTTP/1 server, another gRPC service, plain text where TLS was asked for) the
first time gRPC cannot reach it, and fails at once with one line for a wrong protocol; an address
without a port means the documented default port. The servers are real: a ``hivepath coordinator
serve`` process over TLS (its status page is the HTTP/1 server) and a gRPC server without the
coordinator's service."""

from __future__ import annotations

import logging
import subprocess
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2_grpc

from peer.localnet import ProcessGroup, free_port, hivepath_cmd, wait_for
from helpers.tls import ca_and_server_cert
from models.settings import COORDINATOR_PORT
from peer.coordinator_client import (CoordinatorClient, CoordinatorUnavailable, NotACoordinator, PeerInfo,
                                     check_address)
from peer.coordinator_client.transport import HTTP1, HTTP2, NOTHING, TLS, what_answers

pytestmark = pytest.mark.integration

TOKEN = "address-test-token"
RUN_TOML = """
preset = "tiny"
[coordinator]
flush_interval = 0.2
tick_interval = 0.2
"""


@pytest.fixture(scope="module")
def tls_coordinator(tmp_path_factory):
    """``(grpc_port, http_port, certificate paths)`` of one coordinator process serving gRPC over TLS."""
    tmp = tmp_path_factory.mktemp("address")
    (tmp / "run.toml").write_text(RUN_TOML)
    tls = ca_and_server_cert(tmp / "tls")
    port, http_port = free_port(), free_port()
    group = ProcessGroup(tmp / "logs")
    try:
        group.start("coordinator", hivepath_cmd(
            "coordinator", "serve", "--run-config", str(tmp / "run.toml"), "--db", str(tmp / "state.db"),
            "--host", "127.0.0.1", "--port", str(port), "--http-port", str(http_port),
            "--tls-cert", tls["cert"], "--tls-key", tls["key"]), env={"HIVEPATH_TOKEN": TOKEN})
        wait_for(lambda: what_answers(f"127.0.0.1:{http_port}").kind == HTTP1, 60, "the coordinator's status page")
        yield port, http_port, tls
    finally:
        group.close()


@pytest.fixture
def other_grpc_service():
    """A plain-text gRPC server with the health service only: the address of another gRPC service."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(None)


class _Retries(logging.Handler):
    """Counts the client's "retrying in" lines: one for each backoff it waited before another attempt."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += "retrying in" in record.getMessage()


def _join_error(address: str, tls_ca: str | None = None, retry_timeout: float = 60.0) -> tuple[Exception, int]:
    """The error ``join`` raises against ``address``, and how many times the client retried before it."""
    client = CoordinatorClient(address, TOKEN, PeerInfo("12D3KooWaddressxxxxxx", "cpu", 8 << 30, 1000.0, public_key=b"a"),
                               tls_ca=tls_ca, retry_timeout=retry_timeout, rpc_timeout=5.0, seed=0)
    logger = logging.getLogger("peer.coordinator_client.calls")
    retries, level = _Retries(), logger.level
    logger.addHandler(retries)
    logger.setLevel(logging.DEBUG)
    try:
        with pytest.raises(Exception) as e:
            client.join()
        return e.value, retries.count
    finally:
        logger.removeHandler(retries)
        logger.setLevel(level)
        client.close()


def test_an_address_without_a_port_means_the_default_port():
    assert check_address("coord.example.org") == f"coord.example.org:{COORDINATOR_PORT}"
    assert check_address(" 10.0.0.5 ") == f"10.0.0.5:{COORDINATOR_PORT}"
    assert check_address("[2001:db8::1]") == f"[2001:db8::1]:{COORDINATOR_PORT}"
    assert check_address("coord.example.org:7711") == "coord.example.org:7711"
    assert CoordinatorClient("127.0.0.1", TOKEN).address == f"127.0.0.1:{COORDINATOR_PORT}"


def test_what_answers_tells_the_protocols_apart(tls_coordinator, other_grpc_service):
    port, http_port, _ = tls_coordinator
    assert what_answers(f"127.0.0.1:{port}").kind == TLS
    assert what_answers(f"127.0.0.1:{http_port}").kind == HTTP1
    assert what_answers(other_grpc_service).kind == HTTP2
    nothing = what_answers(f"127.0.0.1:{free_port()}")
    assert nothing.kind == NOTHING and "connection refused" in nothing.text


def test_a_tls_coordinator_without_tls_ca_is_named_at_once(tls_coordinator):
    error, retries = _join_error(f"127.0.0.1:{tls_coordinator[0]}")
    assert isinstance(error, NotACoordinator) and error.exit_code == 2, error
    assert "TLS" in str(error) and "--tls-ca" in str(error) and retries == 0


def test_the_status_page_port_is_named_as_http(tls_coordinator):
    error, retries = _join_error(f"127.0.0.1:{tls_coordinator[1]}")
    assert isinstance(error, NotACoordinator), error
    assert "HTTP/1" in str(error) and str(COORDINATOR_PORT) in str(error) and retries == 0


def test_another_grpc_service_is_named(other_grpc_service):
    error, retries = _join_error(other_grpc_service)
    assert isinstance(error, NotACoordinator) and "not hivepath's coordinator service" in str(error), error
    assert retries == 0


def test_plain_text_where_tls_is_asked_for_is_named(other_grpc_service, tls_coordinator):
    error, retries = _join_error(other_grpc_service, tls_ca=tls_coordinator[2]["ca"])
    assert isinstance(error, NotACoordinator) and "without TLS" in str(error) and "drop --tls-ca" in str(error), error
    assert retries == 0


def test_nothing_listening_warns_once_then_names_it_when_the_retries_end(caplog):
    address = f"127.0.0.1:{free_port()}"
    with caplog.at_level(logging.WARNING, logger="peer.coordinator_client.calls"):
        error, _ = _join_error(address, retry_timeout=2.0)
    assert isinstance(error, CoordinatorUnavailable) and "nothing answers (connection refused)" in str(error), error
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and address in warnings[0] and "retrying for up to 2s" in warnings[0], warnings


def test_nothing_listening_is_named_within_the_first_contact_limit_not_the_retry_timeout():
    error, retries = _join_error(f"127.0.0.1:{free_port()}", retry_timeout=120.0)
    assert isinstance(error, CoordinatorUnavailable) and error.exit_code == 3, error
    assert "nothing answers (connection refused)" in str(error) and str(COORDINATOR_PORT) in str(error), error
    # retried (a coordinator may be restarting), then given up because the next backoff would pass
    # FIRST_CONTACT_TIMEOUT: the first-contact error names the address, where the end of the 120 s of
    # retries would say "unreachable for 120s"
    assert retries >= 1 and "unreachable for" not in str(error) and "check the address" in str(error), error


def test_the_cli_names_a_wrong_port_in_one_line(tls_coordinator):
    r = subprocess.run(hivepath_cmd("coordinator", "status", "--token", TOKEN, "--coordinator",
                                    f"127.0.0.1:{tls_coordinator[1]}"), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "HTTP/1" in lines[0] and "Traceback" not in r.stderr, r.stderr
