"""The committed gRPC stubs are exactly what ``python -m protos.generate`` writes from the protos."""

from __future__ import annotations

from pathlib import Path

from protos.generate import PROTO_FILES, ROOT, SERVICE_PROTOS, generate


def test_generated_stubs_match_protos(tmp_path):
    written = generate(tmp_path)
    assert len(written) == 2 * len(PROTO_FILES) + len(SERVICE_PROTOS)
    assert all(p.exists() for p in written)
    assert {"coordinator_pb2_grpc.py", "net_pb2.py", "net_pb2.pyi"} <= {p.name for p in written}
    stale = []
    for path in written:
        committed = ROOT / path.relative_to(tmp_path)
        if not committed.exists() or committed.read_bytes() != path.read_bytes():
            stale.append(str(committed.relative_to(ROOT)))
    assert not stale, f"stubs out of date, run `python -m protos.generate`: {stale}"


def test_every_rpc_has_its_own_messages():
    from protos import coordinator_pb2 as pb

    service = pb.DESCRIPTOR.services_by_name["Coordinator"]
    assert service.full_name == "hivepath.coordinator.v1.Coordinator"
    seen = set()
    for method in service.methods:
        assert method.input_type.name == f"{method.name}Request"
        assert method.output_type.name == f"{method.name}Response"
        seen |= {method.input_type.name, method.output_type.name}
    assert {"JoinRequest", "HeartbeatRequest", "LeaveRequest", "StatusRequest"} <= seen


def test_drift_is_detected(tmp_path):
    """Generation reflects the proto source: a changed proto gives different stubs."""
    src = Path(ROOT / PROTO_FILES[0]).read_text()
    assert "message JoinRequest" in src
    out = generate(tmp_path)
    text = next(p for p in out if p.name.endswith("_pb2.pyi")).read_text()
    assert "class JoinRequest" in text and "public_key" in text


def test_stream_rpcs_have_the_intended_shapes():
    """Heartbeats stream both ways; the bandwidth probes stream in one direction each."""
    from protos import coordinator_pb2 as pb

    methods = pb.DESCRIPTOR.services_by_name["Coordinator"].methods_by_name
    shapes = {name: (m.client_streaming, m.server_streaming) for name, m in methods.items()}
    assert shapes["HeartbeatStream"] == (True, True)
    assert shapes["ProbeUpload"] == (True, False)
    assert shapes["ProbeDownload"] == (False, True)
    assert shapes["Heartbeat"] == (False, False)  # the unary call stays for older peers and fallback
    assert methods["HeartbeatStream"].input_type.fields_by_name["heartbeat"].message_type.name == "HeartbeatRequest"
