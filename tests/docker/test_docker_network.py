"""The whole network in containers, from deploy/compose.yaml: a coordinator, an archive peer and
3 CPU peers train the tiny preset; then faults, one after another on the same network (the tests in
this module run in file order and share it, to keep the suite within its time budget):

1. rounds complete;
2. ``docker kill`` of a peer: its lease expires, the coordinator frees its work, the rest go on;
3. ``docker stop`` of a peer (SIGTERM): it drains, checkpoints, exits 0 within the grace period, and
   the coordinator marks it gone at once (no lease expiry);
4. ``docker network disconnect`` of a peer, then reconnect: it rejoins and catches up;
5. the coordinator container killed and started again: nothing lost (its database is on a volume);
6. a spot peer whose fake metadata server (a container on the same network) posts an AWS
   instance-action: it drains and exits 0 well within the notice.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest

from dockerctl import ROOT, http_json
from peer.localnet import wait_for

TOKEN = "docker-network-token"
DRAIN_TIMEOUT = 15.0
LEASE_TIMEOUT = 8.0
RUN_TOML = f"""
preset = "tiny"
[outer]
round_timeout = 10.0
[coordinator]
lease_timeout = {LEASE_TIMEOUT}
heartbeat_interval = 1.0
restart_grace = 20.0
flush_interval = 0.2
tick_interval = 0.2
"""
# Tests only: no restarts, so that a killed peer stays dead and its lease really expires.
OVERRIDE = """
services:
  peer:
    restart: "no"
  archive:
    restart: "no"
"""


class Network:
    def __init__(self, docker, images, tmp: Path):
        self.docker = docker
        self.project = f"hpt{uuid.uuid4().hex[:8]}"
        (tmp / "run.toml").write_text(RUN_TOML)
        (tmp / "run.toml").chmod(0o644)
        (tmp / "override.yaml").write_text(OVERRIDE)
        self.files = [tmp / "override.yaml"]
        self.env = {
            "HIVEPATH_TOKEN": TOKEN, "HIVEPATH_IMAGE_TAG": "test", "HIVEPATH_BASE_IMAGE": images.base,
            "HIVEPATH_RUN_TOML": str(tmp / "run.toml"), "HIVEPATH_GRPC_PUBLISH": "127.0.0.1:",
            "HIVEPATH_HTTP_PUBLISH": "127.0.0.1:", "HIVEPATH_DRAIN_TIMEOUT": str(int(DRAIN_TIMEOUT)),
            "HIVEPATH_THREADS": "1",
        }
        self.network = f"{self.project}_default"

    def compose(self, *args, **kw):
        return self.docker.compose(self.project, self.env, *args, files=self.files, **kw)

    @property
    def coordinator(self) -> str:
        return self.docker.compose_containers(self.project, "coordinator")[0]

    def peers(self) -> list[str]:
        return self.docker.compose_containers(self.project, "peer")

    def status(self) -> dict:
        return http_json(f"http://127.0.0.1:{self.docker.published(self.coordinator, 7701)}/status.json")

    def live(self) -> set[str]:
        """Peers holding a lease (the status lists only those; left and expired ones are counted)."""
        return {p["peer_id"] for p in self.status()["peers"]}

    def counter(self, name: str) -> int:
        return int(self.status()["counters"].get(name, 0))

    def rounds(self) -> dict[str, int]:
        return {m["module_id"]: m["round"] for m in self.status()["modules"]}

    def rounds_advance(self, by: int, timeout: float) -> None:
        """Every module that has a holder now gets ``by`` more outer rounds within ``timeout``."""
        status = self.status()
        start = {m["module_id"]: m["round"] for m in status["modules"] if m["holders"]}
        assert start, "no module has a holder"
        wait_for(lambda: all(self.rounds()[m] >= r + by for m, r in start.items()), timeout,
                 f"{by} more rounds of {sorted(start)}", interval=0.5)


@pytest.fixture(scope="module")
def net(docker, images, tmp_path_factory):
    n = Network(docker, images, tmp_path_factory.mktemp("compose"))
    n.compose("up", "-d", "--no-build", "--scale", "peer=3", timeout=300)
    # a cold start under load: torch imports, data preparation and a speed measurement per peer
    try:
        wait_for(lambda: len(n.live()) >= 4, 420, "the archive and 3 peers live", interval=1.0)
        yield n
    finally:
        # down at the module's end, not the session's: the network's five containers would otherwise
        # train on (most of a core) through every test the worker runs after this module
        n.compose("down", "-v", "-t", "5", "--remove-orphans", timeout=180, check=False)


def test_compose_network_trains_and_rounds_complete(net):
    net.rounds_advance(by=3, timeout=120)
    status = net.status()
    assert status["live_leases"] >= 3
    losses = [p["loss"] for p in status["paths"] if p["peers"]]
    assert losses and all(l is not None for l in losses)
    # the images' HEALTHCHECK asks each peer's local status page (/healthz on HIVEPATH_STATUS_PORT)
    for c in net.peers() + net.docker.compose_containers(net.project, "archive"):
        wait_for(lambda c=c: net.docker.health(c) == "healthy", 90, f"{c} healthy", interval=1.0)
    out = net.docker("exec", net.peers()[0], "hivepath", "peer", "status", check=False)
    assert out.returncode == 0 and "healthy" in out.stdout, (out.stdout, out.stderr)


def test_docker_kill_of_a_peer_frees_its_work_and_the_rest_go_on(net):
    victim = net.peers()[0]
    peer_id = wait_for(lambda: net.docker.peer_id(victim), 30, "the victim's peer id")
    held = {p["peer_id"]: p["work"] for p in net.status()["peers"]}[peer_id]
    expirations, leaves = net.counter("expirations"), net.counter("leaves")
    net.docker("kill", victim)
    assert net.docker.exit_code(victim) == 137
    wait_for(lambda: peer_id not in net.live(), LEASE_TIMEOUT + 20, "the killed peer's lease to expire")
    assert net.counter("expirations") > expirations and net.counter("leaves") == leaves, "expired, did not leave"
    status = net.status()
    assert all(peer_id not in m["holders"] for m in status["modules"]), f"{held} was freed"
    net.rounds_advance(by=2, timeout=90)


def test_docker_stop_drains_checkpoints_and_exits_0_within_the_grace_period(net):
    victim = net.peers()[1]
    peer_id = wait_for(lambda: net.docker.peer_id(victim), 30, "the victim's peer id")
    assert peer_id in net.live()
    leaves = net.counter("leaves")
    start = time.monotonic()
    net.docker("stop", "-t", "90", victim, timeout=120)  # compose's stop_grace_period is 90 s
    took = time.monotonic() - start
    assert net.docker.exit_code(victim) == 0, net.docker.logs(victim)[-3000:]
    print(f"drained and exited in {took:.1f}s")  # exit 0, not docker's SIGKILL (137) at the grace period's end
    # the coordinator knows at once: the peer left (no wait for the lease to expire)
    # the lease is given back before the exit, and never taken again on the way out (a heartbeat racing
    # the leave must not re-join: a ghost lease would hold the path until it expired)
    assert peer_id not in net.live(), net.docker.logs(victim)[-3000:]
    assert net.counter("leaves") == leaves + 1
    logs = net.docker.logs(victim)
    assert "SIGTERM" in logs
    volume = next(m["Name"] for m in net.docker.inspect(victim)["Mounts"] if m["Destination"] == "/data")
    out = net.docker("run", "--rm", "-v", f"{volume}:/data", "--entrypoint", "sh", net.docker.inspect(victim)["Config"]["Image"],
                     "-c", "ls /data/checkpoints")
    assert out.stdout.split(), "a checkpoint was written"


def test_network_partition_then_reconnect_rejoins_and_catches_up(net):
    victim = net.peers()[2]
    peer_id = wait_for(lambda: net.docker.peer_id(victim), 30, "the victim's peer id")
    net.docker("network", "disconnect", net.network, victim)
    try:
        wait_for(lambda: peer_id not in net.live(), LEASE_TIMEOUT + 30, "the partitioned peer to expire")
    finally:
        net.docker("network", "connect", net.network, victim)
    try:
        wait_for(lambda: peer_id in net.live(), 150, "the peer to rejoin", interval=1.0)
    except TimeoutError as e:
        raise AssertionError(f"{e}; its log ends:\n{net.docker.logs(victim)[-4000:]}") from None
    assert net.docker.exit_code(victim) is None, "it kept running through the partition"
    net.rounds_advance(by=2, timeout=90)


def test_coordinator_killed_and_restarted_loses_nothing(net):
    from peer.coordinator_client import CoordinatorClient, PeerInfo

    # its own state, whatever ran before: a peer that left, beside the live ones
    gone = CoordinatorClient(f"127.0.0.1:{net.docker.published(net.coordinator, 7700)}", TOKEN,
                             PeerInfo("12D3KooWdockgonexxxxxx", "cpu", 8 << 30, 1000.0, public_key=b"left"))
    try:
        gone.join()
        gone.leave("set-up: a peer that left before the restart")
    finally:
        gone.close()
    status = net.status()
    before = (net.live(), status["peer_states"])
    assert before[1].get("left") and before[1].get("active"), before
    coord = net.coordinator
    net.docker("kill", coord)
    net.docker("start", coord)
    wait_for(lambda: net.docker.health(coord) == "healthy", 60, "the coordinator back", interval=0.5)
    after = wait_for(lambda: (net.live(), net.status()["peer_states"]), 30, "status after the restart")
    assert after == before, "every peer and its state survived (the database is on the volume)"
    net.rounds_advance(by=1, timeout=90)


def test_spot_notice_from_a_fake_metadata_server_drains_the_peer_within_the_notice(net, images):
    docker = net.docker
    tag = uuid.uuid4().hex[:6]
    meta = docker.run(f"hpt-meta-{tag}", images.peer, "/srv/fake_metadata.py", "--port", "8080",
                      network=net.network, entrypoint="python3",
                      volumes=[f"{ROOT / 'tests' / 'docker' / 'fake_metadata.py'}:/srv/fake_metadata.py:ro"])
    spot = docker.run(f"hpt-spot-{tag}", images.peer, "peer", "join", network=net.network, env={
        "HIVEPATH_COORDINATOR": "coordinator:7700", "HIVEPATH_TOKEN": TOKEN, "HIVEPATH_THREADS": "1",
        "HIVEPATH_DRAIN_TIMEOUT": str(int(DRAIN_TIMEOUT)), "HIVEPATH_SPOT": "aws",
        "HIVEPATH_SPOT_URL": f"http://{meta}:8080", "HIVEPATH_SPOT_POLL_INTERVAL": "1",
    })
    try:
        _spot_drains_within_the_notice(net, docker, meta, spot)
    finally:
        docker("rm", "-f", "-v", meta, spot, check=False, timeout=120)


def _spot_drains_within_the_notice(net, docker, meta: str, spot: str) -> None:
    peer_id = wait_for(lambda: docker.peer_id(spot), 300, "the spot peer to train", interval=1.0)
    wait_for(lambda: peer_id in net.live(), 60, "the spot peer active")
    assert docker.exit_code(spot) is None, "no notice yet: it keeps training"
    leaves = net.counter("leaves")
    notice_seconds = 30.0
    docker("exec", meta, "python3", "-c",
           "import json, urllib.request as u; u.urlopen(u.Request('http://127.0.0.1:8080/_control', "
           f"data=json.dumps({{'aws_action': 'terminate', 'aws_in': {notice_seconds}}}).encode(), method='POST'))")
    start = time.monotonic()
    wait_for(lambda: docker.exit_code(spot) is not None, notice_seconds, "the spot peer to drain and exit", interval=0.5)
    print(f"exited {time.monotonic() - start:.1f}s into the {notice_seconds:.0f}s notice")
    assert docker.exit_code(spot) == 0, docker.logs(spot)[-3000:]
    assert "spot preemption notice (aws: terminate" in docker.logs(spot)
    assert peer_id not in net.live() and net.counter("leaves") == leaves + 1
