"""The contracts of :mod:`protos.versions` as bytes: one sample message of each type, encoded; the
fingerprint of each contract's schema; and a reader of the previous minor's schema.

Shared by ``regen_contracts.py`` (which writes ``contracts/fingerprints.json`` and
``contracts/{contract}-{version}.json``) and ``tests/protos/test_contract_versions.py`` (which checks them).

- Protobuf contracts (``coordinator``, ``averaging``, ``stage``, ``data``): every message type of the
  contract's ``.proto``, each field set to a value derived from its number (two elements for a
  repeated field, one entry for a map, sub-messages filled two levels deep), serialized
  deterministically. The fingerprint is the sha256 of the file's descriptor (names, numbers, types:
  what a reader decodes by, not the comments).
- The ``dht`` contract: one record of each type with every field set, as ``to_value`` (or the stage
  and seeder records' writers) stores it, msgpack-encoded as hivemind's DHT does. The fingerprint is
  the sha256 of every record type's fields and types, the version field and the withdrawal's fields.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any, Callable

from google.protobuf import descriptor_pb2, descriptor_pool
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message_factory import GetMessageClass

from protos import versions

HERE = Path(__file__).resolve().parent / "contracts"
FINGERPRINTS = HERE / "fingerprints.json"
PEER = "12D3KooWPbySgUijvGYy1St7ys38Ccfc1ce5RqA2rc5aoSFH4tkJ"


def proto_files() -> dict[str, Any]:
    """Contract -> its generated protobuf module's file descriptor."""
    from protos.hivepath.coordinator.v1 import coordinator_pb2
    from protos.hivepath.peer.v1 import data_pb2, net_pb2, stage_pb2

    return {"coordinator": coordinator_pb2.DESCRIPTOR, "averaging": net_pb2.DESCRIPTOR,
            "stage": stage_pb2.DESCRIPTOR, "data": data_pb2.DESCRIPTOR}


def dht_records() -> dict[str, tuple[type, Callable[[Any], dict], Any]]:
    """Record type name -> (its class, its writer, a sample with every field set)."""
    from peer.datasync.records import SeederRecord, seeder_value
    from peer.network.records import ArchiveRecord, GroupDeclaration, HolderRecord, to_value
    from peer.stage.records import StageServerRecord, stage_record_value

    return {
        "HolderRecord": (HolderRecord, to_value, HolderRecord("ab12", "cd34", 3, 100.5, 1.25e7, b"cred", "ef56", True, "1.0")),
        "GroupDeclaration": (GroupDeclaration, to_value, GroupDeclaration(
            "ab12", "cd34", 2.5e6, b"cred", "ef56", (PEER,), True, "1.0", "0a1b", True)),
        "ArchiveRecord": (ArchiveRecord, to_value, ArchiveRecord("ab12", "cd34", 7, b"cred")),
        "StageServerRecord": (StageServerRecord, stage_record_value, StageServerRecord("L0M1", "ab12", 321.5, 4)),
        "SeederRecord": (SeederRecord, seeder_value, SeederRecord(10, b"\xff\x03")),
    }


# -- samples ---------------------------------------------------------------------------------------


def _scalar(field: FieldDescriptor, i: int) -> Any:
    n = field.number + i
    t = field.type
    if t == FieldDescriptor.TYPE_STRING:
        return f"{field.name}-{n}"
    if t == FieldDescriptor.TYPE_BYTES:
        return bytes([n % 256]) * 3
    if t == FieldDescriptor.TYPE_BOOL:
        return True
    if t in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        return n + 0.5
    if t == FieldDescriptor.TYPE_ENUM:
        values = field.enum_type.values
        return values[min(1, len(values) - 1)].number
    return n


def fill(message: Any, depth: int = 2) -> Any:
    """``message`` with every field set (see the module docstring); returns it."""
    for field in message.DESCRIPTOR.fields:
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            key_f, value_f = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
            if value_f.message_type is None:
                getattr(message, field.name)[_scalar(key_f, 0)] = _scalar(value_f, 0)
        elif field.message_type is not None:
            if depth == 0:
                continue
            if field.is_repeated:
                for _ in range(2):
                    fill(getattr(message, field.name).add(), depth - 1)
            else:
                fill(getattr(message, field.name), depth - 1)
        elif field.is_repeated:
            getattr(message, field.name).extend([_scalar(field, 0), _scalar(field, 1)])
        else:
            setattr(message, field.name, _scalar(field, 0))
    return message


def samples(contract: str) -> dict[str, bytes]:
    """Message or record type -> the encoded sample of ``contract`` at the version this process states."""
    if contract == "dht":
        from hivemind.utils.serializer import MSGPackSerializer

        return {name: MSGPackSerializer.dumps(writer(sample)) for name, (_, writer, sample) in dht_records().items()}
    out = {}
    for name, desc in proto_files()[contract].message_types_by_name.items():
        out[name] = fill(GetMessageClass(desc)()).SerializeToString(deterministic=True)
    return out


# -- fingerprints ----------------------------------------------------------------------------------


def fingerprint(contract: str) -> str:
    """sha256 of what a reader of ``contract`` decodes by (see the module docstring)."""
    if contract == "dht":
        from peer.network.records import VERSION_FIELD, withdrawal

        schema = {name: [(f.name, str(f.type), f.default is dataclasses.MISSING) for f in dataclasses.fields(cls)]
                  for name, (cls, _, _) in sorted(dht_records().items())}
        schema["version_field"] = VERSION_FIELD
        schema["withdrawal"] = sorted(withdrawal(b"c", 1, "ab", "cd"))
        text = json.dumps(schema, sort_keys=True).encode()
    else:
        text = proto_files()[contract].serialized_pb
    return hashlib.sha256(text).hexdigest()


# -- the previous minor's reader -------------------------------------------------------------------


def previous_minor() -> dict[str, str]:
    """Contract -> its previous minor's version ('' for a contract at minor 0)."""
    return {name: f"{c.version[0]}.{c.version[1] - 1}" if c.version[1] else "" for name, c in versions.CONTRACTS.items()}


def _dropped(contract: str) -> set[tuple[str, str]]:
    """(type, field) pairs the contract's current minor added: what the previous minor's schema lacks."""
    c = versions.CONTRACTS[contract]
    return {tuple(f.split(".", 1)) for f in c.added.get(c.version[1], ())}


def previous_proto_classes(contract: str) -> dict[str, type]:
    """Message name -> a class of the previous minor's schema of ``contract`` (the current ``.proto``
    less the fields the current minor added), in a pool of its own."""
    drop = _dropped(contract)
    proto = descriptor_pb2.FileDescriptorProto.FromString(proto_files()[contract].serialized_pb)
    proto.name = f"previous_minor/{proto.name}"
    proto.package = f"previous_minor.{proto.package}"
    for message in proto.message_type:
        kept = [f for f in message.field if (message.name, f.name) not in drop]
        del message.field[:]
        message.field.extend(kept)
        for f in message.field:  # types of this file, now in the renamed package
            if f.type_name.startswith(".hivepath."):
                f.type_name = ".previous_minor" + f.type_name
    for service in proto.service:
        for method in service.method:
            method.input_type = ".previous_minor" + method.input_type
            method.output_type = ".previous_minor" + method.output_type
    pool = descriptor_pool.DescriptorPool()
    file = pool.Add(proto) and pool.FindFileByName(proto.name)
    return {name: GetMessageClass(desc) for name, desc in file.message_types_by_name.items()}


def previous_record_classes() -> dict[str, type]:
    """Record name -> a dataclass of the previous minor's DHT schema (the current one less the fields
    the current minor added), of the same name (so its unknown fields are counted under it)."""
    drop = _dropped("dht")
    out = {}
    for name, (cls, _, _) in dht_records().items():
        fields = [(f.name, f.type, dataclasses.field(default=f.default) if f.default is not dataclasses.MISSING
                   else dataclasses.field()) for f in dataclasses.fields(cls) if (name, f.name) not in drop]
        out[name] = dataclasses.make_dataclass(name, fields, frozen=True)
    return out


def golden_path(contract: str, version: str) -> Path:
    return HERE / f"{contract}-{version}.json"


def read_golden(contract: str, version: str) -> dict[str, bytes]:
    data = json.loads(golden_path(contract, version).read_text())
    return {name: bytes.fromhex(h) for name, h in data["messages"].items()}
