from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class TensorSpec(_message.Message):
    __slots__ = ("name", "dtype", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class Structure(_message.Message):
    __slots__ = ("kind", "keys", "type_name", "children")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        LEAF: _ClassVar[Structure.Kind]
        DICT: _ClassVar[Structure.Kind]
        LIST: _ClassVar[Structure.Kind]
        TUPLE: _ClassVar[Structure.Kind]
        NAMEDTUPLE: _ClassVar[Structure.Kind]
        NONE: _ClassVar[Structure.Kind]
    LEAF: Structure.Kind
    DICT: Structure.Kind
    LIST: Structure.Kind
    TUPLE: Structure.Kind
    NAMEDTUPLE: Structure.Kind
    NONE: Structure.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    TYPE_NAME_FIELD_NUMBER: _ClassVar[int]
    CHILDREN_FIELD_NUMBER: _ClassVar[int]
    kind: Structure.Kind
    keys: _containers.RepeatedScalarFieldContainer[str]
    type_name: str
    children: _containers.RepeatedCompositeFieldContainer[Structure]
    def __init__(self, kind: _Optional[_Union[Structure.Kind, str]] = ..., keys: _Optional[_Iterable[str]] = ..., type_name: _Optional[str] = ..., children: _Optional[_Iterable[_Union[Structure, _Mapping]]] = ...) -> None: ...

class Signature(_message.Message):
    __slots__ = ("structure", "leaves")
    STRUCTURE_FIELD_NUMBER: _ClassVar[int]
    LEAVES_FIELD_NUMBER: _ClassVar[int]
    structure: Structure
    leaves: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    def __init__(self, structure: _Optional[_Union[Structure, _Mapping]] = ..., leaves: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ...) -> None: ...

class PrioritizedOptions(_message.Message):
    __slots__ = ("priority_exponent",)
    PRIORITY_EXPONENT_FIELD_NUMBER: _ClassVar[int]
    priority_exponent: float
    def __init__(self, priority_exponent: _Optional[float] = ...) -> None: ...

class HeapOptions(_message.Message):
    __slots__ = ("min_heap",)
    MIN_HEAP_FIELD_NUMBER: _ClassVar[int]
    min_heap: bool
    def __init__(self, min_heap: _Optional[bool] = ...) -> None: ...

class SelectorOptions(_message.Message):
    __slots__ = ("fifo", "uniform", "prioritized", "heap", "lifo", "is_deterministic")
    FIFO_FIELD_NUMBER: _ClassVar[int]
    UNIFORM_FIELD_NUMBER: _ClassVar[int]
    PRIORITIZED_FIELD_NUMBER: _ClassVar[int]
    HEAP_FIELD_NUMBER: _ClassVar[int]
    LIFO_FIELD_NUMBER: _ClassVar[int]
    IS_DETERMINISTIC_FIELD_NUMBER: _ClassVar[int]
    fifo: bool
    uniform: bool
    prioritized: PrioritizedOptions
    heap: HeapOptions
    lifo: bool
    is_deterministic: bool
    def __init__(self, fifo: _Optional[bool] = ..., uniform: _Optional[bool] = ..., prioritized: _Optional[_Union[PrioritizedOptions, _Mapping]] = ..., heap: _Optional[_Union[HeapOptions, _Mapping]] = ..., lifo: _Optional[bool] = ..., is_deterministic: _Optional[bool] = ...) -> None: ...

class RateLimiterOptions(_message.Message):
    __slots__ = ("samples_per_insert", "min_size_to_sample", "min_diff", "max_diff")
    SAMPLES_PER_INSERT_FIELD_NUMBER: _ClassVar[int]
    MIN_SIZE_TO_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    MIN_DIFF_FIELD_NUMBER: _ClassVar[int]
    MAX_DIFF_FIELD_NUMBER: _ClassVar[int]
    samples_per_insert: float
    min_size_to_sample: int
    min_diff: float
    max_diff: float
    def __init__(self, samples_per_insert: _Optional[float] = ..., min_size_to_sample: _Optional[int] = ..., min_diff: _Optional[float] = ..., max_diff: _Optional[float] = ...) -> None: ...

class TableConfig(_message.Message):
    __slots__ = ("name", "sampler", "remover", "max_size", "rate_limiter", "max_times_sampled", "signature", "initial_max_length", "gpu_mirror")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SAMPLER_FIELD_NUMBER: _ClassVar[int]
    REMOVER_FIELD_NUMBER: _ClassVar[int]
    MAX_SIZE_FIELD_NUMBER: _ClassVar[int]
    RATE_LIMITER_FIELD_NUMBER: _ClassVar[int]
    MAX_TIMES_SAMPLED_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    INITIAL_MAX_LENGTH_FIELD_NUMBER: _ClassVar[int]
    GPU_MIRROR_FIELD_NUMBER: _ClassVar[int]
    name: str
    sampler: SelectorOptions
    remover: SelectorOptions
    max_size: int
    rate_limiter: RateLimiterOptions
    max_times_sampled: int
    signature: Signature
    initial_max_length: int
    gpu_mirror: GpuMirror
    def __init__(self, name: _Optional[str] = ..., sampler: _Optional[_Union[SelectorOptions, _Mapping]] = ..., remover: _Optional[_Union[SelectorOptions, _Mapping]] = ..., max_size: _Optional[int] = ..., rate_limiter: _Optional[_Union[RateLimiterOptions, _Mapping]] = ..., max_times_sampled: _Optional[int] = ..., signature: _Optional[_Union[Signature, _Mapping]] = ..., initial_max_length: _Optional[int] = ..., gpu_mirror: _Optional[_Union[GpuMirror, _Mapping]] = ...) -> None: ...

class GpuMirror(_message.Message):
    __slots__ = ("device", "bytes", "backend")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    device: int
    bytes: int
    backend: str
    def __init__(self, device: _Optional[int] = ..., bytes: _Optional[int] = ..., backend: _Optional[str] = ...) -> None: ...

class ServerConfig(_message.Message):
    __slots__ = ("bind_address", "port", "tables", "checkpoint_dir", "shm_dir", "instance_name", "fallback_checkpoint_path")
    BIND_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_DIR_FIELD_NUMBER: _ClassVar[int]
    SHM_DIR_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_NAME_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_CHECKPOINT_PATH_FIELD_NUMBER: _ClassVar[int]
    bind_address: str
    port: int
    tables: _containers.RepeatedCompositeFieldContainer[TableConfig]
    checkpoint_dir: str
    shm_dir: str
    instance_name: str
    fallback_checkpoint_path: str
    def __init__(self, bind_address: _Optional[str] = ..., port: _Optional[int] = ..., tables: _Optional[_Iterable[_Union[TableConfig, _Mapping]]] = ..., checkpoint_dir: _Optional[str] = ..., shm_dir: _Optional[str] = ..., instance_name: _Optional[str] = ..., fallback_checkpoint_path: _Optional[str] = ...) -> None: ...

class RateLimiterCallStats(_message.Message):
    __slots__ = ("completed", "limited", "completed_wait_time_s", "pending_wait_time_s")
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    LIMITED_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_WAIT_TIME_S_FIELD_NUMBER: _ClassVar[int]
    PENDING_WAIT_TIME_S_FIELD_NUMBER: _ClassVar[int]
    completed: int
    limited: int
    completed_wait_time_s: float
    pending_wait_time_s: float
    def __init__(self, completed: _Optional[int] = ..., limited: _Optional[int] = ..., completed_wait_time_s: _Optional[float] = ..., pending_wait_time_s: _Optional[float] = ...) -> None: ...

class RateLimiterInfo(_message.Message):
    __slots__ = ("samples_per_insert", "min_diff", "max_diff", "min_size_to_sample", "insert_stats", "sample_stats", "num_deletes")
    SAMPLES_PER_INSERT_FIELD_NUMBER: _ClassVar[int]
    MIN_DIFF_FIELD_NUMBER: _ClassVar[int]
    MAX_DIFF_FIELD_NUMBER: _ClassVar[int]
    MIN_SIZE_TO_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    INSERT_STATS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_STATS_FIELD_NUMBER: _ClassVar[int]
    NUM_DELETES_FIELD_NUMBER: _ClassVar[int]
    samples_per_insert: float
    min_diff: float
    max_diff: float
    min_size_to_sample: int
    insert_stats: RateLimiterCallStats
    sample_stats: RateLimiterCallStats
    num_deletes: int
    def __init__(self, samples_per_insert: _Optional[float] = ..., min_diff: _Optional[float] = ..., max_diff: _Optional[float] = ..., min_size_to_sample: _Optional[int] = ..., insert_stats: _Optional[_Union[RateLimiterCallStats, _Mapping]] = ..., sample_stats: _Optional[_Union[RateLimiterCallStats, _Mapping]] = ..., num_deletes: _Optional[int] = ...) -> None: ...

class TableInfo(_message.Message):
    __slots__ = ("name", "sampler_options", "remover_options", "max_size", "max_times_sampled", "rate_limiter_info", "signature", "current_size", "num_episodes", "num_deleted_episodes", "num_unique_samples", "table_worker_time_ms", "selection_state", "gpu_mirror")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SAMPLER_OPTIONS_FIELD_NUMBER: _ClassVar[int]
    REMOVER_OPTIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_TIMES_SAMPLED_FIELD_NUMBER: _ClassVar[int]
    RATE_LIMITER_INFO_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    CURRENT_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_EPISODES_FIELD_NUMBER: _ClassVar[int]
    NUM_DELETED_EPISODES_FIELD_NUMBER: _ClassVar[int]
    NUM_UNIQUE_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    TABLE_WORKER_TIME_MS_FIELD_NUMBER: _ClassVar[int]
    SELECTION_STATE_FIELD_NUMBER: _ClassVar[int]
    GPU_MIRROR_FIELD_NUMBER: _ClassVar[int]
    name: str
    sampler_options: SelectorOptions
    remover_options: SelectorOptions
    max_size: int
    max_times_sampled: int
    rate_limiter_info: RateLimiterInfo
    signature: Signature
    current_size: int
    num_episodes: int
    num_deleted_episodes: int
    num_unique_samples: int
    table_worker_time_ms: float
    selection_state: ShardSelectionState
    gpu_mirror: GpuMirrorInfo
    def __init__(self, name: _Optional[str] = ..., sampler_options: _Optional[_Union[SelectorOptions, _Mapping]] = ..., remover_options: _Optional[_Union[SelectorOptions, _Mapping]] = ..., max_size: _Optional[int] = ..., max_times_sampled: _Optional[int] = ..., rate_limiter_info: _Optional[_Union[RateLimiterInfo, _Mapping]] = ..., signature: _Optional[_Union[Signature, _Mapping]] = ..., current_size: _Optional[int] = ..., num_episodes: _Optional[int] = ..., num_deleted_episodes: _Optional[int] = ..., num_unique_samples: _Optional[int] = ..., table_worker_time_ms: _Optional[float] = ..., selection_state: _Optional[_Union[ShardSelectionState, _Mapping]] = ..., gpu_mirror: _Optional[_Union[GpuMirrorInfo, _Mapping]] = ...) -> None: ...

class GpuMirrorInfo(_message.Message):
    __slots__ = ("device", "budget_bytes", "rows", "mirrored_items", "copied_items")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    MIRRORED_ITEMS_FIELD_NUMBER: _ClassVar[int]
    COPIED_ITEMS_FIELD_NUMBER: _ClassVar[int]
    device: int
    budget_bytes: int
    rows: int
    mirrored_items: int
    copied_items: int
    def __init__(self, device: _Optional[int] = ..., budget_bytes: _Optional[int] = ..., rows: _Optional[int] = ..., mirrored_items: _Optional[int] = ..., copied_items: _Optional[int] = ...) -> None: ...

class ShardSelectionState(_message.Message):
    __slots__ = ("priority_mass", "has_head", "head_priority")
    PRIORITY_MASS_FIELD_NUMBER: _ClassVar[int]
    HAS_HEAD_FIELD_NUMBER: _ClassVar[int]
    HEAD_PRIORITY_FIELD_NUMBER: _ClassVar[int]
    priority_mass: float
    has_head: bool
    head_priority: float
    def __init__(self, priority_mass: _Optional[float] = ..., has_head: _Optional[bool] = ..., head_priority: _Optional[float] = ...) -> None: ...

class ChunkData(_message.Message):
    __slots__ = ("chunk_key", "data", "episode_id", "episode_step")
    CHUNK_KEY_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    EPISODE_STEP_FIELD_NUMBER: _ClassVar[int]
    chunk_key: int
    data: Tensor
    episode_id: int
    episode_step: int
    def __init__(self, chunk_key: _Optional[int] = ..., data: _Optional[_Union[Tensor, _Mapping]] = ..., episode_id: _Optional[int] = ..., episode_step: _Optional[int] = ...) -> None: ...

class ColumnSlice(_message.Message):
    __slots__ = ("chunk_key", "offset", "length")
    CHUNK_KEY_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    chunk_key: int
    offset: int
    length: int
    def __init__(self, chunk_key: _Optional[int] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class ItemColumn(_message.Message):
    __slots__ = ("slices", "squeeze")
    SLICES_FIELD_NUMBER: _ClassVar[int]
    SQUEEZE_FIELD_NUMBER: _ClassVar[int]
    slices: _containers.RepeatedCompositeFieldContainer[ColumnSlice]
    squeeze: bool
    def __init__(self, slices: _Optional[_Iterable[_Union[ColumnSlice, _Mapping]]] = ..., squeeze: _Optional[bool] = ...) -> None: ...

class PrioritizedItem(_message.Message):
    __slots__ = ("key", "table", "priority", "structure", "columns", "resend")
    KEY_FIELD_NUMBER: _ClassVar[int]
    TABLE_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    STRUCTURE_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    RESEND_FIELD_NUMBER: _ClassVar[int]
    key: int
    table: str
    priority: float
    structure: Structure
    columns: _containers.RepeatedCompositeFieldContainer[ItemColumn]
    resend: bool
    def __init__(self, key: _Optional[int] = ..., table: _Optional[str] = ..., priority: _Optional[float] = ..., structure: _Optional[_Union[Structure, _Mapping]] = ..., columns: _Optional[_Iterable[_Union[ItemColumn, _Mapping]]] = ..., resend: _Optional[bool] = ...) -> None: ...

class InsertStreamRequest(_message.Message):
    __slots__ = ("chunks", "items", "release_chunk_keys")
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    RELEASE_CHUNK_KEYS_FIELD_NUMBER: _ClassVar[int]
    chunks: _containers.RepeatedCompositeFieldContainer[ChunkData]
    items: _containers.RepeatedCompositeFieldContainer[PrioritizedItem]
    release_chunk_keys: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, chunks: _Optional[_Iterable[_Union[ChunkData, _Mapping]]] = ..., items: _Optional[_Iterable[_Union[PrioritizedItem, _Mapping]]] = ..., release_chunk_keys: _Optional[_Iterable[int]] = ...) -> None: ...

class InsertStreamResponse(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, keys: _Optional[_Iterable[int]] = ...) -> None: ...

class SampleInfo(_message.Message):
    __slots__ = ("key", "probability", "table_size", "priority", "times_sampled")
    KEY_FIELD_NUMBER: _ClassVar[int]
    PROBABILITY_FIELD_NUMBER: _ClassVar[int]
    TABLE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TIMES_SAMPLED_FIELD_NUMBER: _ClassVar[int]
    key: int
    probability: float
    table_size: int
    priority: float
    times_sampled: int
    def __init__(self, key: _Optional[int] = ..., probability: _Optional[float] = ..., table_size: _Optional[int] = ..., priority: _Optional[float] = ..., times_sampled: _Optional[int] = ...) -> None: ...

class SampleRequest(_message.Message):
    __slots__ = ("table", "num_samples", "timeout_ms", "max_items_per_message", "columns")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_ITEMS_PER_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    table: str
    num_samples: int
    timeout_ms: int
    max_items_per_message: int
    columns: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, table: _Optional[str] = ..., num_samples: _Optional[int] = ..., timeout_ms: _Optional[int] = ..., max_items_per_message: _Optional[int] = ..., columns: _Optional[_Iterable[int]] = ...) -> None: ...

class SampleBatch(_message.Message):
    __slots__ = ("info", "columns", "lengths", "structure", "squeeze")
    INFO_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURE_FIELD_NUMBER: _ClassVar[int]
    SQUEEZE_FIELD_NUMBER: _ClassVar[int]
    info: _containers.RepeatedCompositeFieldContainer[SampleInfo]
    columns: _containers.RepeatedCompositeFieldContainer[Tensor]
    lengths: _containers.RepeatedScalarFieldContainer[int]
    structure: Structure
    squeeze: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, info: _Optional[_Iterable[_Union[SampleInfo, _Mapping]]] = ..., columns: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., lengths: _Optional[_Iterable[int]] = ..., structure: _Optional[_Union[Structure, _Mapping]] = ..., squeeze: _Optional[_Iterable[bool]] = ...) -> None: ...

class SampleResponse(_message.Message):
    __slots__ = ("batch",)
    BATCH_FIELD_NUMBER: _ClassVar[int]
    batch: SampleBatch
    def __init__(self, batch: _Optional[_Union[SampleBatch, _Mapping]] = ...) -> None: ...

class KeyWithPriority(_message.Message):
    __slots__ = ("key", "priority")
    KEY_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    key: int
    priority: float
    def __init__(self, key: _Optional[int] = ..., priority: _Optional[float] = ...) -> None: ...

class MutatePrioritiesRequest(_message.Message):
    __slots__ = ("table", "updates", "delete_keys")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    UPDATES_FIELD_NUMBER: _ClassVar[int]
    DELETE_KEYS_FIELD_NUMBER: _ClassVar[int]
    table: str
    updates: _containers.RepeatedCompositeFieldContainer[KeyWithPriority]
    delete_keys: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, table: _Optional[str] = ..., updates: _Optional[_Iterable[_Union[KeyWithPriority, _Mapping]]] = ..., delete_keys: _Optional[_Iterable[int]] = ...) -> None: ...

class MutatePrioritiesResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResetRequest(_message.Message):
    __slots__ = ("table",)
    TABLE_FIELD_NUMBER: _ClassVar[int]
    table: str
    def __init__(self, table: _Optional[str] = ...) -> None: ...

class ResetResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RateLimiterCheckRequest(_message.Message):
    __slots__ = ("table", "num_samples", "num_inserts")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    NUM_INSERTS_FIELD_NUMBER: _ClassVar[int]
    table: str
    num_samples: int
    num_inserts: int
    def __init__(self, table: _Optional[str] = ..., num_samples: _Optional[int] = ..., num_inserts: _Optional[int] = ...) -> None: ...

class RateLimiterCheckResponse(_message.Message):
    __slots__ = ("can_sample", "can_insert")
    CAN_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    CAN_INSERT_FIELD_NUMBER: _ClassVar[int]
    can_sample: bool
    can_insert: bool
    def __init__(self, can_sample: _Optional[bool] = ..., can_insert: _Optional[bool] = ...) -> None: ...

class ServerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServerInfoResponse(_message.Message):
    __slots__ = ("table_info", "version", "host_id", "ingest_ports")
    TABLE_INFO_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    INGEST_PORTS_FIELD_NUMBER: _ClassVar[int]
    table_info: _containers.RepeatedCompositeFieldContainer[TableInfo]
    version: str
    host_id: str
    ingest_ports: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, table_info: _Optional[_Iterable[_Union[TableInfo, _Mapping]]] = ..., version: _Optional[str] = ..., host_id: _Optional[str] = ..., ingest_ports: _Optional[_Iterable[int]] = ...) -> None: ...

class CheckpointRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CheckpointResponse(_message.Message):
    __slots__ = ("path",)
    PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    def __init__(self, path: _Optional[str] = ...) -> None: ...

class RdmaEndpoint(_message.Message):
    __slots__ = ("device", "port", "link_layer", "lid", "gid", "gid_index", "mtu", "qp_nums", "psns", "max_rd_atomic", "max_msg_size")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    LINK_LAYER_FIELD_NUMBER: _ClassVar[int]
    LID_FIELD_NUMBER: _ClassVar[int]
    GID_FIELD_NUMBER: _ClassVar[int]
    GID_INDEX_FIELD_NUMBER: _ClassVar[int]
    MTU_FIELD_NUMBER: _ClassVar[int]
    QP_NUMS_FIELD_NUMBER: _ClassVar[int]
    PSNS_FIELD_NUMBER: _ClassVar[int]
    MAX_RD_ATOMIC_FIELD_NUMBER: _ClassVar[int]
    MAX_MSG_SIZE_FIELD_NUMBER: _ClassVar[int]
    device: str
    port: int
    link_layer: str
    lid: int
    gid: bytes
    gid_index: int
    mtu: int
    qp_nums: _containers.RepeatedScalarFieldContainer[int]
    psns: _containers.RepeatedScalarFieldContainer[int]
    max_rd_atomic: int
    max_msg_size: int
    def __init__(self, device: _Optional[str] = ..., port: _Optional[int] = ..., link_layer: _Optional[str] = ..., lid: _Optional[int] = ..., gid: _Optional[bytes] = ..., gid_index: _Optional[int] = ..., mtu: _Optional[int] = ..., qp_nums: _Optional[_Iterable[int]] = ..., psns: _Optional[_Iterable[int]] = ..., max_rd_atomic: _Optional[int] = ..., max_msg_size: _Optional[int] = ...) -> None: ...

class DataPlaneOffer(_message.Message):
    __slots__ = ("shm", "host_id", "rdma", "inline", "device", "stream", "nixl")
    SHM_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    RDMA_FIELD_NUMBER: _ClassVar[int]
    INLINE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    NIXL_FIELD_NUMBER: _ClassVar[int]
    shm: bool
    host_id: str
    rdma: RdmaEndpoint
    inline: bool
    device: bool
    stream: bool
    nixl: bool
    def __init__(self, shm: _Optional[bool] = ..., host_id: _Optional[str] = ..., rdma: _Optional[_Union[RdmaEndpoint, _Mapping]] = ..., inline: _Optional[bool] = ..., device: _Optional[bool] = ..., stream: _Optional[bool] = ..., nixl: _Optional[bool] = ...) -> None: ...

class StreamEndpoint(_message.Message):
    __slots__ = ("host", "port", "credential", "connections", "tls")
    HOST_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    CREDENTIAL_FIELD_NUMBER: _ClassVar[int]
    CONNECTIONS_FIELD_NUMBER: _ClassVar[int]
    TLS_FIELD_NUMBER: _ClassVar[int]
    host: str
    port: int
    credential: bytes
    connections: int
    tls: bool
    def __init__(self, host: _Optional[str] = ..., port: _Optional[int] = ..., credential: _Optional[bytes] = ..., connections: _Optional[int] = ..., tls: _Optional[bool] = ...) -> None: ...

class ColumnLayout(_message.Message):
    __slots__ = ("name", "dtype", "shape", "offset", "slot_stride", "step_bytes", "max_length", "squeeze")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SLOT_STRIDE_FIELD_NUMBER: _ClassVar[int]
    STEP_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_LENGTH_FIELD_NUMBER: _ClassVar[int]
    SQUEEZE_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    slot_stride: int
    step_bytes: int
    max_length: int
    squeeze: bool
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., slot_stride: _Optional[int] = ..., step_bytes: _Optional[int] = ..., max_length: _Optional[int] = ..., squeeze: _Optional[bool] = ...) -> None: ...

class TableLayout(_message.Message):
    __slots__ = ("table", "segment", "segment_size", "capacity", "version", "columns", "structure")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_SIZE_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURE_FIELD_NUMBER: _ClassVar[int]
    table: str
    segment: str
    segment_size: int
    capacity: int
    version: int
    columns: _containers.RepeatedCompositeFieldContainer[ColumnLayout]
    structure: Structure
    def __init__(self, table: _Optional[str] = ..., segment: _Optional[str] = ..., segment_size: _Optional[int] = ..., capacity: _Optional[int] = ..., version: _Optional[int] = ..., columns: _Optional[_Iterable[_Union[ColumnLayout, _Mapping]]] = ..., structure: _Optional[_Union[Structure, _Mapping]] = ...) -> None: ...

class RdmaRegion(_message.Message):
    __slots__ = ("addr", "rkey", "length")
    ADDR_FIELD_NUMBER: _ClassVar[int]
    RKEY_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    addr: int
    rkey: int
    length: int
    def __init__(self, addr: _Optional[int] = ..., rkey: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class NixlRegion(_message.Message):
    __slots__ = ("agent_metadata", "agent", "addr", "length", "device_id", "mem_type")
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    AGENT_FIELD_NUMBER: _ClassVar[int]
    ADDR_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    MEM_TYPE_FIELD_NUMBER: _ClassVar[int]
    agent_metadata: bytes
    agent: str
    addr: int
    length: int
    device_id: int
    mem_type: str
    def __init__(self, agent_metadata: _Optional[bytes] = ..., agent: _Optional[str] = ..., addr: _Optional[int] = ..., length: _Optional[int] = ..., device_id: _Optional[int] = ..., mem_type: _Optional[str] = ...) -> None: ...

class OpenDataPlaneRequest(_message.Message):
    __slots__ = ("table", "offer", "group")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    OFFER_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    table: str
    offer: DataPlaneOffer
    group: SelectionGroup
    def __init__(self, table: _Optional[str] = ..., offer: _Optional[_Union[DataPlaneOffer, _Mapping]] = ..., group: _Optional[_Union[SelectionGroup, _Mapping]] = ...) -> None: ...

class SelectionGroup(_message.Message):
    __slots__ = ("group_id", "world_size", "rank", "seed")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    world_size: int
    rank: int
    seed: int
    def __init__(self, group_id: _Optional[str] = ..., world_size: _Optional[int] = ..., rank: _Optional[int] = ..., seed: _Optional[int] = ...) -> None: ...

class OpenDataPlaneResponse(_message.Message):
    __slots__ = ("session_id", "kind", "layout", "rdma", "region", "lease_timeout_ms", "session_idle_timeout_ms", "stream", "nixl", "device_tier")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    RDMA_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    LEASE_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    SESSION_IDLE_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    NIXL_FIELD_NUMBER: _ClassVar[int]
    DEVICE_TIER_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    kind: str
    layout: TableLayout
    rdma: RdmaEndpoint
    region: RdmaRegion
    lease_timeout_ms: int
    session_idle_timeout_ms: int
    stream: StreamEndpoint
    nixl: NixlRegion
    device_tier: DeviceTier
    def __init__(self, session_id: _Optional[str] = ..., kind: _Optional[str] = ..., layout: _Optional[_Union[TableLayout, _Mapping]] = ..., rdma: _Optional[_Union[RdmaEndpoint, _Mapping]] = ..., region: _Optional[_Union[RdmaRegion, _Mapping]] = ..., lease_timeout_ms: _Optional[int] = ..., session_idle_timeout_ms: _Optional[int] = ..., stream: _Optional[_Union[StreamEndpoint, _Mapping]] = ..., nixl: _Optional[_Union[NixlRegion, _Mapping]] = ..., device_tier: _Optional[_Union[DeviceTier, _Mapping]] = ...) -> None: ...

class DeviceTier(_message.Message):
    __slots__ = ("device", "ipc_handle", "nbytes", "host_path")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    HOST_PATH_FIELD_NUMBER: _ClassVar[int]
    device: int
    ipc_handle: bytes
    nbytes: int
    host_path: str
    def __init__(self, device: _Optional[int] = ..., ipc_handle: _Optional[bytes] = ..., nbytes: _Optional[int] = ..., host_path: _Optional[str] = ...) -> None: ...

class ItemRef(_message.Message):
    __slots__ = ("slot", "generation", "lengths")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    slot: int
    generation: int
    lengths: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, slot: _Optional[int] = ..., generation: _Optional[int] = ..., lengths: _Optional[_Iterable[int]] = ...) -> None: ...

class SelectRequest(_message.Message):
    __slots__ = ("session_id", "num_samples", "timeout_ms", "packed", "release_lease_ids", "num_batches", "group_step", "group_picks", "group_offset")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    PACKED_FIELD_NUMBER: _ClassVar[int]
    RELEASE_LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_BATCHES_FIELD_NUMBER: _ClassVar[int]
    GROUP_STEP_FIELD_NUMBER: _ClassVar[int]
    GROUP_PICKS_FIELD_NUMBER: _ClassVar[int]
    GROUP_OFFSET_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    num_samples: int
    timeout_ms: int
    packed: bool
    release_lease_ids: _containers.RepeatedScalarFieldContainer[int]
    num_batches: int
    group_step: int
    group_picks: int
    group_offset: int
    def __init__(self, session_id: _Optional[str] = ..., num_samples: _Optional[int] = ..., timeout_ms: _Optional[int] = ..., packed: _Optional[bool] = ..., release_lease_ids: _Optional[_Iterable[int]] = ..., num_batches: _Optional[int] = ..., group_step: _Optional[int] = ..., group_picks: _Optional[int] = ..., group_offset: _Optional[int] = ...) -> None: ...

class SelectResponse(_message.Message):
    __slots__ = ("refs", "info", "layout_version", "lease_id", "layout", "region", "slots", "generations", "lengths", "keys", "probabilities", "table_sizes", "priorities", "times_sampled", "stale_lease_ids", "nixl", "batch_lease_ids", "batch_sizes", "mirror_rows")
    REFS_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_VERSION_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PROBABILITIES_FIELD_NUMBER: _ClassVar[int]
    TABLE_SIZES_FIELD_NUMBER: _ClassVar[int]
    PRIORITIES_FIELD_NUMBER: _ClassVar[int]
    TIMES_SAMPLED_FIELD_NUMBER: _ClassVar[int]
    STALE_LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    NIXL_FIELD_NUMBER: _ClassVar[int]
    BATCH_LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZES_FIELD_NUMBER: _ClassVar[int]
    MIRROR_ROWS_FIELD_NUMBER: _ClassVar[int]
    refs: _containers.RepeatedCompositeFieldContainer[ItemRef]
    info: _containers.RepeatedCompositeFieldContainer[SampleInfo]
    layout_version: int
    lease_id: int
    layout: TableLayout
    region: RdmaRegion
    slots: Tensor
    generations: Tensor
    lengths: Tensor
    keys: Tensor
    probabilities: Tensor
    table_sizes: Tensor
    priorities: Tensor
    times_sampled: Tensor
    stale_lease_ids: _containers.RepeatedScalarFieldContainer[int]
    nixl: NixlRegion
    batch_lease_ids: _containers.RepeatedScalarFieldContainer[int]
    batch_sizes: _containers.RepeatedScalarFieldContainer[int]
    mirror_rows: Tensor
    def __init__(self, refs: _Optional[_Iterable[_Union[ItemRef, _Mapping]]] = ..., info: _Optional[_Iterable[_Union[SampleInfo, _Mapping]]] = ..., layout_version: _Optional[int] = ..., lease_id: _Optional[int] = ..., layout: _Optional[_Union[TableLayout, _Mapping]] = ..., region: _Optional[_Union[RdmaRegion, _Mapping]] = ..., slots: _Optional[_Union[Tensor, _Mapping]] = ..., generations: _Optional[_Union[Tensor, _Mapping]] = ..., lengths: _Optional[_Union[Tensor, _Mapping]] = ..., keys: _Optional[_Union[Tensor, _Mapping]] = ..., probabilities: _Optional[_Union[Tensor, _Mapping]] = ..., table_sizes: _Optional[_Union[Tensor, _Mapping]] = ..., priorities: _Optional[_Union[Tensor, _Mapping]] = ..., times_sampled: _Optional[_Union[Tensor, _Mapping]] = ..., stale_lease_ids: _Optional[_Iterable[int]] = ..., nixl: _Optional[_Union[NixlRegion, _Mapping]] = ..., batch_lease_ids: _Optional[_Iterable[int]] = ..., batch_sizes: _Optional[_Iterable[int]] = ..., mirror_rows: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("session_id", "lease_ids")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    lease_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[str] = ..., lease_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("stale_lease_ids",)
    STALE_LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    stale_lease_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, stale_lease_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class CloseDataPlaneRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CloseDataPlaneResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InsertPlaneOpen(_message.Message):
    __slots__ = ("host_id", "pid", "stream")
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    host_id: str
    pid: int
    stream: bool
    def __init__(self, host_id: _Optional[str] = ..., pid: _Optional[int] = ..., stream: _Optional[bool] = ...) -> None: ...

class InsertPlaneOpened(_message.Message):
    __slots__ = ("reservation_timeout_ms", "max_reservations", "stream")
    RESERVATION_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_RESERVATIONS_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    reservation_timeout_ms: int
    max_reservations: int
    stream: StreamEndpoint
    def __init__(self, reservation_timeout_ms: _Optional[int] = ..., max_reservations: _Optional[int] = ..., stream: _Optional[_Union[StreamEndpoint, _Mapping]] = ...) -> None: ...

class ReserveSlots(_message.Message):
    __slots__ = ("table", "count")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    table: str
    count: int
    def __init__(self, table: _Optional[str] = ..., count: _Optional[int] = ...) -> None: ...

class SlotsReserved(_message.Message):
    __slots__ = ("table", "slots", "layout_version", "layout")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_VERSION_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    table: str
    slots: _containers.RepeatedScalarFieldContainer[int]
    layout_version: int
    layout: TableLayout
    def __init__(self, table: _Optional[str] = ..., slots: _Optional[_Iterable[int]] = ..., layout_version: _Optional[int] = ..., layout: _Optional[_Union[TableLayout, _Mapping]] = ...) -> None: ...

class CommitItem(_message.Message):
    __slots__ = ("key", "priority", "slot", "lengths", "episode_ids")
    KEY_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    EPISODE_IDS_FIELD_NUMBER: _ClassVar[int]
    key: int
    priority: float
    slot: int
    lengths: _containers.RepeatedScalarFieldContainer[int]
    episode_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, key: _Optional[int] = ..., priority: _Optional[float] = ..., slot: _Optional[int] = ..., lengths: _Optional[_Iterable[int]] = ..., episode_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class CommitSlots(_message.Message):
    __slots__ = ("table", "layout_version", "items")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_VERSION_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    table: str
    layout_version: int
    items: _containers.RepeatedCompositeFieldContainer[CommitItem]
    def __init__(self, table: _Optional[str] = ..., layout_version: _Optional[int] = ..., items: _Optional[_Iterable[_Union[CommitItem, _Mapping]]] = ...) -> None: ...

class SlotsCommitted(_message.Message):
    __slots__ = ("table", "keys", "layout")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    table: str
    keys: _containers.RepeatedScalarFieldContainer[int]
    layout: TableLayout
    def __init__(self, table: _Optional[str] = ..., keys: _Optional[_Iterable[int]] = ..., layout: _Optional[_Union[TableLayout, _Mapping]] = ...) -> None: ...

class CancelSlots(_message.Message):
    __slots__ = ("table", "slots")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    table: str
    slots: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, table: _Optional[str] = ..., slots: _Optional[_Iterable[int]] = ...) -> None: ...

class InsertPlaneRequest(_message.Message):
    __slots__ = ("request_id", "open", "reserve", "commit", "cancel")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OPEN_FIELD_NUMBER: _ClassVar[int]
    RESERVE_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    open: InsertPlaneOpen
    reserve: ReserveSlots
    commit: CommitSlots
    cancel: CancelSlots
    def __init__(self, request_id: _Optional[int] = ..., open: _Optional[_Union[InsertPlaneOpen, _Mapping]] = ..., reserve: _Optional[_Union[ReserveSlots, _Mapping]] = ..., commit: _Optional[_Union[CommitSlots, _Mapping]] = ..., cancel: _Optional[_Union[CancelSlots, _Mapping]] = ...) -> None: ...

class InsertPlaneResponse(_message.Message):
    __slots__ = ("request_id", "opened", "reserved", "committed", "cancelled")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OPENED_FIELD_NUMBER: _ClassVar[int]
    RESERVED_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    opened: InsertPlaneOpened
    reserved: SlotsReserved
    committed: SlotsCommitted
    cancelled: bool
    def __init__(self, request_id: _Optional[int] = ..., opened: _Optional[_Union[InsertPlaneOpened, _Mapping]] = ..., reserved: _Optional[_Union[SlotsReserved, _Mapping]] = ..., committed: _Optional[_Union[SlotsCommitted, _Mapping]] = ..., cancelled: _Optional[bool] = ...) -> None: ...
