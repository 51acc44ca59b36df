from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Mode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODE_UNSPECIFIED: _ClassVar[Mode]
    MODE_PATH: _ClassVar[Mode]
    MODE_STAGE: _ClassVar[Mode]
    MODE_ARCHIVE: _ClassVar[Mode]
    MODE_TRAINER: _ClassVar[Mode]
MODE_UNSPECIFIED: Mode
MODE_PATH: Mode
MODE_STAGE: Mode
MODE_ARCHIVE: Mode
MODE_TRAINER: Mode

class Capabilities(_message.Message):
    __slots__ = ("device", "memory_bytes", "tokens_per_s", "upload_bps", "download_bps", "multiaddrs")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    UPLOAD_BPS_FIELD_NUMBER: _ClassVar[int]
    DOWNLOAD_BPS_FIELD_NUMBER: _ClassVar[int]
    MULTIADDRS_FIELD_NUMBER: _ClassVar[int]
    device: str
    memory_bytes: int
    tokens_per_s: float
    upload_bps: float
    download_bps: float
    multiaddrs: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, device: _Optional[str] = ..., memory_bytes: _Optional[int] = ..., tokens_per_s: _Optional[float] = ..., upload_bps: _Optional[float] = ..., download_bps: _Optional[float] = ..., multiaddrs: _Optional[_Iterable[str]] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("token", "peer_id", "public_key", "capabilities", "manifest_hash", "archive", "role", "peer_version", "protocols")
    class ProtocolsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_HASH_FIELD_NUMBER: _ClassVar[int]
    ARCHIVE_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    PEER_VERSION_FIELD_NUMBER: _ClassVar[int]
    PROTOCOLS_FIELD_NUMBER: _ClassVar[int]
    token: str
    peer_id: str
    public_key: bytes
    capabilities: Capabilities
    manifest_hash: str
    archive: bool
    role: Mode
    peer_version: str
    protocols: _containers.ScalarMap[str, str]
    def __init__(self, token: _Optional[str] = ..., peer_id: _Optional[str] = ..., public_key: _Optional[bytes] = ..., capabilities: _Optional[_Union[Capabilities, _Mapping]] = ..., manifest_hash: _Optional[str] = ..., archive: _Optional[bool] = ..., role: _Optional[_Union[Mode, str]] = ..., peer_version: _Optional[str] = ..., protocols: _Optional[_Mapping[str, str]] = ...) -> None: ...

class RunSpec(_message.Message):
    __slots__ = ("run_config_json", "run_config_hash", "lattice_hash", "manifest_hash", "coordinator_public_key")
    RUN_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    RUN_CONFIG_HASH_FIELD_NUMBER: _ClassVar[int]
    LATTICE_HASH_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_HASH_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    run_config_json: str
    run_config_hash: str
    lattice_hash: str
    manifest_hash: str
    coordinator_public_key: bytes
    def __init__(self, run_config_json: _Optional[str] = ..., run_config_hash: _Optional[str] = ..., lattice_hash: _Optional[str] = ..., manifest_hash: _Optional[str] = ..., coordinator_public_key: _Optional[bytes] = ...) -> None: ...

class Assignment(_message.Message):
    __slots__ = ("mode", "path", "module_id", "module_ids", "inner_steps", "codec", "reason", "version")
    MODE_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    MODULE_ID_FIELD_NUMBER: _ClassVar[int]
    MODULE_IDS_FIELD_NUMBER: _ClassVar[int]
    INNER_STEPS_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    mode: Mode
    path: _containers.RepeatedScalarFieldContainer[int]
    module_id: str
    module_ids: _containers.RepeatedScalarFieldContainer[str]
    inner_steps: int
    codec: str
    reason: str
    version: int
    def __init__(self, mode: _Optional[_Union[Mode, str]] = ..., path: _Optional[_Iterable[int]] = ..., module_id: _Optional[str] = ..., module_ids: _Optional[_Iterable[str]] = ..., inner_steps: _Optional[int] = ..., codec: _Optional[str] = ..., reason: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class Lease(_message.Message):
    __slots__ = ("lease_id", "duration_s", "heartbeat_interval_s")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    DURATION_S_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    duration_s: float
    heartbeat_interval_s: float
    def __init__(self, lease_id: _Optional[str] = ..., duration_s: _Optional[float] = ..., heartbeat_interval_s: _Optional[float] = ...) -> None: ...

class JoinResponse(_message.Message):
    __slots__ = ("run_spec", "initial_peers", "lease", "assignment", "rejoined", "credential", "reachability", "reachable_addr", "observed_addr", "relays", "coordinator_version", "protocols")
    class ProtocolsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    RUN_SPEC_FIELD_NUMBER: _ClassVar[int]
    INITIAL_PEERS_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    ASSIGNMENT_FIELD_NUMBER: _ClassVar[int]
    REJOINED_FIELD_NUMBER: _ClassVar[int]
    CREDENTIAL_FIELD_NUMBER: _ClassVar[int]
    REACHABILITY_FIELD_NUMBER: _ClassVar[int]
    REACHABLE_ADDR_FIELD_NUMBER: _ClassVar[int]
    OBSERVED_ADDR_FIELD_NUMBER: _ClassVar[int]
    RELAYS_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_VERSION_FIELD_NUMBER: _ClassVar[int]
    PROTOCOLS_FIELD_NUMBER: _ClassVar[int]
    run_spec: RunSpec
    initial_peers: _containers.RepeatedScalarFieldContainer[str]
    lease: Lease
    assignment: Assignment
    rejoined: bool
    credential: bytes
    reachability: str
    reachable_addr: str
    observed_addr: str
    relays: _containers.RepeatedScalarFieldContainer[str]
    coordinator_version: str
    protocols: _containers.ScalarMap[str, str]
    def __init__(self, run_spec: _Optional[_Union[RunSpec, _Mapping]] = ..., initial_peers: _Optional[_Iterable[str]] = ..., lease: _Optional[_Union[Lease, _Mapping]] = ..., assignment: _Optional[_Union[Assignment, _Mapping]] = ..., rejoined: _Optional[bool] = ..., credential: _Optional[bytes] = ..., reachability: _Optional[str] = ..., reachable_addr: _Optional[str] = ..., observed_addr: _Optional[str] = ..., relays: _Optional[_Iterable[str]] = ..., coordinator_version: _Optional[str] = ..., protocols: _Optional[_Mapping[str, str]] = ...) -> None: ...

class ModuleProgress(_message.Message):
    __slots__ = ("module_id", "round", "tokens", "loss")
    MODULE_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    module_id: str
    round: int
    tokens: int
    loss: float
    def __init__(self, module_id: _Optional[str] = ..., round: _Optional[int] = ..., tokens: _Optional[int] = ..., loss: _Optional[float] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("lease_id", "peer_id", "progress", "assignment_version", "tokens_per_s", "bytes_sent", "bytes_received", "preempting", "seeds_data", "seeded_paths", "evaluations", "tokens_per_s_measured", "capacity_tokens_per_s", "peer_version", "measured_upload_bps", "measured_download_bps", "measured_exchange_overhead_s")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    ASSIGNMENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    PREEMPTING_FIELD_NUMBER: _ClassVar[int]
    SEEDS_DATA_FIELD_NUMBER: _ClassVar[int]
    SEEDED_PATHS_FIELD_NUMBER: _ClassVar[int]
    EVALUATIONS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_MEASURED_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    PEER_VERSION_FIELD_NUMBER: _ClassVar[int]
    MEASURED_UPLOAD_BPS_FIELD_NUMBER: _ClassVar[int]
    MEASURED_DOWNLOAD_BPS_FIELD_NUMBER: _ClassVar[int]
    MEASURED_EXCHANGE_OVERHEAD_S_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    peer_id: str
    progress: _containers.RepeatedCompositeFieldContainer[ModuleProgress]
    assignment_version: int
    tokens_per_s: float
    bytes_sent: int
    bytes_received: int
    preempting: bool
    seeds_data: bool
    seeded_paths: _containers.RepeatedScalarFieldContainer[str]
    evaluations: _containers.RepeatedCompositeFieldContainer[PathEvaluation]
    tokens_per_s_measured: bool
    capacity_tokens_per_s: float
    peer_version: str
    measured_upload_bps: float
    measured_download_bps: float
    measured_exchange_overhead_s: float
    def __init__(self, lease_id: _Optional[str] = ..., peer_id: _Optional[str] = ..., progress: _Optional[_Iterable[_Union[ModuleProgress, _Mapping]]] = ..., assignment_version: _Optional[int] = ..., tokens_per_s: _Optional[float] = ..., bytes_sent: _Optional[int] = ..., bytes_received: _Optional[int] = ..., preempting: _Optional[bool] = ..., seeds_data: _Optional[bool] = ..., seeded_paths: _Optional[_Iterable[str]] = ..., evaluations: _Optional[_Iterable[_Union[PathEvaluation, _Mapping]]] = ..., tokens_per_s_measured: _Optional[bool] = ..., capacity_tokens_per_s: _Optional[float] = ..., peer_version: _Optional[str] = ..., measured_upload_bps: _Optional[float] = ..., measured_download_bps: _Optional[float] = ..., measured_exchange_overhead_s: _Optional[float] = ...) -> None: ...

class PathEvaluation(_message.Message):
    __slots__ = ("path", "bpb", "round")
    PATH_FIELD_NUMBER: _ClassVar[int]
    BPB_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    path: _containers.RepeatedScalarFieldContainer[int]
    bpb: float
    round: int
    def __init__(self, path: _Optional[_Iterable[int]] = ..., bpb: _Optional[float] = ..., round: _Optional[int] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("lease_remaining_s", "assignment", "drain", "drain_reason", "credential", "required_version", "plans")
    LEASE_REMAINING_S_FIELD_NUMBER: _ClassVar[int]
    ASSIGNMENT_FIELD_NUMBER: _ClassVar[int]
    DRAIN_FIELD_NUMBER: _ClassVar[int]
    DRAIN_REASON_FIELD_NUMBER: _ClassVar[int]
    CREDENTIAL_FIELD_NUMBER: _ClassVar[int]
    REQUIRED_VERSION_FIELD_NUMBER: _ClassVar[int]
    PLANS_FIELD_NUMBER: _ClassVar[int]
    lease_remaining_s: float
    assignment: Assignment
    drain: bool
    drain_reason: str
    credential: bytes
    required_version: str
    plans: _containers.RepeatedCompositeFieldContainer[ModulePlan]
    def __init__(self, lease_remaining_s: _Optional[float] = ..., assignment: _Optional[_Union[Assignment, _Mapping]] = ..., drain: _Optional[bool] = ..., drain_reason: _Optional[str] = ..., credential: _Optional[bytes] = ..., required_version: _Optional[str] = ..., plans: _Optional[_Iterable[_Union[ModulePlan, _Mapping]]] = ...) -> None: ...

class ModulePlan(_message.Message):
    __slots__ = ("module_id", "inner_steps", "codec", "from_round", "reason", "overlap")
    MODULE_ID_FIELD_NUMBER: _ClassVar[int]
    INNER_STEPS_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    FROM_ROUND_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_FIELD_NUMBER: _ClassVar[int]
    module_id: str
    inner_steps: int
    codec: str
    from_round: int
    reason: str
    overlap: bool
    def __init__(self, module_id: _Optional[str] = ..., inner_steps: _Optional[int] = ..., codec: _Optional[str] = ..., from_round: _Optional[int] = ..., reason: _Optional[str] = ..., overlap: _Optional[bool] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("lease_id", "peer_id", "reason")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    peer_id: str
    reason: str
    def __init__(self, lease_id: _Optional[str] = ..., peer_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class LeaveResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ("token",)
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    token: str
    def __init__(self, token: _Optional[str] = ...) -> None: ...

class PeerStatus(_message.Message):
    __slots__ = ("peer_id", "device", "state", "tokens_per_s", "memory_bytes", "assignment", "last_seen_age_s", "tokens", "bytes_exchanged", "version")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    ASSIGNMENT_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_AGE_S_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    BYTES_EXCHANGED_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    device: str
    state: str
    tokens_per_s: float
    memory_bytes: int
    assignment: Assignment
    last_seen_age_s: float
    tokens: int
    bytes_exchanged: int
    version: str
    def __init__(self, peer_id: _Optional[str] = ..., device: _Optional[str] = ..., state: _Optional[str] = ..., tokens_per_s: _Optional[float] = ..., memory_bytes: _Optional[int] = ..., assignment: _Optional[_Union[Assignment, _Mapping]] = ..., last_seen_age_s: _Optional[float] = ..., tokens: _Optional[int] = ..., bytes_exchanged: _Optional[int] = ..., version: _Optional[str] = ...) -> None: ...

class ModuleStatus(_message.Message):
    __slots__ = ("module_id", "holders", "round", "tokens_per_s")
    MODULE_ID_FIELD_NUMBER: _ClassVar[int]
    HOLDERS_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    module_id: str
    holders: _containers.RepeatedScalarFieldContainer[str]
    round: int
    tokens_per_s: float
    def __init__(self, module_id: _Optional[str] = ..., holders: _Optional[_Iterable[str]] = ..., round: _Optional[int] = ..., tokens_per_s: _Optional[float] = ...) -> None: ...

class PathStatus(_message.Message):
    __slots__ = ("path", "peers", "tokens_per_s", "loss", "seeders")
    PATH_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    SEEDERS_FIELD_NUMBER: _ClassVar[int]
    path: _containers.RepeatedScalarFieldContainer[int]
    peers: _containers.RepeatedScalarFieldContainer[str]
    tokens_per_s: float
    loss: float
    seeders: int
    def __init__(self, path: _Optional[_Iterable[int]] = ..., peers: _Optional[_Iterable[str]] = ..., tokens_per_s: _Optional[float] = ..., loss: _Optional[float] = ..., seeders: _Optional[int] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("run_id", "run_config_hash", "peers", "modules", "paths", "total_tokens_per_s", "bytes_exchanged", "live_leases")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_CONFIG_HASH_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    MODULES_FIELD_NUMBER: _ClassVar[int]
    PATHS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    BYTES_EXCHANGED_FIELD_NUMBER: _ClassVar[int]
    LIVE_LEASES_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    run_config_hash: str
    peers: _containers.RepeatedCompositeFieldContainer[PeerStatus]
    modules: _containers.RepeatedCompositeFieldContainer[ModuleStatus]
    paths: _containers.RepeatedCompositeFieldContainer[PathStatus]
    total_tokens_per_s: float
    bytes_exchanged: int
    live_leases: int
    def __init__(self, run_id: _Optional[str] = ..., run_config_hash: _Optional[str] = ..., peers: _Optional[_Iterable[_Union[PeerStatus, _Mapping]]] = ..., modules: _Optional[_Iterable[_Union[ModuleStatus, _Mapping]]] = ..., paths: _Optional[_Iterable[_Union[PathStatus, _Mapping]]] = ..., total_tokens_per_s: _Optional[float] = ..., bytes_exchanged: _Optional[int] = ..., live_leases: _Optional[int] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("token", "peer_id", "reason")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    token: str
    peer_id: str
    reason: str
    def __init__(self, token: _Optional[str] = ..., peer_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("state",)
    STATE_FIELD_NUMBER: _ClassVar[int]
    state: str
    def __init__(self, state: _Optional[str] = ...) -> None: ...

class GetRunSpecRequest(_message.Message):
    __slots__ = ("token",)
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    token: str
    def __init__(self, token: _Optional[str] = ...) -> None: ...

class GetRunSpecResponse(_message.Message):
    __slots__ = ("run_spec", "initial_peers")
    RUN_SPEC_FIELD_NUMBER: _ClassVar[int]
    INITIAL_PEERS_FIELD_NUMBER: _ClassVar[int]
    run_spec: RunSpec
    initial_peers: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, run_spec: _Optional[_Union[RunSpec, _Mapping]] = ..., initial_peers: _Optional[_Iterable[str]] = ...) -> None: ...

class ReportPeerRequest(_message.Message):
    __slots__ = ("lease_id", "peer_id", "suspect_peer_id", "module_id", "round", "reason", "manifest_hash", "file")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    SUSPECT_PEER_ID_FIELD_NUMBER: _ClassVar[int]
    MODULE_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_HASH_FIELD_NUMBER: _ClassVar[int]
    FILE_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    peer_id: str
    suspect_peer_id: str
    module_id: str
    round: int
    reason: str
    manifest_hash: str
    file: str
    def __init__(self, lease_id: _Optional[str] = ..., peer_id: _Optional[str] = ..., suspect_peer_id: _Optional[str] = ..., module_id: _Optional[str] = ..., round: _Optional[int] = ..., reason: _Optional[str] = ..., manifest_hash: _Optional[str] = ..., file: _Optional[str] = ...) -> None: ...

class ReportPeerResponse(_message.Message):
    __slots__ = ("banned", "reason")
    BANNED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    banned: bool
    reason: str
    def __init__(self, banned: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class BanRequest(_message.Message):
    __slots__ = ("token", "peer_id", "reason")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    token: str
    peer_id: str
    reason: str
    def __init__(self, token: _Optional[str] = ..., peer_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class BanResponse(_message.Message):
    __slots__ = ("state",)
    STATE_FIELD_NUMBER: _ClassVar[int]
    state: str
    def __init__(self, state: _Optional[str] = ...) -> None: ...

class UnbanRequest(_message.Message):
    __slots__ = ("token", "peer_id")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    token: str
    peer_id: str
    def __init__(self, token: _Optional[str] = ..., peer_id: _Optional[str] = ...) -> None: ...

class UnbanResponse(_message.Message):
    __slots__ = ("state",)
    STATE_FIELD_NUMBER: _ClassVar[int]
    state: str
    def __init__(self, state: _Optional[str] = ...) -> None: ...

class HeartbeatStreamRequest(_message.Message):
    __slots__ = ("heartbeat",)
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    heartbeat: HeartbeatRequest
    def __init__(self, heartbeat: _Optional[_Union[HeartbeatRequest, _Mapping]] = ...) -> None: ...

class HeartbeatStreamResponse(_message.Message):
    __slots__ = ("heartbeat",)
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    heartbeat: HeartbeatResponse
    def __init__(self, heartbeat: _Optional[_Union[HeartbeatResponse, _Mapping]] = ...) -> None: ...

class ProbeUploadRequest(_message.Message):
    __slots__ = ("token", "total_bytes", "payload")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    token: str
    total_bytes: int
    payload: bytes
    def __init__(self, token: _Optional[str] = ..., total_bytes: _Optional[int] = ..., payload: _Optional[bytes] = ...) -> None: ...

class ProbeUploadResponse(_message.Message):
    __slots__ = ("received_bytes", "seconds")
    RECEIVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    received_bytes: int
    seconds: float
    def __init__(self, received_bytes: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class ProbeDownloadRequest(_message.Message):
    __slots__ = ("token", "total_bytes", "chunk_bytes")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    token: str
    total_bytes: int
    chunk_bytes: int
    def __init__(self, token: _Optional[str] = ..., total_bytes: _Optional[int] = ..., chunk_bytes: _Optional[int] = ...) -> None: ...

class ProbeDownloadResponse(_message.Message):
    __slots__ = ("payload",)
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    payload: bytes
    def __init__(self, payload: _Optional[bytes] = ...) -> None: ...
