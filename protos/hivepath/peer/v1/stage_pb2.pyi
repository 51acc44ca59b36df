from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EncodedTensor(_message.Message):
    __slots__ = ("shape", "codec", "data")
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    shape: _containers.RepeatedScalarFieldContainer[int]
    codec: str
    data: bytes
    def __init__(self, shape: _Optional[_Iterable[int]] = ..., codec: _Optional[str] = ..., data: _Optional[bytes] = ...) -> None: ...

class StageRequest(_message.Message):
    __slots__ = ("kind", "module_id", "config_hash", "request_id", "input", "grad", "protocol", "residual")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        FORWARD: _ClassVar[StageRequest.Kind]
        BACKWARD: _ClassVar[StageRequest.Kind]
    FORWARD: StageRequest.Kind
    BACKWARD: StageRequest.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    MODULE_ID_FIELD_NUMBER: _ClassVar[int]
    CONFIG_HASH_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INPUT_FIELD_NUMBER: _ClassVar[int]
    GRAD_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    RESIDUAL_FIELD_NUMBER: _ClassVar[int]
    kind: StageRequest.Kind
    module_id: str
    config_hash: str
    request_id: str
    input: EncodedTensor
    grad: EncodedTensor
    protocol: str
    residual: bool
    def __init__(self, kind: _Optional[_Union[StageRequest.Kind, str]] = ..., module_id: _Optional[str] = ..., config_hash: _Optional[str] = ..., request_id: _Optional[str] = ..., input: _Optional[_Union[EncodedTensor, _Mapping]] = ..., grad: _Optional[_Union[EncodedTensor, _Mapping]] = ..., protocol: _Optional[str] = ..., residual: _Optional[bool] = ...) -> None: ...

class StageReply(_message.Message):
    __slots__ = ("code", "error", "output", "queue_length", "throughput", "residual")
    class Code(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        OK: _ClassVar[StageReply.Code]
        BAD_REQUEST: _ClassVar[StageReply.Code]
        NOT_HELD: _ClassVar[StageReply.Code]
        UNKNOWN_REQUEST: _ClassVar[StageReply.Code]
        INTERNAL: _ClassVar[StageReply.Code]
    OK: StageReply.Code
    BAD_REQUEST: StageReply.Code
    NOT_HELD: StageReply.Code
    UNKNOWN_REQUEST: StageReply.Code
    INTERNAL: StageReply.Code
    CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    QUEUE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    THROUGHPUT_FIELD_NUMBER: _ClassVar[int]
    RESIDUAL_FIELD_NUMBER: _ClassVar[int]
    code: StageReply.Code
    error: str
    output: EncodedTensor
    queue_length: int
    throughput: float
    residual: bool
    def __init__(self, code: _Optional[_Union[StageReply.Code, str]] = ..., error: _Optional[str] = ..., output: _Optional[_Union[EncodedTensor, _Mapping]] = ..., queue_length: _Optional[int] = ..., throughput: _Optional[float] = ..., residual: _Optional[bool] = ...) -> None: ...
