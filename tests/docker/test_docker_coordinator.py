"""The coordinator container alone: healthy through its gRPC health service, answers status on a
private network, and survives ``docker kill`` + ``docker start`` with nothing lost (DB on a volume).

Peers here are the project's own gRPC client (``peer.coordinator_client``) from the host, so this file
needs no trained model; the full network is in test_docker_network.py.
"""

from __future__ import annotations

import json
import uuid

import pytest

from dockerctl import http_json
from peer.localnet import wait_for
from peer.coordinator_client import CoordinatorClient, PeerInfo, Progress

TOKEN = "docker-coordinator-token"
RUN_TOML = """
preset = "tiny"
[coordinator]
lease_timeout = 30.0
heartbeat_interval = 1.0
restart_grace = 60.0
flush_interval = 0.2
tick_interval = 0.2
"""


@pytest.fixture
def coordinator(docker, images, tmp_path):
    tag = uuid.uuid4().hex[:6]
    net = docker.network(f"hpt-coord-{tag}")
    vol = docker.volume(f"hpt-coord-{tag}")
    (tmp_path / "run.toml").write_text(RUN_TOML)
    (tmp_path / "run.toml").chmod(0o644)  # the container's user 10001 reads it
    name = docker.run(f"hpt-coord-{tag}", images.coordinator, network=net,
                      env={"HIVEPATH_TOKEN": TOKEN}, volumes=[f"{vol}:/data", f"{tmp_path / 'run.toml'}:/etc/hivepath/run.toml:ro"],
                      publish=["127.0.0.1::7700", "127.0.0.1::7701"], extra=["--health-interval", "1s"])
    yield {"name": name, "network": net, "volume": vol}
    docker("rm", "-f", "-v", name, check=False)


def _client(docker, name: str, i: int) -> CoordinatorClient:
    info = PeerInfo(f"12D3KooWdock{'abcdefgh'[i]}xxxxxxx", "cpu", 8 << 30, 1000.0, public_key=b"k%d" % i)
    return CoordinatorClient(f"127.0.0.1:{docker.published(name, 7700)}", TOKEN, info, backoff_base=0.05,
                             backoff_max=0.5, seed=i)


def _page(docker, name: str) -> dict:
    """The status page's JSON (it counts peers by state, left and expired ones included)."""
    return http_json(f"http://127.0.0.1:{docker.published(name, 7701)}/status.json")


def test_coordinator_container_is_healthy_and_answers_status(docker, images, coordinator):
    name = coordinator["name"]
    wait_for(lambda: docker.health(name) == "healthy", 60, "the coordinator's health check", interval=0.5)
    # from another container on the same private network, by service name, with the CLI (the client
    # commands live in the peer image: the coordinator image leaves the peer package out)
    out = docker("run", "--rm", "--network", coordinator["network"], "-e", f"HIVEPATH_TOKEN={TOKEN}",
                 images.peer, "coordinator", "status", "--json", "--coordinator", f"{name}:7700", timeout=60)
    status = json.loads(out.stdout)
    assert status["run_id"] == "tiny" and status["live_leases"] == 0
    page = http_json(f"http://127.0.0.1:{docker.published(name, 7701)}/status.json")
    assert page["run_id"] == "tiny"


def test_coordinator_killed_and_restarted_loses_nothing(docker, images, coordinator):
    name = coordinator["name"]
    wait_for(lambda: docker.health(name) == "healthy", 60, "the coordinator's health check", interval=0.5)
    a, b = _client(docker, name, 0), _client(docker, name, 1)
    try:
        ja, jb = a.join(), b.join()
        a.heartbeat([Progress(ja.assignment.module_ids[0], 3, 1000, 2.5)])
        b.leave("done")
        status = _page(docker, name)
        before = ({p["peer_id"]: p["work"] for p in status["peers"]}, status["peer_states"])
        assert before == ({a.peer.peer_id: ja.assignment.label()}, {"active": 1, "left": 1})

        docker("kill", name)  # SIGKILL: no clean shutdown
        assert docker.exit_code(name) == 137
        docker("start", name)
        wait_for(lambda: docker.health(name) == "healthy", 60, "health after the restart", interval=0.5)
        a.close()
        a = _client(docker, name, 0)  # the published port changes on restart
        a.joined = ja
        reply = a.heartbeat()
        assert not reply.rejoined, "the lease survived the restart"
        status = _page(docker, name)
        after = ({p["peer_id"]: p["work"] for p in status["peers"]}, status["peer_states"])
        assert after == before and status["live_leases"] == 1
    finally:
        a.close()
        b.close()
