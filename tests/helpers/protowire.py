"""Protobuf frames for the raw-frame tests of every door (the coordinator's gRPC methods, the peers' p2p
handlers), generated from a message descriptor so that a new method or field is fuzzed without a test
change. Each frame is classified by protobuf itself (:func:`parses`), so no test can pass on a frame
that happens to be a valid message."""

from __future__ import annotations

import random

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError
from google.protobuf.message_factory import GetMessageClass

__all__ = ["varint", "tag", "populated", "frames", "parses", "canonical"]


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def tag(field: int, wire_type: int) -> bytes:
    return varint(field << 3 | wire_type)


_FIXED64 = {FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FIXED64, FieldDescriptor.TYPE_SFIXED64}
_FIXED32 = {FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_FIXED32, FieldDescriptor.TYPE_SFIXED32}


def populated(d: Descriptor) -> bytes:
    """A valid encoding of ``d`` with every field set once (nested messages empty)."""
    out = b""
    for f in d.fields:
        if f.type in _FIXED64:
            out += tag(f.number, 1) + bytes(8)
        elif f.type in _FIXED32:
            out += tag(f.number, 5) + bytes(4)
        elif f.type == FieldDescriptor.TYPE_MESSAGE:
            out += tag(f.number, 2) + varint(0)
        elif f.type in (FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES):
            out += tag(f.number, 2) + varint(1) + b"x"
        else:
            out += tag(f.number, 0) + varint(1)
    return out


def frames(d: Descriptor, seed: str) -> dict[str, bytes]:
    """The fixed, seeded frames sent to a method whose request type is ``d``."""
    out = {
        "empty": b"",
        "unknown-field": tag(999, 0) + varint(7),
        "length-past-end": tag(1, 2) + varint(16) + b"abc",
        "overlong-varint": tag(1, 0) + b"\xff" * 10 + b"\x01",
        "unterminated-varint": tag(1, 0) + b"\x80" * 5,
        "end-group-without-start": tag(1, 4),
        "wire-type-7": tag(1, 7) + b"\x00",
        "field-number-0": tag(0, 0) + varint(1),
        "unclosed-group": tag(1, 3) + tag(2, 0) + varint(1),
        "deep-groups": tag(1, 3) * 2000 + tag(1, 4) * 2000,
    }
    if d.fields:
        f = d.fields[0]
        out["wrong-wire-type"] = tag(f.number, 5 if f.type not in _FIXED32 else 1) + bytes(8)
        out["truncated-message"] = populated(d)[:-1]
    for f in d.fields:
        if f.type == FieldDescriptor.TYPE_STRING:
            out[f"bad-utf8-{f.name}"] = tag(f.number, 2) + varint(2) + b"\xff\xfe"
    rng = random.Random(seed)
    for i in range(8):
        out[f"random-{i}"] = rng.randbytes(rng.randint(1, 48))
    return out


def parses(d: Descriptor, frame: bytes) -> bool:
    try:
        GetMessageClass(d).FromString(frame)
    except DecodeError:
        return False
    return True


def canonical(d: Descriptor, frame: bytes) -> bytes:
    """``frame`` parsed and re-encoded without its unknown fields."""
    message = GetMessageClass(d).FromString(frame)
    message.DiscardUnknownFields()
    return message.SerializeToString()
