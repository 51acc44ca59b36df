"""Versions: ``hivepath --version``, the coordinator's checks at join and by heartbeat, the peer's
check of the coordinator (protos.versions, coordinator.versions)."""

from __future__ import annotations

import json
import subprocess
import sys

import grpc
import pytest

from coordinator.errors import VersionRefused
from coordinator.server import BackgroundServer, ServeOptions
from coordinator.settings import CoordinatorSettings
from coordinator.versions import join_refusal, upgrade_reason
from models.errors import ConfigError
from models.presets import tiny_cpu
from peer.coordinator_client import CoordinatorClient, PeerInfo, VersionMismatch
from peer.coordinator_client.messages import check_coordinator, refusal
from protos import coordinator_pb2 as pb
from protos import coordinator_pb2_grpc as pb_grpc
from protos import versions

TOKEN = "versions-token"
RUN = tiny_cpu()


@pytest.fixture(autouse=True)
def _no_override():
    yield
    versions.set_override(None)


def peer_info(i: int) -> PeerInfo:
    return PeerInfo(peer_id=f"12D3KooWvers{i:08d}".replace("0", "z"), device="cpu", memory_bytes=8 << 30,
                    tokens_per_s=1000.0, public_key=b"vkey%d" % i)


# -- protos.versions ------------------------------------------------------------------------------


def test_versions_parse_and_compare():
    assert versions.parse_version("1.1") == (1, 1)
    for bad in ("1", "1.x", "01.1", "", None, "1.1.1"):
        with pytest.raises(ValueError):
            versions.parse_version(bad)
    assert versions.older_than("0.1.9", "0.2.0") and not versions.older_than("0.2", "0.2.0")
    assert versions.older_than("", "0.2.0") and not versions.older_than("", "")
    assert not versions.older_than("0.10.0", "0.9.1") and versions.older_than("0.2.0.dev1", "0.2.1")
    with pytest.raises(ValueError):
        versions.release_key("latest")


def test_refusal_names_both_versions_across_majors_only():
    ours = versions.stated_text("dht")
    assert versions.refusal("dht", ours) == ""
    assert versions.refusal("dht", f"{versions.stated('dht')[0]}.99") == ""  # a newer minor: read it
    assert versions.refusal("dht", "") == ""  # a release that stated none speaks 1.0
    why = versions.refusal("dht", "2.0", who="peer X")
    assert "2.0" in why and ours in why and "peer X" in why and "\n" not in why


def test_override_states_other_versions_and_leaves_out_newer_fields():
    assert versions.writes("dht", "GroupDeclaration.wire")
    versions.set_override("dht=1.0")
    assert versions.stated_text("dht") == "1.0" and versions.stated_text("averaging") == versions.CONTRACTS[
        "averaging"].text
    assert not versions.writes("dht", "GroupDeclaration.wire")  # added in 1.1
    versions.set_override("all=2.0")
    assert set(versions.stated_all().values()) == {"2.0"}
    for bad in ("dht", "nope=1.0", "dht=1"):
        with pytest.raises(ValueError):
            versions.set_override(bad)


def test_unknown_fields_are_counted_by_message_and_number():
    from protos.hivepath.peer.v1 import net_pb2

    data = net_pb2.JoinRequest(group_key="k").SerializeToString() + bytes([0xF8, 0x07, 0x01])  # field 127, varint 1
    before = versions.UNKNOWN_FIELDS.snapshot().get("JoinRequest.127", 0)
    message = net_pb2.JoinRequest.FromString(data)
    assert message.group_key == "k" and versions.unknown_proto_fields(message) == 1
    assert versions.UNKNOWN_FIELDS.snapshot()["JoinRequest.127"] == before + 1


def test_hivepath_version_prints_release_protocols_and_commit():
    out = subprocess.run([sys.executable, "-c", "import sys; from hivepath.cli import main; sys.exit(main())",
                          "--version"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    line = out.stdout.strip()
    assert line.startswith(f"hivepath {versions.RELEASE}") and "\n" not in line
    for name in versions.NAMES:
        assert f"{name} {versions.CONTRACTS[name].text}" in line
    assert ("commit " in line) == bool(versions.commit())


# -- coordinator.versions (pure) --------------------------------------------------------------------


def test_join_refusal_and_upgrade_reason():
    ours = versions.stated_all()
    assert join_refusal(versions.RELEASE, ours, "") == ""
    assert join_refusal("", {}, "") == ""  # a release that states nothing speaks 1.x of everything
    why = join_refusal(versions.RELEASE, {**ours, "averaging": "2.0"}, "")
    assert why.startswith("averaging protocol") and "2.0" in why and ours["averaging"] in why
    why = join_refusal("0.1.5", ours, "0.3.0")
    assert "0.1.5" in why and "0.3.0" in why and "pip install -U 'hivepath>=0.3.0'" in why
    assert "99.0" in upgrade_reason(versions.RELEASE, "99.0") and versions.RELEASE in upgrade_reason(versions.RELEASE, "99.0")
    assert upgrade_reason(versions.RELEASE, versions.RELEASE) == ""


def test_min_peer_version_is_checked_in_the_run_config():
    assert CoordinatorSettings(min_peer_version="0.2.0").min_peer_version == "0.2.0"
    with pytest.raises(ConfigError, match="min_peer_version"):
        CoordinatorSettings(min_peer_version="newest")


def test_a_version_refusal_maps_to_exit_7():
    err = refusal(grpc.StatusCode.FAILED_PRECONDITION, str(VersionRefused("dht protocol: ...")))
    assert isinstance(err, VersionMismatch) and err.exit_code == 7 and "dht protocol" in str(err)


# -- over gRPC ---------------------------------------------------------------------------------------


def _get(port: int, path: str) -> str:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
        return r.read().decode()


def _serve(db, least: str, port: int = 0) -> BackgroundServer:
    settings = CoordinatorSettings(lease_timeout=30.0, heartbeat_interval=5.0, tick_interval=0.2,
                                   flush_interval=0.2, min_peer_version=least)
    return BackgroundServer(RUN, settings, ServeOptions(db=str(db), port=port, http_port=0, token=TOKEN,
                                                        host="127.0.0.1"))


def test_coordinator_refuses_old_releases_and_other_majors_at_join(tmp_path):
    with _serve(tmp_path / "a.db", "99.0") as srv:
        client = CoordinatorClient(f"127.0.0.1:{srv.port}", TOKEN, peer_info(1), retry_timeout=10.0)
        with pytest.raises(VersionMismatch) as e:
            client.join()
        client.close()
        message = str(e.value)
        assert e.value.exit_code == 7 and versions.RELEASE in message and "99.0" in message
        assert "\n" not in message and "pip install" in message
    with _serve(tmp_path / "b.db", "") as srv:
        channel = grpc.insecure_channel(f"127.0.0.1:{srv.port}")
        request = pb.JoinRequest(token=TOKEN, peer_id=peer_info(2).peer_id, public_key=b"k2",
                                 capabilities=pb.Capabilities(device="cpu", memory_bytes=8 << 30, tokens_per_s=1e3),
                                 peer_version=versions.RELEASE, protocols={**versions.stated_all(), "dht": "2.0"})
        with pytest.raises(grpc.RpcError) as e:
            pb_grpc.CoordinatorStub(channel).Join(request, timeout=30)
        channel.close()
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert e.value.details().startswith("version: dht protocol: this peer speaks 2.0 and the coordinator "
                                            f"{versions.CONTRACTS['dht'].text}")
        assert srv.coordinator.counters["rejected_version"] == 1


def test_a_peer_refuses_a_coordinator_of_another_major():
    ours = versions.stated_all()
    check_coordinator(pb.JoinResponse(coordinator_version="0.2.0", protocols=ours))
    check_coordinator(pb.JoinResponse())  # a coordinator of 0.1.x states nothing: coordinator protocol 1.0
    with pytest.raises(VersionMismatch) as e:
        check_coordinator(pb.JoinResponse(coordinator_version="1.0.0", protocols={**ours, "coordinator": "2.0"}))
    assert "hivepath 1.0.0" in str(e.value) and "2.0" in str(e.value) and ours["coordinator"] in str(e.value)
    assert e.value.exit_code == 7


def test_raising_min_peer_version_drains_a_running_peer(tmp_path):
    db = tmp_path / "state.db"
    with _serve(db, "") as srv:
        port = srv.port
        client = CoordinatorClient(f"127.0.0.1:{port}", TOKEN, peer_info(3), retry_timeout=60.0)
        client.join()
        reply = client.heartbeat()
        assert not reply.drain and not reply.required_version
        assert srv.coordinator.peer_versions.get(client.peer.peer_id) == versions.RELEASE
        assert srv.coordinator.settings.min_peer_version == ""
        metrics, page, status = (_get(srv.http_port, p) for p in ("/metrics", "/", "/status.json"))
        assert f'hivepath_coordinator_peers_version{{version="{versions.RELEASE}"}} 1.0' in metrics
        assert f'hivepath_coordinator_info{{commit="{versions.commit()}",min_peer_version="",' in metrics
        assert f"coordinator hivepath {versions.RELEASE}" in page and f"<td class='version'>{versions.RELEASE}</td>" in page
        me = next(p for p in json.loads(status)["peers"] if p["peer_id"] == client.peer.peer_id)
        assert me["version"] == versions.RELEASE
        assert client.status()["peers"][0]["version"] == versions.RELEASE  # the Status RPC says it too
    try:
        # the operator restarts the coordinator requiring a newer release; the peer's lease survives it
        with _serve(db, "99.0", port=port) as srv:
            reply = client.heartbeat()
            assert not reply.rejoined
            assert reply.drain and reply.required_version == "99.0"
            assert "99.0" in reply.drain_reason and versions.RELEASE in reply.drain_reason
            assert srv.coordinator.counters["drained_version"] == 1
            peer = next(p for p in srv.coordinator.status_view().peers if p.peer_id == client.peer.peer_id)
            assert peer.state == "draining"  # its work is handed to others now
    finally:
        client.close()
