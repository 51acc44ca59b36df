"""TLS end to end, and secrets never logged: a real ``hivepath coordinator serve --tls-cert --tls-key``
process; a peer joins, heartbeats, reports, leaves over TLS (verified against the CA), the operator
bans and unbans with the CLI over TLS; then every log line (server, CLI, the peer's own logging at
DEBUG) is searched for the run token and the coordinator's private key."""

from __future__ import annotations

import logging
import os
import subprocess

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from peer.localnet import free_port, hivepath_cmd, wait_for
from helpers.tls import ca_and_server_cert
from peer.coordinator_client import (CoordinatorClient, CoordinatorUnavailable, NotACoordinator, PeerBanned, PeerInfo,
                                     Progress)
from peer.network import CredentialVerifier

pytestmark = pytest.mark.integration

TOKEN = "tls-secret-token-7f3a9c"
RUN_TOML = """
preset = "tiny"
[coordinator]
lease_timeout = 10.0
heartbeat_interval = 0.5
credential_timeout = 2.0
flush_interval = 0.2
tick_interval = 0.2
"""


def _serving(port: int, ca: str) -> bool:
    creds = grpc.ssl_channel_credentials(root_certificates=open(ca, "rb").read())
    with grpc.secure_channel(f"127.0.0.1:{port}", creds) as ch:
        try:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1)
        except grpc.RpcError:
            return False
        return r.status == health_pb2.HealthCheckResponse.SERVING


def _cli(tls, port, *args):
    return subprocess.run(hivepath_cmd("--log-level", "DEBUG", "coordinator", *args, "--coordinator",
                                       f"127.0.0.1:{port}", "--tls-ca", tls["ca"]),
                          env={**os.environ, "HIVEPATH_TOKEN": TOKEN}, capture_output=True, text=True, timeout=60)


def test_tls_end_to_end_and_no_secret_in_any_log(procs, tmp_path, caplog):
    tls = ca_and_server_cert(tmp_path)
    (tmp_path / "run.toml").write_text(RUN_TOML)
    port, http_port, db = free_port(), free_port(), tmp_path / "state.db"
    procs.start("coord", hivepath_cmd("--log-level", "DEBUG", "coordinator", "serve", "--run-config",
                                      str(tmp_path / "run.toml"), "--db", str(db), "--host", "127.0.0.1",
                                      "--port", str(port), "--http-port", str(http_port),
                                      "--tls-cert", tls["cert"], "--tls-key", tls["key"]),
                env={"HIVEPATH_TOKEN": TOKEN})
    wait_for(lambda: _serving(port, tls["ca"]), 60, "TLS coordinator serving", interval=0.2)
    key_pem = (tmp_path / "state.db.key").read_text()

    caplog.set_level(logging.DEBUG)
    info = PeerInfo("12D3KooWTSPeerAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA", "cpu", 8 << 30, 1000.0, public_key=b"ka")
    other = PeerInfo("12D3KooWTSPeerBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBB", "cpu", 8 << 30, 1000.0, public_key=b"kb")
    a = CoordinatorClient(f"127.0.0.1:{port}", TOKEN, info, tls_ca=tls["ca"])
    b = CoordinatorClient(f"127.0.0.1:{port}", TOKEN, other, tls_ca=tls["ca"])
    try:
        joined = a.join()
        b.join()
        verifier = CredentialVerifier(joined.run_config.run_id, joined.coordinator_public_key)
        first = a.credential
        assert verifier.check(first, info.peer_id) == ""
        # credential_timeout 2 s: heartbeats renew it once 1 s is left
        wait_for(lambda: a.heartbeat([Progress("L0M0", 1, 100, 3.0)]).credential != b"", 30, "a renewed credential",
                 interval=0.2)
        assert a.credential != first and verifier.check(a.credential, info.peer_id) == ""
        assert b.report_peer(info.peer_id, "L0M0", 1, "NaN")[0] is False

        r = _cli(tls, port, "ban", info.peer_id, "--reason", "operator test")
        assert r.returncode == 0 and f"{info.peer_id}: banned" in r.stdout, r.stderr
        with pytest.raises(PeerBanned, match="operator test"):
            a.heartbeat()
        r = _cli(tls, port, "unban", info.peer_id)
        assert r.returncode == 0 and "left" in r.stdout, r.stderr
        assert a.join().rejoined
        status = _cli(tls, port, "status", "--json")
        assert status.returncode == 0 and '"live_leases": 2' in status.stdout
        a.leave("done")
        b.leave("done")

        plain = CoordinatorClient(f"127.0.0.1:{port}", TOKEN, info, retry_timeout=0.5, rpc_timeout=0.5)
        with pytest.raises(NotACoordinator, match="TLS server answers.*--tls-ca"):
            plain.join()  # the TLS port never speaks plaintext, and the client says so at once
        plain.close()
        stranger = ca_and_server_cert(tmp_path / "stranger")
        wrong_ca = CoordinatorClient(f"127.0.0.1:{port}", TOKEN, info, tls_ca=stranger["ca"], retry_timeout=0.5,
                                     rpc_timeout=0.5)
        with pytest.raises(CoordinatorUnavailable):
            wrong_ca.join()  # a server whose certificate another CA signed is refused
        wrong_ca.close()
    finally:
        a.close()
        b.close()

    logs = {"coordinator": procs.log("coord"), "cli": r.stdout + r.stderr + status.stderr, "peer": caplog.text}
    assert "joined" in logs["coordinator"] and "banned" in logs["coordinator"] and "DEBUG" in logs["coordinator"]
    key_body = "".join(key_pem.strip().splitlines()[1:-1])
    for name, text in logs.items():
        assert TOKEN not in text, f"the run token leaked into the {name} log"
        assert key_body[:24] not in text, f"the coordinator key leaked into the {name} log"
