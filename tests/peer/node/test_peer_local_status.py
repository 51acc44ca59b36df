"""The peer's local status endpoint (``peer.node.local_status``), ``hivepath peer status`` and the images'
health check (``deploy/healthcheck.py``): the server alone, driven by its status object, then a real
``hivepath peer join`` and ``hivepath archive`` against a real coordinator."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from peer.localnet import free_port, hivepath_cmd, wait_for
from hivepath.settings import setting
from peer.node.local_status import (DEFAULT_STATUS_PORT, LocalStatusServer, StatusPortUnavailable, evaluate_health,
                               start_optional)
from peer.node.progress import WAITING_STATES, PeerStatus

ROOT = Path(__file__).resolve().parents[3]
HEALTHCHECK = ROOT / "deploy" / "healthcheck.py"


def get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    """``(status code, body)`` of a GET, error statuses included."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def healthcheck(port: int | str, role: str = "peer") -> subprocess.CompletedProcess:
    env = {**os.environ, "HIVEPATH_ROLE": role, "HIVEPATH_STATUS_PORT": str(port)}
    return subprocess.run([sys.executable, str(HEALTHCHECK)], env=env, capture_output=True, text=True, timeout=30)


@pytest.fixture
def served():
    """A server of a status whose clock the test moves: a stall is 'no progress for > 300 s'."""
    clock = FakeClock()
    status = PeerStatus(peer_id="12D3KooWtest", mode="path", assignment="0,1")
    status.use_clock(clock)
    with LocalStatusServer(status, "peer", port=0, stall_timeout=300.0, clock=clock) as server:
        yield status, server, clock


class FakeClock:
    """Monotonic seconds that move only when a test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# -- the verdict, a pure function of the status and the clock ----------------------------------


def test_waiting_states_are_healthy_however_long_they_last():
    status = PeerStatus()
    for state in WAITING_STATES:
        status.state = state
        ok, reason = evaluate_health(status, now=status.state_at + 10_000, stall_timeout=300)
        assert ok and "waiting state" in reason and state in reason


def test_training_without_progress_past_the_stall_timeout_is_stuck():
    status = PeerStatus()
    status.state = "training"
    status.step = 7
    t0 = max(status.progress_at, status.state_at, status.loop_at)
    assert evaluate_health(status, now=t0 + 299, stall_timeout=300)[0]
    ok, reason = evaluate_health(status, now=t0 + 301, stall_timeout=300)
    assert not ok and "stuck" in reason and "300s stall timeout" in reason and "step 7" in reason


def test_progress_fields_move_the_progress_clock_and_others_do_not():
    clock = FakeClock()
    status = PeerStatus()
    status.use_clock(clock)
    clock.now += 10
    status.loss = 1.5
    status.bytes_sent += 10
    status.step = 0  # same value: no progress
    assert status.progress_at == 1000.0 and status.state_at == 1000.0
    status.tokens += 128
    assert status.progress_at == 1010.0
    clock.now += 5
    status.state = "training"
    status.round_no = 1
    assert (status.state_at, status.progress_at) == (1015.0, 1015.0)


# -- the server alone --------------------------------------------------------------------------


def test_status_json_describes_the_peer(served):
    status, server, clock = served
    status.state, status.round_no, status.step, status.tokens, status.loss = "training", 3, 42, 4096, 2.5
    status.bytes_sent, status.bytes_received = 1000, 2000
    code, body = get(f"{server.url}/status")
    doc = json.loads(body)
    assert code == 200
    assert doc["role"] == "peer" and doc["peer_id"] == "12D3KooWtest" and doc["assignment"] == "0,1"
    assert (doc["round_no"], doc["step"], doc["tokens"], doc["loss"]) == (3, 42, 4096, 2.5)
    assert (doc["bytes_sent"], doc["bytes_received"]) == (1000, 2000)
    assert doc["healthy"] is True and doc["pid"] == os.getpid()
    assert doc["seconds_since_heartbeat"] is None, "the coordinator never answered yet"
    status.mark_heartbeat()
    clock.now += 4.5
    doc = json.loads(get(f"{server.url}/status")[1])
    assert doc["seconds_since_heartbeat"] == 4.5 and doc["seconds_since_progress"] == 4.5


def test_healthz_follows_the_status_object(served):
    status, server, clock = served
    status.state = "loading"
    clock.now += 3600  # loading state for an hour: a waiting state, not a stall
    assert get(f"{server.url}/healthz")[0] == 200
    status.state = "training"
    clock.now += 299
    assert get(f"{server.url}/healthz")[0] == 200
    clock.now += 2  # nothing moved for 301 s: stuck, with the reason
    code, body = get(f"{server.url}/healthz")
    assert code == 503 and "stuck" in body and "no progress for 301s" in body
    assert json.loads(get(f"{server.url}/status")[1])["healthy"] is False
    status.step += 1  # an inner step: healthy again at once
    code, body = get(f"{server.url}/healthz")
    assert code == 200 and "training" in body
    clock.now += 400
    assert get(f"{server.url}/healthz")[0] == 503
    status.mark_loop()  # the main loop turned (a stage server waiting for work): not stuck
    assert get(f"{server.url}/healthz")[0] == 200
    clock.now += 400
    status.state = "draining"  # a known waiting state is never a stall
    assert get(f"{server.url}/healthz")[0] == 200


def test_unknown_paths_are_404(served):
    _, server, _ = served
    code, body = get(f"{server.url}/metrics")
    assert code == 404 and "/status" in body
    assert get(f"{server.url}/status/")[0] == 200 and get(f"{server.url}/status?x=1")[0] == 200


def test_the_server_listens_on_loopback_only(served):
    _, server, _ = served
    assert server.host == "127.0.0.1" and server._server.server_address[0] == "127.0.0.1"


def test_a_taken_port_names_the_fix_and_the_peer_goes_on(caplog):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(StatusPortUnavailable, match="--status-port"):
            LocalStatusServer(PeerStatus(), "peer", port=port).start()
        with caplog.at_level(logging.WARNING, logger="peer.node.local_status"):
            assert start_optional(PeerStatus(), "peer", port, 300.0) is None
        assert "going on without it" in caplog.text
    assert start_optional(PeerStatus(), "peer", 0, 300.0) is None, "port 0 turns it off"


def test_on_a_taken_default_port_the_next_free_one_is_used_and_named(caplog):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with caplog.at_level(logging.INFO, logger="peer.node.local_status"):
            server = start_optional(PeerStatus(), "peer", port, 300.0, search=16)
        try:
            assert server is not None and port < server.port <= port + 16
            assert get(f"{server.url}/healthz")[0] in (200, 503)
            # the command that reads it, as 'hivepath peer status' takes it
            assert f"port {port} is taken" in caplog.text and f"'hivepath peer status --port {server.port}'" in caplog.text
        finally:
            server.stop()


def test_cli_default_port_matches_the_server():
    assert setting("HIVEPATH_STATUS_PORT").default == DEFAULT_STATUS_PORT


# -- hivepath peer status and the health check against the server alone -------------------------


def test_peer_status_command_and_healthcheck(served):
    status, server, clock = served
    status.state, status.round_no, status.step, status.loss = "training", 5, 60, 3.25
    status.mark_heartbeat()
    out = subprocess.run(hivepath_cmd("peer", "status", "--port", str(server.port)), capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    line = out.stdout.strip()
    assert "\n" not in line and "0,1" in line and "round 5" in line and "loss 3.250" in line and "healthy" in line
    out = subprocess.run(hivepath_cmd("peer", "status", "--port", str(server.port), "--json"), capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and json.loads(out.stdout)["round_no"] == 5
    hc = healthcheck(server.port)
    assert hc.returncode == 0 and hc.stdout.startswith("healthy:"), hc.stdout + hc.stderr

    clock.now += 301
    hc = healthcheck(server.port)
    assert hc.returncode == 1 and "stuck" in hc.stdout, hc.stdout
    out = subprocess.run(hivepath_cmd("peer", "status", "--port", str(server.port)), capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 1 and "UNHEALTHY" in out.stdout


def test_nothing_answering_is_one_line_and_exit_1():
    port = free_port()
    out = subprocess.run(hivepath_cmd("peer", "status", "--port", str(port)), capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and f"--status-port {port}" in out.stderr and "Traceback" not in out.stderr
    hc = healthcheck(port)
    assert hc.returncode == 1 and "no answer" in hc.stdout


def test_healthcheck_rejects_a_bad_port_variable():
    hc = healthcheck("seven")
    assert hc.returncode == 1 and "HIVEPATH_STATUS_PORT='seven' is not a port number" in hc.stdout, hc.stdout


def test_bad_status_flags_are_one_line_errors():
    for flags, what in ((["--status-port", "70000"], "--status-port"), (["--stall-timeout", "0"], "--stall-timeout")):
        out = subprocess.run(hivepath_cmd("peer", "join", "--coordinator", "127.0.0.1:1", "--token", "t", *flags),
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and what in out.stderr and out.stderr.count("\n") == 1, out.stderr


# -- a real peer and archive -------------------------------------------------------------------


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """The built-in corpus prepared once for the 2x2 lattice of the tiny preset."""
    from models.corpus import default_corpus
    from models.data import Dataset, prepare

    out = tmp_path_factory.mktemp("data") / "default-bytes-2x2"
    prepare(default_corpus(), out, levels=2, modules=2, tokenizer="bytes")
    return Dataset(out)


@pytest.mark.integration
def test_a_real_peer_and_archive_serve_their_status(procs, tmp_path, dataset):
    from helpers.network import tiny_network

    net = tiny_network(procs, tmp_path, dataset.dir, dataset.manifest_hash)
    try:
        net.start_coordinator()
        peer_port, archive_port = free_port(), free_port()
        net.start_peer("peer0", "--status-port", str(peer_port))
        procs.start("archive", hivepath_cmd("archive", "--dir", str(tmp_path / "archive"), "--poll-interval", "0.5",
                                            "--eval-docs", "0", *net.common(), "--status-port", str(archive_port)),
                    env=net.env)

        def peer_doc():
            doc = json.loads(get(f"http://127.0.0.1:{peer_port}/status", timeout=2)[1])
            return doc if doc["state"] == "training" and doc["step"] > 0 else None

        doc = wait_for(peer_doc, 90, "the peer to train and say so on /status")
        coordinator_view = wait_for(lambda: net.peer_assignment(doc["peer_id"]), 30, "the coordinator to list the peer")
        assert doc["role"] == "peer" and doc["mode"] == "path"
        assert doc["assignment"] == ",".join(map(str, coordinator_view["path"])), (doc, coordinator_view)
        assert doc["healthy"] is True and doc["stall_timeout"] == 300.0
        wait_for(lambda: json.loads(get(f"http://127.0.0.1:{peer_port}/status", timeout=2)[1])
                 ["seconds_since_heartbeat"] is not None, 30, "a heartbeat answered")
        assert get(f"http://127.0.0.1:{peer_port}/healthz")[0] == 200
        hc = healthcheck(peer_port, "peer")
        assert hc.returncode == 0 and hc.stdout.startswith("healthy:"), hc.stdout

        archive = wait_for(lambda: (lambda d: d if d["state"] == "following" else None)(
            json.loads(get(f"http://127.0.0.1:{archive_port}/status", timeout=2)[1])), 90, "the archive to follow")
        assert archive["role"] == "archive" and archive["mode"] == "archive" and archive["healthy"] is True
        assert healthcheck(archive_port, "archive").returncode == 0

        assert net.stop("peer0") == 0, procs.log("peer0")[-2000:]
        assert "local status on" in procs.log("peer0")
        assert healthcheck(peer_port).returncode == 1, "a stopped peer answers nothing"
    finally:
        net.close()
