from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tensor(_message.Message):
    __slots__ = ("data", "dtype", "shape")
    DATA_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, data: _Optional[bytes] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ShardSpec(_message.Message):
    __slots__ = ("model_id", "model_dir", "start", "end", "is_head", "is_tail", "dtype", "next_node")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_DIR_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    IS_HEAD_FIELD_NUMBER: _ClassVar[int]
    IS_TAIL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NEXT_NODE_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    model_dir: str
    start: int
    end: int
    is_head: bool
    is_tail: bool
    dtype: str
    next_node: str
    def __init__(self, model_id: _Optional[str] = ..., model_dir: _Optional[str] = ..., start: _Optional[int] = ..., end: _Optional[int] = ..., is_head: _Optional[bool] = ..., is_tail: _Optional[bool] = ..., dtype: _Optional[str] = ..., next_node: _Optional[str] = ...) -> None: ...

class NodeInfo(_message.Message):
    __slots__ = ("node_id", "version", "device", "memory_total_bytes", "memory_used_bytes", "weights_bytes", "cache_bytes", "cache_budget_bytes", "shard", "active_requests", "steps_total", "step_latency_ms", "uptime_s", "busy_seconds_total", "batches_total", "next_hop_rtt_ms", "chip", "os", "cpu_count")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_BYTES_FIELD_NUMBER: _ClassVar[int]
    CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CACHE_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    STEPS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    STEP_LATENCY_MS_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    BUSY_SECONDS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    BATCHES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NEXT_HOP_RTT_MS_FIELD_NUMBER: _ClassVar[int]
    CHIP_FIELD_NUMBER: _ClassVar[int]
    OS_FIELD_NUMBER: _ClassVar[int]
    CPU_COUNT_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    version: str
    device: str
    memory_total_bytes: int
    memory_used_bytes: int
    weights_bytes: int
    cache_bytes: int
    cache_budget_bytes: int
    shard: ShardSpec
    active_requests: int
    steps_total: int
    step_latency_ms: float
    uptime_s: float
    busy_seconds_total: float
    batches_total: int
    next_hop_rtt_ms: float
    chip: str
    os: str
    cpu_count: int
    def __init__(self, node_id: _Optional[str] = ..., version: _Optional[str] = ..., device: _Optional[str] = ..., memory_total_bytes: _Optional[int] = ..., memory_used_bytes: _Optional[int] = ..., weights_bytes: _Optional[int] = ..., cache_bytes: _Optional[int] = ..., cache_budget_bytes: _Optional[int] = ..., shard: _Optional[_Union[ShardSpec, _Mapping]] = ..., active_requests: _Optional[int] = ..., steps_total: _Optional[int] = ..., step_latency_ms: _Optional[float] = ..., uptime_s: _Optional[float] = ..., busy_seconds_total: _Optional[float] = ..., batches_total: _Optional[int] = ..., next_hop_rtt_ms: _Optional[float] = ..., chip: _Optional[str] = ..., os: _Optional[str] = ..., cpu_count: _Optional[int] = ...) -> None: ...

class LoadShardRequest(_message.Message):
    __slots__ = ("model_dir", "start", "end", "is_head", "is_tail", "dtype", "next_node", "cache_budget_bytes", "model_id")
    MODEL_DIR_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    IS_HEAD_FIELD_NUMBER: _ClassVar[int]
    IS_TAIL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NEXT_NODE_FIELD_NUMBER: _ClassVar[int]
    CACHE_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    model_dir: str
    start: int
    end: int
    is_head: bool
    is_tail: bool
    dtype: str
    next_node: str
    cache_budget_bytes: int
    model_id: str
    def __init__(self, model_dir: _Optional[str] = ..., start: _Optional[int] = ..., end: _Optional[int] = ..., is_head: _Optional[bool] = ..., is_tail: _Optional[bool] = ..., dtype: _Optional[str] = ..., next_node: _Optional[str] = ..., cache_budget_bytes: _Optional[int] = ..., model_id: _Optional[str] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ...) -> None: ...

class RequestOptions(_message.Message):
    __slots__ = ("sampling", "mtp", "logprobs")
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MTP_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    sampling: SamplingParams
    mtp: bool
    logprobs: bool
    def __init__(self, sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., mtp: _Optional[bool] = ..., logprobs: _Optional[bool] = ...) -> None: ...

class StepEntry(_message.Message):
    __slots__ = ("request_id", "tokens", "position", "draft_len", "rollback", "sample", "options")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    DRAFT_LEN_FIELD_NUMBER: _ClassVar[int]
    ROLLBACK_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tokens: _containers.RepeatedScalarFieldContainer[int]
    position: int
    draft_len: int
    rollback: int
    sample: bool
    options: RequestOptions
    def __init__(self, request_id: _Optional[str] = ..., tokens: _Optional[_Iterable[int]] = ..., position: _Optional[int] = ..., draft_len: _Optional[int] = ..., rollback: _Optional[int] = ..., sample: _Optional[bool] = ..., options: _Optional[_Union[RequestOptions, _Mapping]] = ...) -> None: ...

class StepBatch(_message.Message):
    __slots__ = ("entries", "hidden", "sequence")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[StepEntry]
    hidden: Tensor
    sequence: int
    def __init__(self, entries: _Optional[_Iterable[_Union[StepEntry, _Mapping]]] = ..., hidden: _Optional[_Union[Tensor, _Mapping]] = ..., sequence: _Optional[int] = ...) -> None: ...

class StepEvent(_message.Message):
    __slots__ = ("sequence",)
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    def __init__(self, sequence: _Optional[int] = ...) -> None: ...

class ResultsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResultEntry(_message.Message):
    __slots__ = ("request_id", "tokens", "keep", "draft", "drafted", "accepted", "logprobs", "has_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    KEEP_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    HAS_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tokens: _containers.RepeatedScalarFieldContainer[int]
    keep: int
    draft: int
    drafted: int
    accepted: int
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    has_logprobs: bool
    def __init__(self, request_id: _Optional[str] = ..., tokens: _Optional[_Iterable[int]] = ..., keep: _Optional[int] = ..., draft: _Optional[int] = ..., drafted: _Optional[int] = ..., accepted: _Optional[int] = ..., logprobs: _Optional[_Iterable[float]] = ..., has_logprobs: _Optional[bool] = ...) -> None: ...

class StepError(_message.Message):
    __slots__ = ("request_id", "code", "message")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    code: int
    message: str
    def __init__(self, request_id: _Optional[str] = ..., code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class ResultBatch(_message.Message):
    __slots__ = ("results", "errors")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[ResultEntry]
    errors: _containers.RepeatedCompositeFieldContainer[StepError]
    def __init__(self, results: _Optional[_Iterable[_Union[ResultEntry, _Mapping]]] = ..., errors: _Optional[_Iterable[_Union[StepError, _Mapping]]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class ReleaseReply(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class RollbackRequest(_message.Message):
    __slots__ = ("request_id", "drop")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DROP_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    drop: int
    def __init__(self, request_id: _Optional[str] = ..., drop: _Optional[int] = ...) -> None: ...

class RollbackReply(_message.Message):
    __slots__ = ("applied", "position")
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    applied: bool
    position: int
    def __init__(self, applied: _Optional[bool] = ..., position: _Optional[int] = ...) -> None: ...
