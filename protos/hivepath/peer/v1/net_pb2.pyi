from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class JoinRequest(_message.Message):
    __slots__ = ("group_key", "config_hash", "data_hash", "bandwidth", "credential", "state_digest", "fetched_from", "relayed", "weight", "protocol", "wire")
    GROUP_KEY_FIELD_NUMBER: _ClassVar[int]
    CONFIG_HASH_FIELD_NUMBER: _ClassVar[int]
    DATA_HASH_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTH_FIELD_NUMBER: _ClassVar[int]
    CREDENTIAL_FIELD_NUMBER: _ClassVar[int]
    STATE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    FETCHED_FROM_FIELD_NUMBER: _ClassVar[int]
    RELAYED_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    WIRE_FIELD_NUMBER: _ClassVar[int]
    group_key: str
    config_hash: str
    data_hash: str
    bandwidth: float
    credential: bytes
    state_digest: str
    fetched_from: str
    relayed: bool
    weight: float
    protocol: str
    wire: str
    def __init__(self, group_key: _Optional[str] = ..., config_hash: _Optional[str] = ..., data_hash: _Optional[str] = ..., bandwidth: _Optional[float] = ..., credential: _Optional[bytes] = ..., state_digest: _Optional[str] = ..., fetched_from: _Optional[str] = ..., relayed: _Optional[bool] = ..., weight: _Optional[float] = ..., protocol: _Optional[str] = ..., wire: _Optional[str] = ...) -> None: ...

class JoinReply(_message.Message):
    __slots__ = ("code", "reason", "group_id", "members", "bandwidths", "allreduce_timeout", "suggested_leader", "credential", "relayed", "weights")
    class Code(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        UNKNOWN: _ClassVar[JoinReply.Code]
        ACCEPTED: _ClassVar[JoinReply.Code]
        BEGIN: _ClassVar[JoinReply.Code]
        REFUSED: _ClassVar[JoinReply.Code]
        NOT_A_LEADER: _ClassVar[JoinReply.Code]
    UNKNOWN: JoinReply.Code
    ACCEPTED: JoinReply.Code
    BEGIN: JoinReply.Code
    REFUSED: JoinReply.Code
    NOT_A_LEADER: JoinReply.Code
    CODE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTHS_FIELD_NUMBER: _ClassVar[int]
    ALLREDUCE_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    SUGGESTED_LEADER_FIELD_NUMBER: _ClassVar[int]
    CREDENTIAL_FIELD_NUMBER: _ClassVar[int]
    RELAYED_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    code: JoinReply.Code
    reason: str
    group_id: str
    members: _containers.RepeatedScalarFieldContainer[str]
    bandwidths: _containers.RepeatedScalarFieldContainer[float]
    allreduce_timeout: float
    suggested_leader: str
    credential: bytes
    relayed: _containers.RepeatedScalarFieldContainer[bool]
    weights: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, code: _Optional[_Union[JoinReply.Code, str]] = ..., reason: _Optional[str] = ..., group_id: _Optional[str] = ..., members: _Optional[_Iterable[str]] = ..., bandwidths: _Optional[_Iterable[float]] = ..., allreduce_timeout: _Optional[float] = ..., suggested_leader: _Optional[str] = ..., credential: _Optional[bytes] = ..., relayed: _Optional[_Iterable[bool]] = ..., weights: _Optional[_Iterable[float]] = ...) -> None: ...

class PartHeader(_message.Message):
    __slots__ = ("group_id", "part_index", "attempt", "weight", "numel", "codec", "payload_len", "segment")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    PART_INDEX_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_LEN_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    part_index: int
    attempt: int
    weight: float
    numel: int
    codec: str
    payload_len: int
    segment: int
    def __init__(self, group_id: _Optional[str] = ..., part_index: _Optional[int] = ..., attempt: _Optional[int] = ..., weight: _Optional[float] = ..., numel: _Optional[int] = ..., codec: _Optional[str] = ..., payload_len: _Optional[int] = ..., segment: _Optional[int] = ...) -> None: ...

class PartReply(_message.Message):
    __slots__ = ("ok", "error", "contributors", "payload_len", "received")
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTORS_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_LEN_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    error: str
    contributors: _containers.RepeatedScalarFieldContainer[str]
    payload_len: int
    received: bool
    def __init__(self, ok: _Optional[bool] = ..., error: _Optional[str] = ..., contributors: _Optional[_Iterable[str]] = ..., payload_len: _Optional[int] = ..., received: _Optional[bool] = ...) -> None: ...

class StateRequest(_message.Message):
    __slots__ = ("module_id", "config_hash", "credential", "joining", "offset", "digest")
    MODULE_ID_FIELD_NUMBER: _ClassVar[int]
    CONFIG_HASH_FIELD_NUMBER: _ClassVar[int]
    CREDENTIAL_FIELD_NUMBER: _ClassVar[int]
    JOINING_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    module_id: str
    config_hash: str
    credential: bytes
    joining: bool
    offset: int
    digest: str
    def __init__(self, module_id: _Optional[str] = ..., config_hash: _Optional[str] = ..., credential: _Optional[bytes] = ..., joining: _Optional[bool] = ..., offset: _Optional[int] = ..., digest: _Optional[str] = ...) -> None: ...

class StateReply(_message.Message):
    __slots__ = ("ok", "error", "round_no", "payload_len", "total_len", "digest")
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ROUND_NO_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_LEN_FIELD_NUMBER: _ClassVar[int]
    TOTAL_LEN_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    error: str
    round_no: int
    payload_len: int
    total_len: int
    digest: str
    def __init__(self, ok: _Optional[bool] = ..., error: _Optional[str] = ..., round_no: _Optional[int] = ..., payload_len: _Optional[int] = ..., total_len: _Optional[int] = ..., digest: _Optional[str] = ...) -> None: ...

class ResultRequest(_message.Message):
    __slots__ = ("group_id", "credential")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    CREDENTIAL_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    credential: bytes
    def __init__(self, group_id: _Optional[str] = ..., credential: _Optional[bytes] = ...) -> None: ...

class ResultReply(_message.Message):
    __slots__ = ("ok", "error", "codec", "bounds", "payload_lens", "contributors", "credential", "late", "part_digests")
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    BOUNDS_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_LENS_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTORS_FIELD_NUMBER: _ClassVar[int]
    CREDENTIAL_FIELD_NUMBER: _ClassVar[int]
    LATE_FIELD_NUMBER: _ClassVar[int]
    PART_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    error: str
    codec: str
    bounds: _containers.RepeatedScalarFieldContainer[int]
    payload_lens: _containers.RepeatedScalarFieldContainer[int]
    contributors: _containers.RepeatedScalarFieldContainer[str]
    credential: bytes
    late: bool
    part_digests: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, ok: _Optional[bool] = ..., error: _Optional[str] = ..., codec: _Optional[str] = ..., bounds: _Optional[_Iterable[int]] = ..., payload_lens: _Optional[_Iterable[int]] = ..., contributors: _Optional[_Iterable[str]] = ..., credential: _Optional[bytes] = ..., late: _Optional[bool] = ..., part_digests: _Optional[_Iterable[bytes]] = ...) -> None: ...

class DeclareNotice(_message.Message):
    __slots__ = ("group_key", "config_hash", "data_hash", "bandwidth", "credential", "digest", "expecting", "paced", "expiration", "wire", "sparse", "also")
    GROUP_KEY_FIELD_NUMBER: _ClassVar[int]
    CONFIG_HASH_FIELD_NUMBER: _ClassVar[int]
    DATA_HASH_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTH_FIELD_NUMBER: _ClassVar[int]
    CREDENTIAL_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    EXPECTING_FIELD_NUMBER: _ClassVar[int]
    PACED_FIELD_NUMBER: _ClassVar[int]
    EXPIRATION_FIELD_NUMBER: _ClassVar[int]
    WIRE_FIELD_NUMBER: _ClassVar[int]
    SPARSE_FIELD_NUMBER: _ClassVar[int]
    ALSO_FIELD_NUMBER: _ClassVar[int]
    group_key: str
    config_hash: str
    data_hash: str
    bandwidth: float
    credential: bytes
    digest: str
    expecting: _containers.RepeatedScalarFieldContainer[str]
    paced: bool
    expiration: float
    wire: str
    sparse: bool
    also: _containers.RepeatedCompositeFieldContainer[DeclareNotice]
    def __init__(self, group_key: _Optional[str] = ..., config_hash: _Optional[str] = ..., data_hash: _Optional[str] = ..., bandwidth: _Optional[float] = ..., credential: _Optional[bytes] = ..., digest: _Optional[str] = ..., expecting: _Optional[_Iterable[str]] = ..., paced: _Optional[bool] = ..., expiration: _Optional[float] = ..., wire: _Optional[str] = ..., sparse: _Optional[bool] = ..., also: _Optional[_Iterable[_Union[DeclareNotice, _Mapping]]] = ...) -> None: ...

class DeclareAck(_message.Message):
    __slots__ = ("ok", "error", "also_read")
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ALSO_READ_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    error: str
    also_read: bool
    def __init__(self, ok: _Optional[bool] = ..., error: _Optional[str] = ..., also_read: _Optional[bool] = ...) -> None: ...

class LaneRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LaneOffer(_message.Message):
    __slots__ = ("addresses", "fingerprint", "token", "ttl")
    ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    TTL_FIELD_NUMBER: _ClassVar[int]
    addresses: _containers.RepeatedScalarFieldContainer[str]
    fingerprint: bytes
    token: bytes
    ttl: float
    def __init__(self, addresses: _Optional[_Iterable[str]] = ..., fingerprint: _Optional[bytes] = ..., token: _Optional[bytes] = ..., ttl: _Optional[float] = ...) -> None: ...
