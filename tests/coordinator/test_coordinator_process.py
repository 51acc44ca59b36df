"""The coordinator as operators run it: ``hivepath coordinator serve`` in its own process, killed with
``kill -9`` and restarted on the same database while peers keep retrying; the operator commands; and
a malformed run config failing with one clear line."""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from peer.localnet import free_port, hivepath_cmd, wait_for
from peer.coordinator_client import CoordinatorClient, PeerInfo, Progress

pytestmark = pytest.mark.integration

TOKEN = "process-test-token"
RUN_TOML = """
preset = "tiny"
[coordinator]
lease_timeout = 4.0
heartbeat_interval = 0.5
restart_grace = 30.0
flush_interval = 0.2
tick_interval = 0.2
"""


def serving(port: int) -> bool:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1)
        return r.status == health_pb2.HealthCheckResponse.SERVING


def start(procs, name, tmp_path, db, port, http_port):
    procs.start(name, hivepath_cmd("coordinator", "serve", "--run-config", str(tmp_path / "run.toml"), "--db", str(db),
                                   "--host", "127.0.0.1", "--port", str(port), "--http-port", str(http_port)),
                env={"HIVEPATH_TOKEN": TOKEN})
    wait_for(lambda: serving(port), 60, f"{name} serving", interval=0.2)


def peer(port: int, i: int, **kw) -> CoordinatorClient:
    info = PeerInfo(f"12D3KooWproc{'abcdefgh'[i]}xxxxxxx", "cpu", 8 << 30, 1000.0, public_key=b"k%d" % i)
    return CoordinatorClient(f"127.0.0.1:{port}", TOKEN, info, backoff_base=0.05, backoff_max=0.5, seed=i, **kw)


@pytest.fixture
def run_toml(tmp_path):
    (tmp_path / "run.toml").write_text(RUN_TOML)
    return tmp_path / "run.toml"


def test_kill9_restart_keeps_acknowledged_state_and_peers_reconnect(procs, tmp_path, run_toml):
    port, http_port, db = free_port(), free_port(), tmp_path / "state.db"
    start(procs, "coord1", tmp_path, db, port, http_port)
    a, b = peer(port, 0), peer(port, 1)
    try:
        ja, jb = a.join(), b.join()
        # acknowledged = durable: the join is in the database the moment the reply arrives
        with sqlite3.connect(db) as conn:
            rows = dict(conn.execute("SELECT peer_id, doc FROM peers"))
        assert set(rows) == {a.peer.peer_id, b.peer.peer_id}
        replies = []
        b.start_heartbeats(lambda: {"progress": [Progress(jb.assignment.module_ids[0], 1, 100, 3.0)]}, replies.append,
                           interval=0.2)
        wait_for(lambda: len(replies) >= 2, 30, "background heartbeats")

        procs.kill("coord1")  # kill -9
        n = len(replies)
        outcome = {}
        t = threading.Thread(target=lambda: outcome.update(reply=a.heartbeat()))  # retries while it is down
        t.start()
        start(procs, "coord2", tmp_path, db, port, http_port)
        t.join(60)
        assert not t.is_alive()
        assert not outcome["reply"].rejoined, "the lease survived the restart (grace period)"
        assert a.joined.lease_id == ja.lease_id
        wait_for(lambda: len(replies) > n + 2, 30, "heartbeats after the restart")
        assert not any(r.rejoined for r in replies), "no peer had to re-join"
        status = a.status()
        work = {p["peer_id"]: (p["state"], p["work"]) for p in status["peers"]}
        assert work == {a.peer.peer_id: ("active", ja.assignment.label()),
                        b.peer.peer_id: ("active", jb.assignment.label())}

        # a coordinator that lost everything (new database): peers re-register transparently
        procs.kill("coord2")
        start(procs, "coord3", tmp_path, tmp_path / "fresh.db", port, http_port)
        wait_for(lambda: any(r.rejoined for r in replies), 30, "transparent re-join")
        assert a.heartbeat().rejoined
        assert {p["peer_id"] for p in a.status()["peers"]} == {a.peer.peer_id, b.peer.peer_id}
    finally:
        a.close()
        b.close()


def test_operator_status_and_drain_commands(procs, tmp_path, run_toml):
    port, http_port = free_port(), free_port()
    start(procs, "coord", tmp_path, tmp_path / "s.db", port, http_port)
    a = peer(port, 2)
    try:
        a.join()
        env = {"HIVEPATH_TOKEN": TOKEN, "HIVEPATH_COORDINATOR": f"127.0.0.1:{port}"}
        import os

        full = {**os.environ, **env}
        out = subprocess.run(hivepath_cmd("coordinator", "status", "--json"), env=full, capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert [p["peer_id"] for p in json.loads(out.stdout)["peers"]] == [a.peer.peer_id]
        out = subprocess.run(hivepath_cmd("coordinator", "drain", a.peer.peer_id), env=full, capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0 and "draining" in out.stdout, out.stderr
        assert a.heartbeat().drain
        procs.signal("coord", signal.SIGTERM)
        assert procs.procs["coord"].wait(30) == 0
    finally:
        a.close()


@pytest.mark.parametrize("toml,needle", [
    ("[lattice]\nn_heads = 3\n", "n_heads"),
    ("[coordinator]\nlease_timeout = -1\n", "coordinator.lease_timeout"),
    ("[coordinator]\nbogus = 1\n", "coordinator.bogus"),
    ("not = [valid toml", "not valid TOML"),
])
def test_malformed_run_config_is_one_line_and_nonzero_exit(tmp_path, toml, needle):
    (tmp_path / "bad.toml").write_text(toml)
    out = subprocess.run(
        hivepath_cmd("coordinator", "serve", "--run-config", str(tmp_path / "bad.toml"), "--db", str(tmp_path / "d.db"),
                     "--token", "t", "--port", "0", "--http-port", "0"),
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hivepath: error:") and needle in lines[0], out.stderr


def test_missing_token_is_a_clear_error(tmp_path, run_toml):
    import os

    env = {k: v for k, v in os.environ.items() if k != "HIVEPATH_TOKEN"}
    out = subprocess.run(hivepath_cmd("coordinator", "serve", "--run-config", str(run_toml), "--db",
                                      str(tmp_path / "d.db")), capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 2 and "HIVEPATH_TOKEN" in out.stderr
