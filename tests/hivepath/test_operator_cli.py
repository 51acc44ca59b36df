"""The operator's commands against a real coordinator process: ``drain``, ``ban``
and ``unban`` take a peer id as ``coordinator status`` shows it (any unique start); an id that
matches no peer, or several, exits 2 with one line; ``HIVEPATH_TOKEN_FILE`` is read by every command
that needs the token; ``serve --help`` names every flag's variable. Also ``coordinator serve --data``
pinning an empty manifest hash (item 1)."""

from __future__ import annotations

import json
import os
import subprocess

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from peer.localnet import free_port, hivepath_cmd, wait_for
from hivepath.cmd_coordinator import SHORT_ID, resolve_peer_id
from models.errors import HivepathError
from peer.coordinator_client import CoordinatorClient, PeerInfo

TOKEN = "operator-test-token"
IDS = ["12D3KooWAbCdEfGhJkLmNoPqRsTuVwXyZ1234567890abcdefghjk", "12D3KooWAbCdEfZZJkLmNoPqRsTuVwXyZ1234567890abcdefghjk",
       "QmUTBN6Bp15euBudrpM9hih36odyxBWgvSJ18K6iD8f4R9"]


def test_a_unique_start_of_an_id_names_the_peer():
    assert resolve_peer_id(IDS[2][:SHORT_ID], IDS) == IDS[2]
    assert resolve_peer_id(IDS[0][:SHORT_ID] + "…", IDS) == IDS[0]
    assert resolve_peer_id(IDS[1], IDS) == IDS[1]
    with pytest.raises(HivepathError, match="starts 2 peer ids") as e:
        resolve_peer_id("12D3KooWAbCdEf", IDS)
    assert e.value.exit_code == 2
    with pytest.raises(HivepathError, match="no peer of this run has an id starting 'Qmnope'"):
        resolve_peer_id("Qmnope", IDS)
    whole = "12D3KooWNotJoinedYetAbCdEfGhJkLmNoPqRsTuVwXyZ12345678"
    assert resolve_peer_id(whole, IDS, allow_unknown=True) == whole  # a ban ahead of its join
    with pytest.raises(HivepathError):
        resolve_peer_id(whole[:20], IDS, allow_unknown=True)


def _serving(port: int) -> bool:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1)
        return r.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.integration
def test_operator_commands_take_short_ids_and_the_token_file_variable(procs, tmp_path):
    (tmp_path / "run.toml").write_text('preset = "tiny"\n[coordinator]\nheartbeat_interval = 0.5\n')
    (tmp_path / "run.token").write_text(TOKEN + "\n")
    port = free_port()
    env = {**os.environ, "HIVEPATH_TOKEN_FILE": str(tmp_path / "run.token"), "HIVEPATH_COORDINATOR": f"127.0.0.1:{port}"}
    env.pop("HIVEPATH_TOKEN", None)
    procs.start("coord", hivepath_cmd("coordinator", "serve", "--run-config", str(tmp_path / "run.toml"), "--db",
                                      str(tmp_path / "s.db"), "--host", "127.0.0.1", "--port", str(port),
                                      "--http-port", str(free_port())), env=env)
    wait_for(lambda: _serving(port), 60, "the coordinator serving", interval=0.2)
    peer = CoordinatorClient(f"127.0.0.1:{port}", TOKEN, PeerInfo(IDS[2], "cpu", 8 << 30, 1000.0, public_key=b"k"),
                             backoff_base=0.05, backoff_max=0.5)

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(hivepath_cmd("coordinator", *args), env=env, capture_output=True, text=True, timeout=60)

    try:
        peer.join()
        shown = cli("status")
        assert shown.returncode == 0, shown.stderr
        short = IDS[2][:SHORT_ID]
        assert short in shown.stdout and IDS[2] not in shown.stdout
        assert [p["peer_id"] for p in json.loads(cli("status", "--json").stdout)["peers"]] == [IDS[2]]
        unknown = cli("drain", "QmNoSuchPeer")
        assert unknown.returncode == 2 and unknown.stderr.count("\n") == 1, unknown.stderr
        assert "no peer of this run has an id starting 'QmNoSuchPeer'" in unknown.stderr
        drained = cli("drain", short)
        assert drained.returncode == 0 and drained.stdout.startswith(f"{IDS[2]}: "), drained.stderr
        assert peer.heartbeat().drain
        not_banned = cli("unban", short)
        assert not_banned.returncode == 2 and "Traceback" not in not_banned.stderr, not_banned.stderr
        banned = cli("ban", short, "--reason", "test")
        assert banned.returncode == 0 and IDS[2] in banned.stdout, banned.stderr
        # a banned peer leaves the status list: unban takes its whole id (as the ban printed it)
        assert cli("unban", IDS[2]).returncode == 0
    finally:
        peer.close()


def test_serve_help_names_every_variable():
    out = subprocess.run(hivepath_cmd("coordinator", "serve", "--help"), capture_output=True, text=True, timeout=60,
                         env={**os.environ, "COLUMNS": "200"})
    assert out.returncode == 0
    text = " ".join(out.stdout.split())
    for flag in ("--run-config", "--db", "--data", "--host", "--port", "--http-port", "--tls-cert", "--tls-key",
                 "--key", "--token", "--token-file"):
        assert flag in text
    for variable in ("HIVEPATH_TOKEN", "HIVEPATH_TOKEN_FILE", "HIVEPATH_RUN_CONFIG", "HIVEPATH_DB", "HIVEPATH_PORT",
                     "HIVEPATH_HTTP_PORT", "HIVEPATH_TLS_CERT", "HIVEPATH_TLS_KEY"):
        assert variable in text, variable


def test_serve_pins_an_empty_manifest_hash_from_data_or_refuses(tmp_path):
    """Item 1: the archive and checkpoints name the run's dataset only if the run pins it."""
    from coordinator.settings import pin_dataset
    from models.config import RunConfig
    from models.errors import ConfigError, DataError
    from models.manifest import manifest_hash

    data = tmp_path / "data"
    data.mkdir()
    manifest = {"format": 2, "corpus": "mine", "files": {}}
    (data / "manifest.json").write_text(json.dumps(manifest))
    want = manifest_hash(manifest)
    built_in = RunConfig()
    assert pin_dataset(built_in, None) == built_in  # every peer prepares the built-in corpus alike
    assert pin_dataset(built_in, data).data.manifest_hash == want
    own = built_in.replace(data={"corpus": "/srv/corpus"})
    with pytest.raises(ConfigError, match="data.manifest_hash.*pass --data DIR") as e:
        pin_dataset(own, None)
    assert e.value.exit_code == 2
    assert pin_dataset(own, data).data.manifest_hash == want
    assert pin_dataset(own.replace(data={"manifest_hash": want}), data).data.manifest_hash == want
    with pytest.raises(DataError, match=f"has manifest {want} but the run config pins") as e:
        pin_dataset(own.replace(data={"manifest_hash": "ab" * 8}), data)
    assert e.value.exit_code == 4
