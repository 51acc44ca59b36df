from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class ChunkRequest(_message.Message):
    __slots__ = ("manifest_hash", "file", "index", "protocol")
    MANIFEST_HASH_FIELD_NUMBER: _ClassVar[int]
    FILE_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    manifest_hash: str
    file: str
    index: int
    protocol: str
    def __init__(self, manifest_hash: _Optional[str] = ..., file: _Optional[str] = ..., index: _Optional[int] = ..., protocol: _Optional[str] = ...) -> None: ...

class ChunkReply(_message.Message):
    __slots__ = ("ok", "error", "payload_len", "file_size")
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_LEN_FIELD_NUMBER: _ClassVar[int]
    FILE_SIZE_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    error: str
    payload_len: int
    file_size: int
    def __init__(self, ok: _Optional[bool] = ..., error: _Optional[str] = ..., payload_len: _Optional[int] = ..., file_size: _Optional[int] = ...) -> None: ...
