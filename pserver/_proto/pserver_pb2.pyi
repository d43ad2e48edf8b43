from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SparseTableSpec(_message.Message):
    __slots__ = ("name", "dim", "optimizer", "lr", "init_scale", "seed", "min_count", "max_rows", "ttl_steps", "params", "row_dtype", "state_dtype")
    class ParamsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    INIT_SCALE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MIN_COUNT_FIELD_NUMBER: _ClassVar[int]
    MAX_ROWS_FIELD_NUMBER: _ClassVar[int]
    TTL_STEPS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    ROW_DTYPE_FIELD_NUMBER: _ClassVar[int]
    STATE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    dim: int
    optimizer: str
    lr: float
    init_scale: float
    seed: int
    min_count: int
    max_rows: int
    ttl_steps: int
    params: _containers.ScalarMap[str, float]
    row_dtype: str
    state_dtype: str
    def __init__(self, name: _Optional[str] = ..., dim: _Optional[int] = ..., optimizer: _Optional[str] = ..., lr: _Optional[float] = ..., init_scale: _Optional[float] = ..., seed: _Optional[int] = ..., min_count: _Optional[int] = ..., max_rows: _Optional[int] = ..., ttl_steps: _Optional[int] = ..., params: _Optional[_Mapping[str, float]] = ..., row_dtype: _Optional[str] = ..., state_dtype: _Optional[str] = ...) -> None: ...

class SparsePart(_message.Message):
    __slots__ = ("table", "num_ids")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    NUM_IDS_FIELD_NUMBER: _ClassVar[int]
    table: str
    num_ids: int
    def __init__(self, table: _Optional[str] = ..., num_ids: _Optional[int] = ...) -> None: ...

class PullRowsRequest(_message.Message):
    __slots__ = ("rank", "shard", "session", "table", "ids")
    RANK_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    TABLE_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    rank: int
    shard: int
    session: str
    table: str
    ids: bytes
    def __init__(self, rank: _Optional[int] = ..., shard: _Optional[int] = ..., session: _Optional[str] = ..., table: _Optional[str] = ..., ids: _Optional[bytes] = ...) -> None: ...

class ExportRowsRequest(_message.Message):
    __slots__ = ("rank", "shard", "session", "table")
    RANK_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    TABLE_FIELD_NUMBER: _ClassVar[int]
    rank: int
    shard: int
    session: str
    table: str
    def __init__(self, rank: _Optional[int] = ..., shard: _Optional[int] = ..., session: _Optional[str] = ..., table: _Optional[str] = ...) -> None: ...

class ExportRowsPage(_message.Message):
    __slots__ = ("version", "total_rows", "dim", "dtype", "ids", "rows")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TOTAL_ROWS_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    version: int
    total_rows: int
    dim: int
    dtype: str
    ids: bytes
    rows: bytes
    def __init__(self, version: _Optional[int] = ..., total_rows: _Optional[int] = ..., dim: _Optional[int] = ..., dtype: _Optional[str] = ..., ids: _Optional[bytes] = ..., rows: _Optional[bytes] = ...) -> None: ...

class TableStatus(_message.Message):
    __slots__ = ("name", "dim", "optimizer", "rows", "bytes", "pending_ids", "admissions", "creations", "evictions")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    PENDING_IDS_FIELD_NUMBER: _ClassVar[int]
    ADMISSIONS_FIELD_NUMBER: _ClassVar[int]
    CREATIONS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    name: str
    dim: int
    optimizer: str
    rows: int
    bytes: int
    pending_ids: int
    admissions: int
    creations: int
    evictions: int
    def __init__(self, name: _Optional[str] = ..., dim: _Optional[int] = ..., optimizer: _Optional[str] = ..., rows: _Optional[int] = ..., bytes: _Optional[int] = ..., pending_ids: _Optional[int] = ..., admissions: _Optional[int] = ..., creations: _Optional[int] = ..., evictions: _Optional[int] = ...) -> None: ...

class TensorSpec(_message.Message):
    __slots__ = ("name", "shape", "frozen", "momentum")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    FROZEN_FIELD_NUMBER: _ClassVar[int]
    MOMENTUM_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    frozen: bool
    momentum: float
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., frozen: _Optional[bool] = ..., momentum: _Optional[float] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("rank", "num_workers", "shard", "num_shards", "layout", "batch_size", "protocol_version", "tables", "data_seed", "steps_per_epoch", "previous_session", "elastic_auto_rank")
    RANK_FIELD_NUMBER: _ClassVar[int]
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    DATA_SEED_FIELD_NUMBER: _ClassVar[int]
    STEPS_PER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_SESSION_FIELD_NUMBER: _ClassVar[int]
    ELASTIC_AUTO_RANK_FIELD_NUMBER: _ClassVar[int]
    rank: int
    num_workers: int
    shard: int
    num_shards: int
    layout: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    batch_size: int
    protocol_version: int
    tables: _containers.RepeatedCompositeFieldContainer[SparseTableSpec]
    data_seed: int
    steps_per_epoch: int
    previous_session: str
    elastic_auto_rank: bool
    def __init__(self, rank: _Optional[int] = ..., num_workers: _Optional[int] = ..., shard: _Optional[int] = ..., num_shards: _Optional[int] = ..., layout: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., batch_size: _Optional[int] = ..., protocol_version: _Optional[int] = ..., tables: _Optional[_Iterable[_Union[SparseTableSpec, _Mapping]]] = ..., data_seed: _Optional[int] = ..., steps_per_epoch: _Optional[int] = ..., previous_session: _Optional[str] = ..., elastic_auto_rank: _Optional[bool] = ...) -> None: ...

class TrainingSettings(_message.Message):
    __slots__ = ("mode", "backup_workers", "staleness", "optimizer", "lr", "lr_schedule", "momentum", "nesterov", "beta1", "beta2", "eps", "weight_decay", "step_timeout", "num_workers", "rho", "centered", "initial_accumulator", "clipvalue")
    MODE_FIELD_NUMBER: _ClassVar[int]
    BACKUP_WORKERS_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    LR_SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    MOMENTUM_FIELD_NUMBER: _ClassVar[int]
    NESTEROV_FIELD_NUMBER: _ClassVar[int]
    BETA1_FIELD_NUMBER: _ClassVar[int]
    BETA2_FIELD_NUMBER: _ClassVar[int]
    EPS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    STEP_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    RHO_FIELD_NUMBER: _ClassVar[int]
    CENTERED_FIELD_NUMBER: _ClassVar[int]
    INITIAL_ACCUMULATOR_FIELD_NUMBER: _ClassVar[int]
    CLIPVALUE_FIELD_NUMBER: _ClassVar[int]
    mode: str
    backup_workers: int
    staleness: int
    optimizer: str
    lr: float
    lr_schedule: str
    momentum: float
    nesterov: bool
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    step_timeout: float
    num_workers: int
    rho: float
    centered: bool
    initial_accumulator: float
    clipvalue: float
    def __init__(self, mode: _Optional[str] = ..., backup_workers: _Optional[int] = ..., staleness: _Optional[int] = ..., optimizer: _Optional[str] = ..., lr: _Optional[float] = ..., lr_schedule: _Optional[str] = ..., momentum: _Optional[float] = ..., nesterov: _Optional[bool] = ..., beta1: _Optional[float] = ..., beta2: _Optional[float] = ..., eps: _Optional[float] = ..., weight_decay: _Optional[float] = ..., step_timeout: _Optional[float] = ..., num_workers: _Optional[int] = ..., rho: _Optional[float] = ..., centered: _Optional[bool] = ..., initial_accumulator: _Optional[float] = ..., clipvalue: _Optional[float] = ...) -> None: ...

class TrainingPosition(_message.Message):
    __slots__ = ("clock", "data_seed", "steps_per_epoch")
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    DATA_SEED_FIELD_NUMBER: _ClassVar[int]
    STEPS_PER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    clock: int
    data_seed: int
    steps_per_epoch: int
    def __init__(self, clock: _Optional[int] = ..., data_seed: _Optional[int] = ..., steps_per_epoch: _Optional[int] = ...) -> None: ...

class RegisterReply(_message.Message):
    __slots__ = ("mode", "version", "initialized", "range_start", "range_end", "total_params", "layout_signature", "optimizer", "lr", "dataplane", "host_id", "session", "session_timeout_seconds", "protocol_version", "restored_from", "seeded_by_rank", "position", "settings", "instance", "took_over", "assigned_rank", "elastic_initial_workers", "elastic_max_workers")
    MODE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    INITIALIZED_FIELD_NUMBER: _ClassVar[int]
    RANGE_START_FIELD_NUMBER: _ClassVar[int]
    RANGE_END_FIELD_NUMBER: _ClassVar[int]
    TOTAL_PARAMS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    DATAPLANE_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    SESSION_TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    RESTORED_FROM_FIELD_NUMBER: _ClassVar[int]
    SEEDED_BY_RANK_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    SETTINGS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    TOOK_OVER_FIELD_NUMBER: _ClassVar[int]
    ASSIGNED_RANK_FIELD_NUMBER: _ClassVar[int]
    ELASTIC_INITIAL_WORKERS_FIELD_NUMBER: _ClassVar[int]
    ELASTIC_MAX_WORKERS_FIELD_NUMBER: _ClassVar[int]
    mode: str
    version: int
    initialized: bool
    range_start: int
    range_end: int
    total_params: int
    layout_signature: str
    optimizer: str
    lr: float
    dataplane: str
    host_id: str
    session: str
    session_timeout_seconds: float
    protocol_version: int
    restored_from: str
    seeded_by_rank: int
    position: TrainingPosition
    settings: TrainingSettings
    instance: str
    took_over: bool
    assigned_rank: int
    elastic_initial_workers: int
    elastic_max_workers: int
    def __init__(self, mode: _Optional[str] = ..., version: _Optional[int] = ..., initialized: _Optional[bool] = ..., range_start: _Optional[int] = ..., range_end: _Optional[int] = ..., total_params: _Optional[int] = ..., layout_signature: _Optional[str] = ..., optimizer: _Optional[str] = ..., lr: _Optional[float] = ..., dataplane: _Optional[str] = ..., host_id: _Optional[str] = ..., session: _Optional[str] = ..., session_timeout_seconds: _Optional[float] = ..., protocol_version: _Optional[int] = ..., restored_from: _Optional[str] = ..., seeded_by_rank: _Optional[int] = ..., position: _Optional[_Union[TrainingPosition, _Mapping]] = ..., settings: _Optional[_Union[TrainingSettings, _Mapping]] = ..., instance: _Optional[str] = ..., took_over: _Optional[bool] = ..., assigned_rank: _Optional[int] = ..., elastic_initial_workers: _Optional[int] = ..., elastic_max_workers: _Optional[int] = ...) -> None: ...

class ElasticJoinStepRequest(_message.Message):
    __slots__ = ("rank", "session", "step")
    RANK_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    rank: int
    session: str
    step: int
    def __init__(self, rank: _Optional[int] = ..., session: _Optional[str] = ..., step: _Optional[int] = ...) -> None: ...

class ElasticJoinStepReply(_message.Message):
    __slots__ = ("version", "member_from")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MEMBER_FROM_FIELD_NUMBER: _ClassVar[int]
    version: int
    member_from: int
    def __init__(self, version: _Optional[int] = ..., member_from: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("rank", "session")
    RANK_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    rank: int
    session: str
    def __init__(self, rank: _Optional[int] = ..., session: _Optional[str] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...

class TensorHeader(_message.Message):
    __slots__ = ("rank", "shard", "step", "num_elements", "dtype", "num_samples", "layout_signature", "clock", "finished", "session", "sparse", "compression", "num_values", "scale", "has_lease", "lease_epoch", "lease_chunk", "lease_batch", "lease_loss_sum", "lease_correct", "lease_metric_sums", "statistics")
    RANK_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    NUM_ELEMENTS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    SPARSE_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    NUM_VALUES_FIELD_NUMBER: _ClassVar[int]
    SCALE_FIELD_NUMBER: _ClassVar[int]
    HAS_LEASE_FIELD_NUMBER: _ClassVar[int]
    LEASE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    LEASE_CHUNK_FIELD_NUMBER: _ClassVar[int]
    LEASE_BATCH_FIELD_NUMBER: _ClassVar[int]
    LEASE_LOSS_SUM_FIELD_NUMBER: _ClassVar[int]
    LEASE_CORRECT_FIELD_NUMBER: _ClassVar[int]
    LEASE_METRIC_SUMS_FIELD_NUMBER: _ClassVar[int]
    STATISTICS_FIELD_NUMBER: _ClassVar[int]
    rank: int
    shard: int
    step: int
    num_elements: int
    dtype: str
    num_samples: int
    layout_signature: str
    clock: int
    finished: bool
    session: str
    sparse: _containers.RepeatedCompositeFieldContainer[SparsePart]
    compression: str
    num_values: int
    scale: float
    has_lease: bool
    lease_epoch: int
    lease_chunk: int
    lease_batch: int
    lease_loss_sum: float
    lease_correct: float
    lease_metric_sums: _containers.RepeatedScalarFieldContainer[float]
    statistics: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, rank: _Optional[int] = ..., shard: _Optional[int] = ..., step: _Optional[int] = ..., num_elements: _Optional[int] = ..., dtype: _Optional[str] = ..., num_samples: _Optional[int] = ..., layout_signature: _Optional[str] = ..., clock: _Optional[int] = ..., finished: _Optional[bool] = ..., session: _Optional[str] = ..., sparse: _Optional[_Iterable[_Union[SparsePart, _Mapping]]] = ..., compression: _Optional[str] = ..., num_values: _Optional[int] = ..., scale: _Optional[float] = ..., has_lease: _Optional[bool] = ..., lease_epoch: _Optional[int] = ..., lease_chunk: _Optional[int] = ..., lease_batch: _Optional[int] = ..., lease_loss_sum: _Optional[float] = ..., lease_correct: _Optional[float] = ..., lease_metric_sums: _Optional[_Iterable[float]] = ..., statistics: _Optional[_Iterable[float]] = ...) -> None: ...

class TensorChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: TensorHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[TensorHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class InitReply(_message.Message):
    __slots__ = ("already_initialized", "version")
    ALREADY_INITIALIZED_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    already_initialized: bool
    version: int
    def __init__(self, already_initialized: _Optional[bool] = ..., version: _Optional[int] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("rank", "shard", "seen_version", "clock", "session", "compression")
    RANK_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    SEEN_VERSION_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    rank: int
    shard: int
    seen_version: int
    clock: int
    session: str
    compression: str
    def __init__(self, rank: _Optional[int] = ..., shard: _Optional[int] = ..., seen_version: _Optional[int] = ..., clock: _Optional[int] = ..., session: _Optional[str] = ..., compression: _Optional[str] = ...) -> None: ...

class PushReply(_message.Message):
    __slots__ = ("outcome", "version", "message", "finished")
    class Outcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        OUTCOME_UNSPECIFIED: _ClassVar[PushReply.Outcome]
        APPLIED: _ClassVar[PushReply.Outcome]
        AGGREGATED: _ClassVar[PushReply.Outcome]
        DROPPED_LATE: _ClassVar[PushReply.Outcome]
    OUTCOME_UNSPECIFIED: PushReply.Outcome
    APPLIED: PushReply.Outcome
    AGGREGATED: PushReply.Outcome
    DROPPED_LATE: PushReply.Outcome
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    outcome: PushReply.Outcome
    version: int
    message: str
    finished: bool
    def __init__(self, outcome: _Optional[_Union[PushReply.Outcome, str]] = ..., version: _Optional[int] = ..., message: _Optional[str] = ..., finished: _Optional[bool] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Counters(_message.Message):
    __slots__ = ("pushes_received", "pushes_applied", "pushes_aggregated", "pushes_dropped_late", "pushes_rejected", "updates_applied", "workers_marked_dead", "samples_pushed", "staleness_mean", "staleness_max", "staleness_histogram", "pulls_served", "clock_gap_max", "checkpoints_written", "checkpoints_failed", "workers_rejoined", "sessions_replaced", "sessions_taken_over", "requests_refused_busy", "rows_pulled", "rows_pushed", "rows_evicted_for_memory", "pushes_refused_for_memory", "chunks_done", "chunks_released", "batches_retrained", "batches_dropped")
    PUSHES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    PUSHES_APPLIED_FIELD_NUMBER: _ClassVar[int]
    PUSHES_AGGREGATED_FIELD_NUMBER: _ClassVar[int]
    PUSHES_DROPPED_LATE_FIELD_NUMBER: _ClassVar[int]
    PUSHES_REJECTED_FIELD_NUMBER: _ClassVar[int]
    UPDATES_APPLIED_FIELD_NUMBER: _ClassVar[int]
    WORKERS_MARKED_DEAD_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PUSHED_FIELD_NUMBER: _ClassVar[int]
    STALENESS_MEAN_FIELD_NUMBER: _ClassVar[int]
    STALENESS_MAX_FIELD_NUMBER: _ClassVar[int]
    STALENESS_HISTOGRAM_FIELD_NUMBER: _ClassVar[int]
    PULLS_SERVED_FIELD_NUMBER: _ClassVar[int]
    CLOCK_GAP_MAX_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINTS_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINTS_FAILED_FIELD_NUMBER: _ClassVar[int]
    WORKERS_REJOINED_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_REPLACED_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_TAKEN_OVER_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_REFUSED_BUSY_FIELD_NUMBER: _ClassVar[int]
    ROWS_PULLED_FIELD_NUMBER: _ClassVar[int]
    ROWS_PUSHED_FIELD_NUMBER: _ClassVar[int]
    ROWS_EVICTED_FOR_MEMORY_FIELD_NUMBER: _ClassVar[int]
    PUSHES_REFUSED_FOR_MEMORY_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_DONE_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_RELEASED_FIELD_NUMBER: _ClassVar[int]
    BATCHES_RETRAINED_FIELD_NUMBER: _ClassVar[int]
    BATCHES_DROPPED_FIELD_NUMBER: _ClassVar[int]
    pushes_received: int
    pushes_applied: int
    pushes_aggregated: int
    pushes_dropped_late: int
    pushes_rejected: int
    updates_applied: int
    workers_marked_dead: int
    samples_pushed: int
    staleness_mean: float
    staleness_max: int
    staleness_histogram: _containers.RepeatedScalarFieldContainer[int]
    pulls_served: int
    clock_gap_max: int
    checkpoints_written: int
    checkpoints_failed: int
    workers_rejoined: int
    sessions_replaced: int
    sessions_taken_over: int
    requests_refused_busy: int
    rows_pulled: int
    rows_pushed: int
    rows_evicted_for_memory: int
    pushes_refused_for_memory: int
    chunks_done: int
    chunks_released: int
    batches_retrained: int
    batches_dropped: int
    def __init__(self, pushes_received: _Optional[int] = ..., pushes_applied: _Optional[int] = ..., pushes_aggregated: _Optional[int] = ..., pushes_dropped_late: _Optional[int] = ..., pushes_rejected: _Optional[int] = ..., updates_applied: _Optional[int] = ..., workers_marked_dead: _Optional[int] = ..., samples_pushed: _Optional[int] = ..., staleness_mean: _Optional[float] = ..., staleness_max: _Optional[int] = ..., staleness_histogram: _Optional[_Iterable[int]] = ..., pulls_served: _Optional[int] = ..., clock_gap_max: _Optional[int] = ..., checkpoints_written: _Optional[int] = ..., checkpoints_failed: _Optional[int] = ..., workers_rejoined: _Optional[int] = ..., sessions_replaced: _Optional[int] = ..., sessions_taken_over: _Optional[int] = ..., requests_refused_busy: _Optional[int] = ..., rows_pulled: _Optional[int] = ..., rows_pushed: _Optional[int] = ..., rows_evicted_for_memory: _Optional[int] = ..., pushes_refused_for_memory: _Optional[int] = ..., chunks_done: _Optional[int] = ..., chunks_released: _Optional[int] = ..., batches_retrained: _Optional[int] = ..., batches_dropped: _Optional[int] = ...) -> None: ...

class MemoryStatus(_message.Message):
    __slots__ = ("budget", "used", "reserved")
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    USED_FIELD_NUMBER: _ClassVar[int]
    RESERVED_FIELD_NUMBER: _ClassVar[int]
    budget: int
    used: int
    reserved: int
    def __init__(self, budget: _Optional[int] = ..., used: _Optional[int] = ..., reserved: _Optional[int] = ...) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("shard", "num_shards", "mode", "version", "num_params", "total_params", "num_workers", "optimizer", "lr", "counters", "live_workers", "uptime_seconds", "layout_signature", "dead_workers", "tables", "restored_from", "seeded_by_rank", "instance", "settings", "memory", "registered_workers", "assigned_version")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_PARAMS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_PARAMS_FIELD_NUMBER: _ClassVar[int]
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    LIVE_WORKERS_FIELD_NUMBER: _ClassVar[int]
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    DEAD_WORKERS_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    RESTORED_FROM_FIELD_NUMBER: _ClassVar[int]
    SEEDED_BY_RANK_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    SETTINGS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_WORKERS_FIELD_NUMBER: _ClassVar[int]
    ASSIGNED_VERSION_FIELD_NUMBER: _ClassVar[int]
    shard: int
    num_shards: int
    mode: str
    version: int
    num_params: int
    total_params: int
    num_workers: int
    optimizer: str
    lr: float
    counters: Counters
    live_workers: _containers.RepeatedScalarFieldContainer[int]
    uptime_seconds: float
    layout_signature: str
    dead_workers: _containers.RepeatedScalarFieldContainer[int]
    tables: _containers.RepeatedCompositeFieldContainer[TableStatus]
    restored_from: str
    seeded_by_rank: int
    instance: str
    settings: TrainingSettings
    memory: MemoryStatus
    registered_workers: _containers.RepeatedScalarFieldContainer[int]
    assigned_version: int
    def __init__(self, shard: _Optional[int] = ..., num_shards: _Optional[int] = ..., mode: _Optional[str] = ..., version: _Optional[int] = ..., num_params: _Optional[int] = ..., total_params: _Optional[int] = ..., num_workers: _Optional[int] = ..., optimizer: _Optional[str] = ..., lr: _Optional[float] = ..., counters: _Optional[_Union[Counters, _Mapping]] = ..., live_workers: _Optional[_Iterable[int]] = ..., uptime_seconds: _Optional[float] = ..., layout_signature: _Optional[str] = ..., dead_workers: _Optional[_Iterable[int]] = ..., tables: _Optional[_Iterable[_Union[TableStatus, _Mapping]]] = ..., restored_from: _Optional[str] = ..., seeded_by_rank: _Optional[int] = ..., instance: _Optional[str] = ..., settings: _Optional[_Union[TrainingSettings, _Mapping]] = ..., memory: _Optional[_Union[MemoryStatus, _Mapping]] = ..., registered_workers: _Optional[_Iterable[int]] = ..., assigned_version: _Optional[int] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("rank", "session")
    RANK_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    rank: int
    session: str
    def __init__(self, rank: _Optional[int] = ..., session: _Optional[str] = ...) -> None: ...

class LeaveReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CheckpointRequest(_message.Message):
    __slots__ = ("rank", "session", "then_stop")
    RANK_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    THEN_STOP_FIELD_NUMBER: _ClassVar[int]
    rank: int
    session: str
    then_stop: bool
    def __init__(self, rank: _Optional[int] = ..., session: _Optional[str] = ..., then_stop: _Optional[bool] = ...) -> None: ...

class CheckpointReply(_message.Message):
    __slots__ = ("path", "version")
    PATH_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    path: str
    version: int
    def __init__(self, path: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class SetLearningRateRequest(_message.Message):
    __slots__ = ("rank", "session", "lr")
    RANK_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    rank: int
    session: str
    lr: float
    def __init__(self, rank: _Optional[int] = ..., session: _Optional[str] = ..., lr: _Optional[float] = ...) -> None: ...

class SetLearningRateReply(_message.Message):
    __slots__ = ("version", "lr")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    version: int
    lr: float
    def __init__(self, version: _Optional[int] = ..., lr: _Optional[float] = ...) -> None: ...

class AssignWeightsReply(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...

class LeaseDataRequest(_message.Message):
    __slots__ = ("rank", "session", "num_batches", "chunk_batches", "seed", "fingerprint", "finished", "finished_epoch", "finished_chunk", "epochs", "in_order", "done_before_restore", "restart", "epoch_logs", "logs_epoch", "share_logs", "log_names", "log_values", "stop_training")
    RANK_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    NUM_BATCHES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BATCHES_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISHED_EPOCH_FIELD_NUMBER: _ClassVar[int]
    FINISHED_CHUNK_FIELD_NUMBER: _ClassVar[int]
    EPOCHS_FIELD_NUMBER: _ClassVar[int]
    IN_ORDER_FIELD_NUMBER: _ClassVar[int]
    DONE_BEFORE_RESTORE_FIELD_NUMBER: _ClassVar[int]
    RESTART_FIELD_NUMBER: _ClassVar[int]
    EPOCH_LOGS_FIELD_NUMBER: _ClassVar[int]
    LOGS_EPOCH_FIELD_NUMBER: _ClassVar[int]
    SHARE_LOGS_FIELD_NUMBER: _ClassVar[int]
    LOG_NAMES_FIELD_NUMBER: _ClassVar[int]
    LOG_VALUES_FIELD_NUMBER: _ClassVar[int]
    STOP_TRAINING_FIELD_NUMBER: _ClassVar[int]
    rank: int
    session: str
    num_batches: int
    chunk_batches: int
    seed: int
    fingerprint: str
    finished: bool
    finished_epoch: int
    finished_chunk: int
    epochs: int
    in_order: bool
    done_before_restore: _containers.RepeatedCompositeFieldContainer[LeaseDoneBeforeRestore]
    restart: bool
    epoch_logs: bool
    logs_epoch: int
    share_logs: bool
    log_names: _containers.RepeatedScalarFieldContainer[str]
    log_values: _containers.RepeatedScalarFieldContainer[float]
    stop_training: bool
    def __init__(self, rank: _Optional[int] = ..., session: _Optional[str] = ..., num_batches: _Optional[int] = ..., chunk_batches: _Optional[int] = ..., seed: _Optional[int] = ..., fingerprint: _Optional[str] = ..., finished: _Optional[bool] = ..., finished_epoch: _Optional[int] = ..., finished_chunk: _Optional[int] = ..., epochs: _Optional[int] = ..., in_order: _Optional[bool] = ..., done_before_restore: _Optional[_Iterable[_Union[LeaseDoneBeforeRestore, _Mapping]]] = ..., restart: _Optional[bool] = ..., epoch_logs: _Optional[bool] = ..., logs_epoch: _Optional[int] = ..., share_logs: _Optional[bool] = ..., log_names: _Optional[_Iterable[str]] = ..., log_values: _Optional[_Iterable[float]] = ..., stop_training: _Optional[bool] = ...) -> None: ...

class LeaseDoneBeforeRestore(_message.Message):
    __slots__ = ("epoch", "chunk", "end")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    chunk: int
    end: int
    def __init__(self, epoch: _Optional[int] = ..., chunk: _Optional[int] = ..., end: _Optional[int] = ...) -> None: ...

class LeaseDataReply(_message.Message):
    __slots__ = ("has_lease", "epoch", "chunk", "first_batch", "end_batch", "finished_gone", "coordinator_id", "trained_loss_sum", "trained_correct", "trained_samples", "trained_metric_sums", "has_logs", "log_names", "log_values", "stop_training", "chief_told", "chief_live")
    HAS_LEASE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    FIRST_BATCH_FIELD_NUMBER: _ClassVar[int]
    END_BATCH_FIELD_NUMBER: _ClassVar[int]
    FINISHED_GONE_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_ID_FIELD_NUMBER: _ClassVar[int]
    TRAINED_LOSS_SUM_FIELD_NUMBER: _ClassVar[int]
    TRAINED_CORRECT_FIELD_NUMBER: _ClassVar[int]
    TRAINED_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    TRAINED_METRIC_SUMS_FIELD_NUMBER: _ClassVar[int]
    HAS_LOGS_FIELD_NUMBER: _ClassVar[int]
    LOG_NAMES_FIELD_NUMBER: _ClassVar[int]
    LOG_VALUES_FIELD_NUMBER: _ClassVar[int]
    STOP_TRAINING_FIELD_NUMBER: _ClassVar[int]
    CHIEF_TOLD_FIELD_NUMBER: _ClassVar[int]
    CHIEF_LIVE_FIELD_NUMBER: _ClassVar[int]
    has_lease: bool
    epoch: int
    chunk: int
    first_batch: int
    end_batch: int
    finished_gone: bool
    coordinator_id: str
    trained_loss_sum: float
    trained_correct: float
    trained_samples: int
    trained_metric_sums: _containers.RepeatedScalarFieldContainer[float]
    has_logs: bool
    log_names: _containers.RepeatedScalarFieldContainer[str]
    log_values: _containers.RepeatedScalarFieldContainer[float]
    stop_training: bool
    chief_told: bool
    chief_live: bool
    def __init__(self, has_lease: _Optional[bool] = ..., epoch: _Optional[int] = ..., chunk: _Optional[int] = ..., first_batch: _Optional[int] = ..., end_batch: _Optional[int] = ..., finished_gone: _Optional[bool] = ..., coordinator_id: _Optional[str] = ..., trained_loss_sum: _Optional[float] = ..., trained_correct: _Optional[float] = ..., trained_samples: _Optional[int] = ..., trained_metric_sums: _Optional[_Iterable[float]] = ..., has_logs: _Optional[bool] = ..., log_names: _Optional[_Iterable[str]] = ..., log_values: _Optional[_Iterable[float]] = ..., stop_training: _Optional[bool] = ..., chief_told: _Optional[bool] = ..., chief_live: _Optional[bool] = ...) -> None: ...

class NamedArray(_message.Message):
    __slots__ = ("name", "dtype", "shape", "data")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class PredictRequest(_message.Message):
    __slots__ = ("inputs",)
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    inputs: _containers.RepeatedCompositeFieldContainer[NamedArray]
    def __init__(self, inputs: _Optional[_Iterable[_Union[NamedArray, _Mapping]]] = ...) -> None: ...

class PredictReply(_message.Message):
    __slots__ = ("outputs", "version", "export_id")
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    EXPORT_ID_FIELD_NUMBER: _ClassVar[int]
    outputs: NamedArray
    version: int
    export_id: str
    def __init__(self, outputs: _Optional[_Union[NamedArray, _Mapping]] = ..., version: _Optional[int] = ..., export_id: _Optional[str] = ...) -> None: ...

class ModelStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelStatusReply(_message.Message):
    __slots__ = ("name", "version", "export_id", "deltas_applied", "deltas_refused", "last_refusal", "inputs", "follow_errors", "last_follow_error")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    EXPORT_ID_FIELD_NUMBER: _ClassVar[int]
    DELTAS_APPLIED_FIELD_NUMBER: _ClassVar[int]
    DELTAS_REFUSED_FIELD_NUMBER: _ClassVar[int]
    LAST_REFUSAL_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    FOLLOW_ERRORS_FIELD_NUMBER: _ClassVar[int]
    LAST_FOLLOW_ERROR_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: int
    export_id: str
    deltas_applied: int
    deltas_refused: int
    last_refusal: str
    inputs: _containers.RepeatedScalarFieldContainer[str]
    follow_errors: int
    last_follow_error: str
    def __init__(self, name: _Optional[str] = ..., version: _Optional[int] = ..., export_id: _Optional[str] = ..., deltas_applied: _Optional[int] = ..., deltas_refused: _Optional[int] = ..., last_refusal: _Optional[str] = ..., inputs: _Optional[_Iterable[str]] = ..., follow_errors: _Optional[int] = ..., last_follow_error: _Optional[str] = ...) -> None: ...
