"""The real gRPC service in this process: status codes for bad input, the peer client's retries and
transparent re-join, TLS, the health service, and fuzzed requests that must never yield INTERNAL."""

from __future__ import annotations

import dataclasses

import datetime
import math

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings as hsettings, strategies as st

from coordinator.server import SERVICE_NAME, BackgroundServer, ServeOptions
from coordinator.settings import CoordinatorSettings
from models.presets import tiny_cpu
from peer.coordinator_client import (
    CoordinatorClient,
    CoordinatorRefused,
    CoordinatorUnavailable,
    NotACoordinator,
    NoAssignmentFits,
    PeerInfo,
    Progress,
)
from protos import coordinator_pb2 as pb
from protos import coordinator_pb2_grpc as pb_grpc

TOKEN = "s3cret-token"
RUN = tiny_cpu()
SETTINGS = CoordinatorSettings(lease_timeout=30.0, heartbeat_interval=5.0, tick_interval=0.2, flush_interval=0.2)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    db = tmp_path_factory.mktemp("grpc") / "state.db"
    with BackgroundServer(RUN, SETTINGS, ServeOptions(db=str(db), port=0, http_port=0, token=TOKEN,
                                                      host="127.0.0.1")) as srv:
        yield srv


@pytest.fixture(scope="module")
def stub(server):
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    yield pb_grpc.CoordinatorStub(channel)
    channel.close()


def b58(i: int) -> str:
    """An 8-character base58 rendering of ``i`` (base58 has no 0, O, I or l)."""
    return f"{i:08d}".replace("0", "z")


def peer_info(i: int, **kw) -> PeerInfo:
    return PeerInfo(**{"peer_id": f"12D3KooWgrpc{b58(i)}", "device": "cpu", "memory_bytes": 8 << 30,
                       "tokens_per_s": 1000.0, "public_key": b"key%d" % i, **kw})


def join_request(i: int = 0, token: str = TOKEN, **caps) -> pb.JoinRequest:
    c = {"device": "cpu", "memory_bytes": 8 << 30, "tokens_per_s": 1000.0, **caps}
    return pb.JoinRequest(token=token, peer_id=f"12D3KooWreq{b58(i)}", public_key=b"k%d" % i,
                          capabilities=pb.Capabilities(**c))


def code_of(call, request):
    try:
        call(request, timeout=10)
    except grpc.RpcError as e:
        return e.code(), e.details()
    return grpc.StatusCode.OK, ""


def test_join_reply_carries_the_run_spec(server):
    client = CoordinatorClient(f"127.0.0.1:{server.port}", TOKEN, peer_info(0, multiaddrs=("/ip4/127.0.0.1/tcp/1",)))
    try:
        info = client.join()
        assert info.run_config == RUN and info.run_config_hash == RUN.content_hash()
        assert info.lattice_hash == RUN.lattice.content_hash()
        assert info.lease_duration == 30.0 and info.heartbeat_interval == 5.0
        assert info.assignment.mode == "path" and info.assignment.reason
        assert info.assignment.module_ids == tuple(RUN.lattice.path_modules(info.assignment.path))
        reply = client.heartbeat([Progress(info.assignment.module_ids[1], 1, 640, 3.1)], tokens_per_s=1100.0)
        assert reply.lease_remaining > 29 and not reply.drain
        status = client.status()
        me = next(p for p in status["peers"] if p["peer_id"] == client.peer.peer_id)
        assert me["tokens"] == 640 and me["tokens_per_s"] == 1100.0
    finally:
        client.leave("test over")
        client.close()


@pytest.mark.parametrize("token,detail", [("", "token: missing"), ("wrong", "token: wrong run token")])
def test_bad_token_is_unauthenticated(stub, token, detail):
    code, msg = code_of(stub.Join, join_request(1, token=token))
    assert code == grpc.StatusCode.UNAUTHENTICATED and detail in msg
    code, _ = code_of(stub.Status, pb.StatusRequest(token=token))
    assert code == grpc.StatusCode.UNAUTHENTICATED


def test_client_reports_a_refused_token(server):
    client = CoordinatorClient(f"127.0.0.1:{server.port}", "nope", peer_info(2))
    with pytest.raises(CoordinatorRefused) as e:
        client.join()
    assert e.value.exit_code == 3
    client.close()


@pytest.mark.parametrize("caps,field", [
    ({"tokens_per_s": math.nan}, "capabilities.tokens_per_s"),
    ({"tokens_per_s": math.inf}, "capabilities.tokens_per_s"),
    ({"upload_bps": -1.0}, "capabilities.upload_bps"),
    ({"memory_bytes": 0}, "capabilities.memory_bytes"),
    ({"device": "x" * 1000}, "capabilities.device"),
    ({"multiaddrs": ["/ip4/999.1.1.1/tcp/1"]}, "capabilities.multiaddrs"),
    ({"multiaddrs": ["not a multiaddr"]}, "capabilities.multiaddrs"),
    ({"multiaddrs": ["/ip4/1.2.3.4/tcp/99999"]}, "capabilities.multiaddrs"),
])
def test_bad_capabilities_are_invalid_argument_naming_the_field(stub, caps, field):
    code, msg = code_of(stub.Join, join_request(3, **caps))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and msg.startswith(field), msg


def test_bad_peer_ids_and_duplicate_keys(stub):
    bad = join_request(4)
    bad.peer_id = "not base58 0OIl"
    assert code_of(stub.Join, bad)[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(stub.Join, join_request(5))[0] == grpc.StatusCode.OK
    other_key = join_request(5)
    other_key.public_key = b"another key"
    code, msg = code_of(stub.Join, other_key)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "different public key" in msg


def test_unknown_lease_is_not_found(stub):
    code, msg = code_of(stub.Heartbeat, pb.HeartbeatRequest(lease_id="0" * 32, peer_id="12D3KooWnobodyzzzzz"))
    assert code == grpc.StatusCode.NOT_FOUND and "join again" in msg
    code, _ = code_of(stub.Heartbeat, pb.HeartbeatRequest(lease_id="short", peer_id="12D3KooWnobodyzzzzz"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT


def test_no_fit_is_failed_precondition_and_exit_code_5(server):
    client = CoordinatorClient(f"127.0.0.1:{server.port}", TOKEN, peer_info(6, memory_bytes=1024))
    with pytest.raises(NoAssignmentFits) as e:
        client.join()
    assert e.value.exit_code == 5
    client.close()


def test_heartbeat_rejoins_transparently_after_the_lease_is_gone(server):
    client = CoordinatorClient(f"127.0.0.1:{server.port}", TOKEN, peer_info(7))
    try:
        first = client.join()
        server.coordinator.leave(first.lease_id, client.peer.peer_id, "simulated loss")
        reply = client.heartbeat()
        assert reply.rejoined and reply.join is not None and reply.join.rejoined
        assert client.joined.lease_id != first.lease_id
        assert client.heartbeat().lease_remaining > 0
    finally:
        client.close()


def test_a_rejoin_that_keeps_the_work_does_not_restart_the_peers_trainer(server):
    """The coordinator lost our lease (it restarted past its grace) and the re-join kept our path: the
    peer trains on. Restarting its trainer would withdraw its modules from the DHT for nothing, and
    holders behind it would stall on the withdrawal (a kill -9 coordinator test saw both)."""
    from peer.node.join import PeerNode, PeerOptions
    from peer.node.startup import NetworkOptions

    client = CoordinatorClient(f"127.0.0.1:{server.port}", TOKEN, peer_info(9))
    node = PeerNode(PeerOptions(NetworkOptions(f"127.0.0.1:{server.port}", TOKEN)))
    try:
        first = client.join()
        node._working = first.assignment
        server.coordinator.leave(first.lease_id, client.peer.peer_id, "simulated loss")
        reply = client.heartbeat()
        assert reply.rejoined and reply.assignment.same_work(first.assignment), (reply.assignment, first.assignment)
        # the matchmaker's "in touch with the coordinator since": from the re-join (the lease had lapsed)
        since = client.contact_since()
        assert since is not None and since >= client.answered_at - 1.0
        client.heartbeat()
        assert client.contact_since() == since  # unbroken
        client.answered_at -= client._contact_gap() + 1.0  # a heartbeat retried for longer than the gap
        assert client.contact_since() is None
        client.heartbeat()
        assert client.contact_since() > since  # in touch again, from now
        node._on_heartbeat(reply)
        assert node._should_stop() is None, "the kept work restarted the trainer"
        moved = dataclasses.replace(reply.assignment, path=tuple(1 - i for i in reply.assignment.path))
        node._on_heartbeat(dataclasses.replace(reply, assignment=moved))
        assert node._should_stop() == "reassigned"  # the control: other work does
    finally:
        client.close()


def test_drain_by_operator_reaches_the_peer(server):
    peer = CoordinatorClient(f"127.0.0.1:{server.port}", TOKEN, peer_info(8))
    operator = CoordinatorClient(f"127.0.0.1:{server.port}", TOKEN)
    try:
        peer.join()
        assert operator.drain(peer.peer.peer_id, "maintenance") == "draining"
        reply = peer.heartbeat()
        assert reply.drain and reply.drain_reason == "maintenance"
        peer.leave("drained")
        assert server.coordinator.peer(peer.peer.peer_id).state == "left"
    finally:
        peer.close()
        operator.close()


def test_unreachable_coordinator_raises_after_retry_timeout():
    from peer.localnet import free_port

    client = CoordinatorClient(f"127.0.0.1:{free_port()}", TOKEN, peer_info(9), retry_timeout=1.0, rpc_timeout=0.5,
                               backoff_base=0.05, seed=0)
    with pytest.raises(CoordinatorUnavailable, match="unreachable for 1s"):  # retry_timeout's error, not another
        client.join()
    client.close()


def test_health_service_reports_serving(server):
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for name in ("", SERVICE_NAME):
            r = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
            assert r.status == health_pb2.HealthCheckResponse.SERVING


def _self_signed(tmp_path):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(1).not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_path), str(key_path)


def test_tls(tmp_path):
    cert, key = _self_signed(tmp_path)
    opts = ServeOptions(db=":memory:", port=0, http_port=0, token=TOKEN, host="127.0.0.1", tls_cert=cert, tls_key=key)
    with BackgroundServer(RUN, SETTINGS, opts) as srv:
        secure = CoordinatorClient(f"localhost:{srv.port}", TOKEN, peer_info(10), tls_ca=cert)
        assert secure.join().assignment.mode == "path"
        secure.close()
        plain = CoordinatorClient(f"localhost:{srv.port}", TOKEN, peer_info(11), retry_timeout=0.5, rpc_timeout=0.5)
        with pytest.raises(NotACoordinator, match="TLS"):
            plain.join()  # named at once: a TLS server answers where the client speaks plain text
        plain.close()


# -- fuzzing ------------------------------------------------------------------------------------

text = st.one_of(st.text(max_size=40), st.text(min_size=200, max_size=600), st.sampled_from(
    ["12D3KooWfuzzzzzzzz1", "12D3KooWfuzzzzzzzz2", "/ip4/1.2.3.4/tcp/1", "/p2p-circuit", "", "L0M0", "embed"]))
floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, 1.0, 1e3, -1.0, 1e300]))
u64 = st.one_of(st.integers(0, 2**64 - 1), st.sampled_from([0, 1, 2**20, 2**40, 2**63]))
multiaddr = st.one_of(text, st.builds(lambda a, b, p: f"/ip4/{a}.{b}.0.1/tcp/{p}", st.integers(0, 300),
                                      st.integers(0, 300), st.integers(0, 70000)))
NEVER = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
FUZZ = hsettings(max_examples=150, deadline=None, derandomize=True,
                 suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def _durable_view(coord):
    return ({p.peer_id: (p.joins, p.key_fingerprint, p.tokens) for p in coord.peers()},
            {l.lease_id: l.expires_at for l in coord.leases()})


def _assert_unchanged(before, after):
    """A rejected request adds or renews nothing (leases may only lapse meanwhile)."""
    assert after[0] == before[0]
    assert all(before[1].get(lease_id) == expires for lease_id, expires in after[1].items())


@FUZZ
@given(token=st.sampled_from([TOKEN, "", "x"]), peer_id=text, key=st.binary(max_size=3000), device=text,
       memory=u64, tps=floats, up=floats, down=floats, addrs=st.lists(multiaddr, max_size=20), manifest=text)
def test_fuzzed_joins_never_yield_internal(server, stub, token, peer_id, key, device, memory, tps, up, down, addrs,
                                           manifest):
    request = pb.JoinRequest(token=token, peer_id=peer_id, public_key=key, manifest_hash=manifest,
                             capabilities=pb.Capabilities(device=device, memory_bytes=memory, tokens_per_s=tps,
                                                          upload_bps=up, download_bps=down, multiaddrs=addrs))
    before = _durable_view(server.coordinator)
    code, msg = code_of(stub.Join, request)
    assert code not in NEVER, msg
    if code != grpc.StatusCode.OK:
        _assert_unchanged(before, _durable_view(server.coordinator))


@FUZZ
@given(lease=st.one_of(text, st.just("real")), peer_id=text,
       progress=st.lists(st.tuples(text, u64, u64, floats), max_size=5), version=u64, tps=floats,
       sent=u64, received=u64, preempting=st.booleans())
def test_fuzzed_heartbeats_never_yield_internal(server, stub, lease, peer_id, progress, version, tps, sent, received,
                                                preempting):
    if lease == "real":
        reply = stub.Join(join_request(99), timeout=10)
        lease, peer_id = reply.lease.lease_id, f"12D3KooWreq{b58(99)}"
    request = pb.HeartbeatRequest(
        lease_id=lease, peer_id=peer_id, assignment_version=version, tokens_per_s=tps, bytes_sent=sent,
        bytes_received=received, preempting=preempting,
        progress=[pb.ModuleProgress(module_id=m, round=r, tokens=t, loss=l) for m, r, t, l in progress],
    )
    before = _durable_view(server.coordinator)
    code, msg = code_of(stub.Heartbeat, request)
    assert code not in NEVER, msg
    if code != grpc.StatusCode.OK:
        _assert_unchanged(before, _durable_view(server.coordinator))
    before = _durable_view(server.coordinator)
    code, msg = code_of(stub.Leave, pb.LeaveRequest(lease_id=lease, peer_id=peer_id, reason="fuzz"))
    assert code not in NEVER, msg
    if code != grpc.StatusCode.OK:
        _assert_unchanged(before, _durable_view(server.coordinator))


def test_service_is_healthy_after_fuzzing(server, stub):
    # fuzz here first, so that this check does not depend on the fuzz tests above having run before it
    test_fuzzed_joins_never_yield_internal(server=server, stub=stub)
    test_fuzzed_heartbeats_never_yield_internal(server=server, stub=stub)
    status = stub.Status(pb.StatusRequest(token=TOKEN), timeout=10)
    assert status.run_id == RUN.run_id
    assert code_of(stub.Drain, pb.DrainRequest(token=TOKEN, peer_id="12D3KooWunknownzzzz"))[0] == grpc.StatusCode.NOT_FOUND
    assert code_of(stub.GetRunSpec, pb.GetRunSpecRequest(token="bad"))[0] == grpc.StatusCode.UNAUTHENTICATED


def test_run_spec_before_joining(server):
    joined = CoordinatorClient(f"127.0.0.1:{server.port}", TOKEN, peer_info(12, multiaddrs=("/ip4/10.1.2.3/tcp/7",)))
    fresh = CoordinatorClient(f"127.0.0.1:{server.port}", TOKEN)
    try:
        joined.join()
        spec = fresh.run_spec()
        assert spec.run_config == RUN and spec.run_config_hash == RUN.content_hash()
        assert f"/ip4/10.1.2.3/tcp/7/p2p/{joined.peer.peer_id}" in spec.initial_peers
        with pytest.raises(CoordinatorRefused):
            CoordinatorClient(f"127.0.0.1:{server.port}", "wrong").run_spec()
    finally:
        joined.leave()
        joined.close()
        fresh.close()


def test_measured_link_rates_travel_in_heartbeats_and_an_older_peer_sends_none(server):
    from protos import versions

    client = CoordinatorClient(f"127.0.0.1:{server.port}", TOKEN, peer_info(31, upload_bps=9e6, download_bps=9e6))
    try:
        client.join()
        peer_id = client.peer.peer_id
        versions.set_override("coordinator=1.1")  # a peer of an older minor leaves the rates out
        try:
            client.heartbeat(link_bps=(2e6, 3e6), exchange_overhead_s=1.5)
        finally:
            versions.set_override(None)
        assert server.coordinator.peer(peer_id).capabilities.upload_bps == 9e6
        assert server.coordinator.peer(peer_id).exchange_overhead_s == 0.0
        versions.set_override("coordinator=1.2")  # the rates, not the overhead
        try:
            client.heartbeat(link_bps=(2e6, 3e6), exchange_overhead_s=1.5)
        finally:
            versions.set_override(None)
        peer = server.coordinator.peer(peer_id)
        assert (peer.capabilities.upload_bps, peer.capabilities.download_bps) == (2e6, 3e6)
        assert peer.link_measured_at > 0 and peer.exchange_overhead_s == 0.0
        client.heartbeat(link_bps=(2e6, 3e6), exchange_overhead_s=1.5)
        assert server.coordinator.peer(peer_id).exchange_overhead_s == 1.5
        with pytest.raises(CoordinatorRefused, match="measured_exchange_overhead_s"):
            client.heartbeat(exchange_overhead_s=float("nan"))
    finally:
        client.close()


def test_heartbeat_replies_carry_the_plans_of_the_peers_modules(server):
    from coordinator.planner import ModulePlan

    client = CoordinatorClient(f"127.0.0.1:{server.port}", TOKEN, peer_info(32))
    try:
        info = client.join()
        mine = info.assignment.module_ids[0]
        others = sorted(set(RUN.lattice.module_ids()) - set(info.assignment.module_ids))
        with server.coordinator._lock:  # as a planning pass would leave them
            server.coordinator.plans[mine] = [ModulePlan(mine, 20, "int4", 12, "slow holder"),
                                              ModulePlan(mine, 80, "int4", 30, "slower", overlap=True)]
            if others:
                server.coordinator.plans[others[0]] = [ModulePlan(others[0], 40, "int4", 3, "not ours")]
        reply = client.heartbeat()
        assert [(p.module_id, p.inner_steps, p.codec, p.from_round, p.reason, p.overlap) for p in reply.plans] == [
            (mine, 20, "int4", 12, "slow holder", False), (mine, 80, "int4", 30, "slower", True)]
    finally:
        with server.coordinator._lock:
            server.coordinator.plans.clear()
        client.close()


def test_a_peer_of_the_previous_coordinator_minor_is_known_not_to_follow_plans(server):
    from protos import versions

    old, new = (CoordinatorClient(f"127.0.0.1:{server.port}", TOKEN, peer_info(i)) for i in (33, 34))
    try:
        versions.set_override("coordinator=1.1")
        try:
            old.join()
        finally:
            versions.set_override(None)
        new.join()
        assert not server.coordinator.peer(old.peer.peer_id).follows_plans
        assert server.coordinator.peer(new.peer.peer_id).follows_plans
    finally:
        old.close()
        new.close()
