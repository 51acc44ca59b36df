"""Every contract's golden messages (``tests/golden/contracts/``, written by
``tests/golden/regen_contracts.py``): today's writers give them byte for byte, today's readers read
every golden of the same major, a reader of the previous minor's schema reads today's messages (the
fields it lacks ignored and counted), and a schema that changed while its version did not fails."""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2, descriptor_pool
from google.protobuf import unknown_fields as proto_unknown
from google.protobuf.message_factory import GetMessageClass

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "golden"))

import contract_spec as spec  # noqa: E402
from protos import versions  # noqa: E402

REGEN = "regenerate on purpose: .venv/bin/python tests/golden/regen_contracts.py"
PROTO_CONTRACTS = [n for n in versions.NAMES if n != "dht"]


def _goldens(contract: str) -> list[str]:
    """Versions of ``contract`` with a golden file, of this release's major."""
    major = versions.CONTRACTS[contract].version[0]
    found = []
    for path in spec.HERE.glob(f"{contract}-*.json"):
        m = re.fullmatch(rf"{contract}-(\d+)\.(\d+)\.json", path.name)
        if m and int(m.group(1)) == major:
            found.append(f"{m.group(1)}.{m.group(2)}")
    return sorted(found)


def _unbumped(contract: str, recorded: dict) -> str:
    """Why the recorded fingerprint of ``contract`` disagrees with its schema now ('' when it agrees)."""
    now = versions.CONTRACTS[contract].text
    if recorded.get("version") != now:
        return (f"{contract} is at {now} but the goldens were written for {recorded.get('version')}; {REGEN}")
    if recorded.get("fingerprint") != spec.fingerprint(contract):
        return (f"the {contract} contract's schema changed but its version is still {now}: raise it in "
                f"protos/versions.py (a minor for optional fields, listed in Contract.added; a major otherwise), "
                f"then {REGEN}")
    return ""


@pytest.mark.parametrize("contract", versions.NAMES)
def test_a_contract_changes_only_with_its_version(contract):
    recorded = json.loads(spec.FINGERPRINTS.read_text())
    assert contract in recorded, REGEN
    assert _unbumped(contract, recorded[contract]) == ""


def test_an_added_field_without_a_bump_is_caught(monkeypatch):
    recorded = json.loads(spec.FINGERPRINTS.read_text())["stage"]
    files = spec.proto_files()
    proto = descriptor_pb2.FileDescriptorProto.FromString(files["stage"].serialized_pb)
    proto.name, proto.package = "changed/stage.proto", "changed.stage"
    request = next(m for m in proto.message_type if m.name == "StageRequest")
    request.field.add(name="priority", number=99, type=descriptor_pb2.FieldDescriptorProto.TYPE_UINT32,
                      label=descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL)
    for m in proto.message_type:
        for f in m.field:
            if f.type_name:
                f.type_name = f.type_name.replace(".hivepath.peer.v1.", ".changed.stage.")
    for s in proto.service:
        for method in s.method:
            method.input_type = method.input_type.replace(".hivepath.peer.v1.", ".changed.stage.")
            method.output_type = method.output_type.replace(".hivepath.peer.v1.", ".changed.stage.")
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    monkeypatch.setattr(spec, "proto_files", lambda: {**files, "stage": pool.FindFileByName(proto.name)})
    assert "schema changed but its version is still" in _unbumped("stage", recorded)

    @dataclasses.dataclass(frozen=True)
    class HolderRecord:  # a new required field, as a careless change would add it
        config_hash: str
        epoch: int

    records = spec.dht_records()
    monkeypatch.setattr(spec, "dht_records", lambda: {**records, "HolderRecord": (HolderRecord, None, None)})
    assert "schema changed" in _unbumped("dht", json.loads(spec.FINGERPRINTS.read_text())["dht"])


@pytest.mark.parametrize("contract", versions.NAMES)
def test_todays_writers_give_the_golden_bytes(contract):
    golden = spec.read_golden(contract, versions.CONTRACTS[contract].text)
    assert spec.samples(contract) == golden, f"the {contract} encoding changed; {REGEN}"


@pytest.mark.parametrize("contract", PROTO_CONTRACTS)
def test_todays_readers_read_every_golden_of_the_major(contract):
    file = spec.proto_files()[contract]
    for version in _goldens(contract):
        for name, data in spec.read_golden(contract, version).items():
            message = GetMessageClass(file.message_types_by_name[name]).FromString(data)
            assert not list(proto_unknown.UnknownFieldSet(message)), f"{contract} {version} {name}"
            assert message.SerializeToString(deterministic=True) == data


def _parse_record(name: str, data: bytes, cls=None):
    from hivemind.utils.serializer import MSGPackSerializer

    from peer.datasync.records import parse_seeder_record
    from peer.network.records import parse_record
    from peer.stage.records import parse_stage_record

    value = MSGPackSerializer.loads(data)
    if name == "StageServerRecord":
        return parse_stage_record("L0M1", spec.PEER, value)
    if name == "SeederRecord":
        return parse_seeder_record(spec.PEER, value)
    return parse_record(cls or spec.dht_records()[name][0], spec.PEER, value)


def test_todays_dht_readers_read_every_golden_of_the_major():
    for version in _goldens("dht"):
        for name, data in spec.read_golden("dht", version).items():
            record = _parse_record(name, data)
            assert record is not None, f"dht {version} {name}"
            if version == versions.CONTRACTS["dht"].text:
                assert record == spec.dht_records()[name][2]


@pytest.mark.parametrize("contract", PROTO_CONTRACTS)
def test_a_reader_of_the_previous_minor_reads_todays_messages(contract):
    if not spec.previous_minor()[contract]:
        pytest.skip(f"{contract} is at its major's first minor")
    old = spec.previous_proto_classes(contract)
    new = spec.proto_files()[contract]
    added = {tuple(f.split(".", 1)) for f in versions.CONTRACTS[contract].added[versions.CONTRACTS[contract].version[1]]}
    for name, data in spec.read_golden(contract, versions.CONTRACTS[contract].text).items():
        message = old[name].FromString(data)
        current = GetMessageClass(new.message_types_by_name[name]).FromString(data)
        lacking = {new.message_types_by_name[name].fields_by_name[f].number for m, f in added if m == name}
        assert {f.field_number for f in proto_unknown.UnknownFieldSet(message)} == lacking, name
        for field in message.DESCRIPTOR.fields:  # what it knows, it reads as today's reader does
            if field.message_type is None:
                assert getattr(message, field.name) == getattr(current, field.name), f"{name}.{field.name}"
        # one count per unknown field: a repeated field the minor added counts once, whatever its length
        before = versions.UNKNOWN_FIELDS.total()
        assert versions.unknown_proto_fields(message) == len(lacking)
        assert versions.UNKNOWN_FIELDS.total() == before + len(lacking)


def test_a_reader_of_the_previous_dht_minor_reads_todays_records():
    old = spec.previous_record_classes()
    added = {tuple(f.split(".", 1)) for f in versions.CONTRACTS["dht"].added[versions.CONTRACTS["dht"].version[1]]}
    for name, data in spec.read_golden("dht", versions.CONTRACTS["dht"].text).items():
        before = versions.UNKNOWN_FIELDS.snapshot()
        record = _parse_record(name, data, old[name])
        assert record is not None, name
        current = spec.dht_records()[name][2]
        for f in dataclasses.fields(record):
            assert getattr(record, f.name) == getattr(current, f.name), f"{name}.{f.name}"
        lacking = {f for m, f in added if m == name and f != "v"}
        after = versions.UNKNOWN_FIELDS.snapshot()
        if name in ("HolderRecord", "GroupDeclaration", "ArchiveRecord"):
            for f in lacking:
                assert after.get(f"{name}.{f}", 0) == before.get(f"{name}.{f}", 0) + 1, f"{name}.{f}"
