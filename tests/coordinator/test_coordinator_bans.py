"""Bans and credentials in the coordinator: the pure ban decision and its reasons, reports leading to
a ban (lease dropped, join refused, credential not renewed), operator ban/unban, bans surviving a
restart, credential issue and renewal; then the same over real gRPC, fuzzed."""

from __future__ import annotations

import grpc
import pytest
from hypothesis import HealthCheck, given, settings as hsettings, strategies as st

from coordinator.bans import Report, ban_decision
from coordinator.core import Coordinator
from coordinator.errors import Banned, InvalidArgument, LeaseNotFound, PeerNotFound
from coordinator.records import Capabilities
from coordinator.server import BackgroundServer, ServeOptions
from coordinator.settings import CoordinatorSettings
from coordinator.sqlite_store import SQLiteStore
from coordinator.store import MemoryStore
from models.presets import tiny_cpu
from models.errors import ConfigError
from peer.coordinator_client import CoordinatorClient, PeerBanned, PeerInfo
from peer.network import CredentialVerifier
from protos import coordinator_pb2 as pb
from protos import coordinator_pb2_grpc as pb_grpc
from protos.credential import decode_credential

RUN = tiny_cpu()
SETTINGS = CoordinatorSettings(lease_timeout=30.0, heartbeat_interval=5.0, credential_timeout=100.0,
                               ban_reporters=2, ban_reports=3, ban_window=60.0)
T0 = 1_000_000.0


class Clock:
    def __init__(self, t: float = T0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def pid(i: int) -> str:
    return "12D3KooWbans" + str(i).replace("0", "z").rjust(8, "z")  # base58: no zero


def caps() -> Capabilities:
    return Capabilities("cpu", 8 << 30, 1000.0)


def report(reporter: int, round_no: int = 1, at: float = T0, suspect: int = 9) -> Report:
    return Report(pid(reporter), pid(suspect), "L0M0", round_no, "norm 1e9 x the median", at)


# -- the pure decision -----------------------------------------------------------------------------

def test_ban_decision_needs_distinct_reporters_or_repeated_rounds():
    args = dict(window=60.0, min_reporters=2, min_reports=3)
    ok, why = ban_decision([report(1)], T0, **args)
    assert not ok and "1 distinct reporters of 2 and 1 reports of 3" in why
    ok, why = ban_decision([report(1), report(1), report(1)], T0, **args)  # the same report repeated
    assert not ok and "1 reports of 3" in why
    ok, why = ban_decision([report(1), report(2)], T0, **args)
    assert ok and "reported by 2 distinct peers within 60s (threshold 2): norm 1e9" in why
    ok, why = ban_decision([report(1, r) for r in (1, 2, 3)], T0, **args)
    assert ok and "reported 3 times within 60s (threshold 3)" in why
    ok, why = ban_decision([report(1, at=T0 - 61), report(2)], T0, **args)
    assert not ok and "1 distinct reporters" in why
    assert ban_decision([], T0, **args) == (False, "no reports within the window")
    ok, why = ban_decision([report(1, r) for r in range(10)], T0, window=60.0, min_reporters=2, min_reports=0)
    assert not ok and "unlimited" in why


def test_settings_refuse_a_credential_shorter_than_two_heartbeats():
    with pytest.raises(ConfigError, match="credential_timeout"):
        CoordinatorSettings(heartbeat_interval=5.0, credential_timeout=9.0)
    with pytest.raises(ConfigError, match="ban_reporters"):
        CoordinatorSettings(ban_reporters=0)


# -- the state machine ----------------------------------------------------------------------------

@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def store():
    return MemoryStore()


@pytest.fixture
def coord(clock, store):
    return Coordinator(RUN, SETTINGS, store, clock=clock)


def test_join_issues_a_credential_and_heartbeats_renew_it_at_half_life(coord, clock):
    joined = coord.join(pid(0), b"k0", caps())
    verifier = CredentialVerifier(RUN.run_id, coord.issuer.public_key, clock=clock)
    assert verifier.check(joined.credential, pid(0)) == ""
    assert "not to the sender" in verifier.check(joined.credential, pid(1))
    assert decode_credential(joined.credential).expires_at == T0 + 100.0
    for _ in range(2):
        clock.t += 20
        assert coord.heartbeat(joined.lease.lease_id, pid(0)).credential == b""  # 80 s, then 60 s left
    clock.t += 20  # 40 s left of 100: renew
    renewed = coord.heartbeat(joined.lease.lease_id, pid(0)).credential
    assert decode_credential(renewed).expires_at == clock.t + 100.0
    assert coord.heartbeat(joined.lease.lease_id, pid(0)).credential == b""


def test_reports_from_two_peers_ban_the_suspect(coord, clock, store):
    leases = {i: coord.join(pid(i), b"k%d" % i, caps()).lease.lease_id for i in range(3)}
    first = coord.report(leases[1], pid(1), pid(0), "L0M0", 4, "NaN pseudo-gradient")
    assert not first.banned and "1 distinct reporters of 2" in first.reason
    again = coord.report(leases[1], pid(1), pid(0), "L0M0", 4, "NaN pseudo-gradient")
    assert not again.banned
    second = coord.report(leases[2], pid(2), pid(0), "L0M1", 4, "norm 1e6 x median")
    assert second.banned and "reported by 2 distinct peers" in second.reason
    assert coord.peer(pid(0)).state == "banned" and pid(0) not in {l.peer_id for l in coord.leases()}
    with pytest.raises(LeaseNotFound):
        coord.heartbeat(leases[0], pid(0))  # no lease, hence no renewed credential
    with pytest.raises(Banned, match="is banned from this run .*reported by 2 distinct peers.*unban"):
        coord.join(pid(0), b"k0", caps())
    assert coord.counters["rejected_banned"] == 1
    reloaded = Coordinator(RUN, SETTINGS, store, clock=clock)  # bans survive a restart
    with pytest.raises(Banned):
        reloaded.join(pid(0), b"k0", caps())
    assert reloaded.unban(pid(0)) == "left"
    assert reloaded.join(pid(0), b"k0", caps()).rejoined


def test_rejected_reports_change_nothing(coord):
    lease = coord.join(pid(1), b"k1", caps()).lease.lease_id
    coord.join(pid(2), b"k2", caps())
    before = (coord.peers(), coord.leases(), dict(coord.counters))
    with pytest.raises(LeaseNotFound):
        coord.report("0" * 32, pid(1), pid(2), "L0M0", 1, "x")
    with pytest.raises(LeaseNotFound):
        coord.report(lease, pid(3), pid(2), "L0M0", 1, "someone else's lease")
    with pytest.raises(InvalidArgument, match="itself"):
        coord.report(lease, pid(1), pid(1), "L0M0", 1, "x")
    with pytest.raises(InvalidArgument, match="module_id"):
        coord.report(lease, pid(1), pid(2), "L9M9", 1, "x")
    with pytest.raises(PeerNotFound):
        coord.report(lease, pid(1), pid(7), "L0M0", 1, "x")
    assert (coord.peers(), coord.leases(), dict(coord.counters)) == before


def test_operator_ban_and_unban_persist_in_sqlite(tmp_path, clock):
    store = SQLiteStore(str(tmp_path / "s.db"))
    coord = Coordinator(RUN, SETTINGS, store, clock=clock)
    coord.join(pid(0), b"k0", caps())
    assert coord.ban(pid(0), "spam") == "banned" and coord.ban(pid(5)) == "banned"  # unknown ids too
    store.close()
    store = SQLiteStore(str(tmp_path / "s.db"))
    coord = Coordinator(RUN, SETTINGS, store, clock=clock)
    assert coord.peer(pid(0)).state == "banned" and coord.bans.is_banned(pid(5)).by_operator
    with pytest.raises(Banned, match="spam"):
        coord.join(pid(0), b"k0", caps())
    assert coord.unban(pid(5)) == "unknown"
    with pytest.raises(PeerNotFound, match="not banned"):
        coord.unban(pid(5))
    store.close()


# -- over gRPC ------------------------------------------------------------------------------------

TOKEN = "bans-token"


@pytest.fixture(scope="module")
def server():
    opts = ServeOptions(db=":memory:", port=0, http_port=0, token=TOKEN, host="127.0.0.1")
    with BackgroundServer(RUN, SETTINGS, opts) as srv:
        yield srv


def client(srv, i: int) -> CoordinatorClient:
    return CoordinatorClient(f"127.0.0.1:{srv.port}", TOKEN, PeerInfo(pid(i), "cpu", 8 << 30, 1000.0,
                                                                      public_key=b"k%d" % i), retry_timeout=5.0)


def test_report_ban_and_unban_over_grpc(server):
    peers = [client(server, i) for i in (10, 11, 12)]
    try:
        infos = [p.join() for p in peers]
        verifier = CredentialVerifier(RUN.run_id, infos[0].coordinator_public_key)
        assert all(verifier.check(p.credential, p.peer.peer_id) == "" for p in peers)
        assert peers[1].report_peer(pid(10), "L0M0", 2, "NaN")[0] is False
        assert peers[1].report_peer(pid(10), "L0M0", 2, "NaN")[0] is False  # the same report twice: one reporter
        banned, why = peers[2].report_peer(pid(10), "L0M1", 2, "huge norm")
        assert banned and "2 distinct peers" in why
        with pytest.raises(PeerBanned, match="banned from this run"):
            peers[0].heartbeat()  # the lease is gone; the transparent re-join is refused
        operator = CoordinatorClient(f"127.0.0.1:{server.port}", TOKEN)
        assert operator.unban(pid(10)) == "left"
        assert operator.ban(pid(11), "operator says so") == "banned"
        assert peers[0].join().rejoined
        with pytest.raises(PeerBanned, match="operator says so"):
            peers[1].join()
        operator.close()
    finally:
        for p in peers:
            p.close()


def test_background_reports_ban_without_blocking_the_caller(server):
    from peer.localnet import wait_for

    peers = [client(server, i) for i in (13, 14, 15)]
    try:
        for p in peers:
            p.join()
        for p in peers[1:]:
            p.report_peer_later(pid(13), "L1M0", 3, "random pseudo-gradient")  # the on_suspect hook's shape
        wait_for(lambda: server.coordinator.bans.is_banned(pid(13)) is not None, 20, "the background reports' ban")
        assert "2 distinct peers" in server.coordinator.bans.is_banned(pid(13)).reason
    finally:
        for p in peers:
            p.close()


text = st.one_of(st.text(max_size=40), st.text(min_size=200, max_size=600), st.sampled_from(
    [pid(20), pid(21), pid(99), "", "L0M0", "embed", "0" * 32]))
NEVER = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
FUZZ = hsettings(max_examples=120, deadline=None, derandomize=True,
                 suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.fixture(scope="module")
def fuzz_peers(server):
    a, b = client(server, 20), client(server, 21)
    a.join(), b.join()
    yield a, b
    a.close(), b.close()


def _code(call, request):
    try:
        call(request, timeout=10)
        return grpc.StatusCode.OK
    except grpc.RpcError as e:
        return e.code()


@FUZZ
@given(lease=st.one_of(text, st.just("real")), peer_id=text, suspect=text, module=text,
       round_no=st.integers(0, 2**64 - 1), reason=text, token=st.sampled_from([TOKEN, "", "bad"]))
def test_fuzzed_reports_and_bans_never_yield_internal_or_change_state(server, fuzz_peers, lease, peer_id, suspect,
                                                                      module, round_no, reason, token):
    a, _ = fuzz_peers
    coord = server.coordinator
    before = ({p.peer_id: p.state for p in coord.peers()}, dict(coord.bans.bans))
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        stub = pb_grpc.CoordinatorStub(ch)
        lease_id = a.joined.lease_id if lease == "real" else lease
        code = _code(stub.ReportPeer, pb.ReportPeerRequest(lease_id=lease_id, peer_id=peer_id, suspect_peer_id=suspect,
                                                           module_id=module, round=round_no, reason=reason))
        assert code not in NEVER
        if code != grpc.StatusCode.OK:
            assert ({p.peer_id: p.state for p in coord.peers()}, dict(coord.bans.bans)) == before
        for call, request in ((stub.Ban, pb.BanRequest(token=token, peer_id=peer_id, reason=reason)),
                              (stub.Unban, pb.UnbanRequest(token=token, peer_id=peer_id))):
            before = dict(coord.bans.bans)
            code = _code(call, request)
            assert code not in NEVER
            if code != grpc.StatusCode.OK:
                assert dict(coord.bans.bans) == before
        if token != TOKEN:
            assert code == grpc.StatusCode.UNAUTHENTICATED
        for p in (pid(20), pid(21)):  # keep the fuzzing peers' ids usable
            if coord.bans.is_banned(p):
                coord.unban(p)
