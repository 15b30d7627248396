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
    __slots__ = ("model_id", "model_dir", "start", "end", "is_head", "is_tail", "dtype", "next_node", "next_node_pinned", "next_node_id")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_DIR_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    IS_HEAD_FIELD_NUMBER: _ClassVar[int]
    IS_TAIL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NEXT_NODE_FIELD_NUMBER: _ClassVar[int]
    NEXT_NODE_PINNED_FIELD_NUMBER: _ClassVar[int]
    NEXT_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    model_dir: str
    start: int
    end: int
    is_head: bool
    is_tail: bool
    dtype: str
    next_node: str
    next_node_pinned: bool
    next_node_id: str
    def __init__(self, model_id: _Optional[str] = ..., model_dir: _Optional[str] = ..., start: _Optional[int] = ..., end: _Optional[int] = ..., is_head: _Optional[bool] = ..., is_tail: _Optional[bool] = ..., dtype: _Optional[str] = ..., next_node: _Optional[str] = ..., next_node_pinned: _Optional[bool] = ..., next_node_id: _Optional[str] = ...) -> None: ...

class NodeInfo(_message.Message):
    __slots__ = ("node_id", "version", "device", "memory_total_bytes", "memory_used_bytes", "weights_bytes", "cache_bytes", "cache_budget_bytes", "shard", "active_requests", "steps_total", "step_latency_ms", "uptime_s", "weights_fetched_bytes", "weights_fetch_total_bytes", "weights_received_bytes", "cached_models", "positions_computed", "prefix_snapshots", "prefix_snapshot_bytes", "prefix_budget_bytes", "prefix_resumes", "links", "hop", "shard_loads", "busy_seconds_total", "batches_total", "next_hop_rtt_ms", "chip", "os", "cpu_count", "mtp_steps_decided", "mtp_steps_plain", "mtp_drafts_chosen", "epoch", "mlx_active_bytes", "mlx_cache_bytes", "mlx_peak_bytes", "mlx_cache_limit_bytes", "step_phases", "steps_ahead_used", "steps_ahead_undone", "step_port", "step_records", "keeps_awake", "keep_awake_note", "kernel_builds")
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
    WEIGHTS_FETCHED_BYTES_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FETCH_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_RECEIVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CACHED_MODELS_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_COMPUTED_FIELD_NUMBER: _ClassVar[int]
    PREFIX_SNAPSHOTS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_SNAPSHOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_RESUMES_FIELD_NUMBER: _ClassVar[int]
    LINKS_FIELD_NUMBER: _ClassVar[int]
    HOP_FIELD_NUMBER: _ClassVar[int]
    SHARD_LOADS_FIELD_NUMBER: _ClassVar[int]
    BUSY_SECONDS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    BATCHES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NEXT_HOP_RTT_MS_FIELD_NUMBER: _ClassVar[int]
    CHIP_FIELD_NUMBER: _ClassVar[int]
    OS_FIELD_NUMBER: _ClassVar[int]
    CPU_COUNT_FIELD_NUMBER: _ClassVar[int]
    MTP_STEPS_DECIDED_FIELD_NUMBER: _ClassVar[int]
    MTP_STEPS_PLAIN_FIELD_NUMBER: _ClassVar[int]
    MTP_DRAFTS_CHOSEN_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    MLX_ACTIVE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MLX_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MLX_PEAK_BYTES_FIELD_NUMBER: _ClassVar[int]
    MLX_CACHE_LIMIT_BYTES_FIELD_NUMBER: _ClassVar[int]
    STEP_PHASES_FIELD_NUMBER: _ClassVar[int]
    STEPS_AHEAD_USED_FIELD_NUMBER: _ClassVar[int]
    STEPS_AHEAD_UNDONE_FIELD_NUMBER: _ClassVar[int]
    STEP_PORT_FIELD_NUMBER: _ClassVar[int]
    STEP_RECORDS_FIELD_NUMBER: _ClassVar[int]
    KEEPS_AWAKE_FIELD_NUMBER: _ClassVar[int]
    KEEP_AWAKE_NOTE_FIELD_NUMBER: _ClassVar[int]
    KERNEL_BUILDS_FIELD_NUMBER: _ClassVar[int]
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
    weights_fetched_bytes: int
    weights_fetch_total_bytes: int
    weights_received_bytes: int
    cached_models: _containers.RepeatedCompositeFieldContainer[WeightsCachedModel]
    positions_computed: int
    prefix_snapshots: int
    prefix_snapshot_bytes: int
    prefix_budget_bytes: int
    prefix_resumes: int
    links: _containers.RepeatedCompositeFieldContainer[NodeLink]
    hop: HopLink
    shard_loads: int
    busy_seconds_total: float
    batches_total: int
    next_hop_rtt_ms: float
    chip: str
    os: str
    cpu_count: int
    mtp_steps_decided: int
    mtp_steps_plain: int
    mtp_drafts_chosen: int
    epoch: int
    mlx_active_bytes: int
    mlx_cache_bytes: int
    mlx_peak_bytes: int
    mlx_cache_limit_bytes: int
    step_phases: StepPhases
    steps_ahead_used: int
    steps_ahead_undone: int
    step_port: int
    step_records: bool
    keeps_awake: bool
    keep_awake_note: str
    kernel_builds: str
    def __init__(self, node_id: _Optional[str] = ..., version: _Optional[str] = ..., device: _Optional[str] = ..., memory_total_bytes: _Optional[int] = ..., memory_used_bytes: _Optional[int] = ..., weights_bytes: _Optional[int] = ..., cache_bytes: _Optional[int] = ..., cache_budget_bytes: _Optional[int] = ..., shard: _Optional[_Union[ShardSpec, _Mapping]] = ..., active_requests: _Optional[int] = ..., steps_total: _Optional[int] = ..., step_latency_ms: _Optional[float] = ..., uptime_s: _Optional[float] = ..., weights_fetched_bytes: _Optional[int] = ..., weights_fetch_total_bytes: _Optional[int] = ..., weights_received_bytes: _Optional[int] = ..., cached_models: _Optional[_Iterable[_Union[WeightsCachedModel, _Mapping]]] = ..., positions_computed: _Optional[int] = ..., prefix_snapshots: _Optional[int] = ..., prefix_snapshot_bytes: _Optional[int] = ..., prefix_budget_bytes: _Optional[int] = ..., prefix_resumes: _Optional[int] = ..., links: _Optional[_Iterable[_Union[NodeLink, _Mapping]]] = ..., hop: _Optional[_Union[HopLink, _Mapping]] = ..., shard_loads: _Optional[int] = ..., busy_seconds_total: _Optional[float] = ..., batches_total: _Optional[int] = ..., next_hop_rtt_ms: _Optional[float] = ..., chip: _Optional[str] = ..., os: _Optional[str] = ..., cpu_count: _Optional[int] = ..., mtp_steps_decided: _Optional[int] = ..., mtp_steps_plain: _Optional[int] = ..., mtp_drafts_chosen: _Optional[int] = ..., epoch: _Optional[int] = ..., mlx_active_bytes: _Optional[int] = ..., mlx_cache_bytes: _Optional[int] = ..., mlx_peak_bytes: _Optional[int] = ..., mlx_cache_limit_bytes: _Optional[int] = ..., step_phases: _Optional[_Union[StepPhases, _Mapping]] = ..., steps_ahead_used: _Optional[int] = ..., steps_ahead_undone: _Optional[int] = ..., step_port: _Optional[int] = ..., step_records: _Optional[bool] = ..., keeps_awake: _Optional[bool] = ..., keep_awake_note: _Optional[str] = ..., kernel_builds: _Optional[str] = ...) -> None: ...

class StepPhases(_message.Message):
    __slots__ = ("queued_ms", "handoff_ms", "decode_ms", "layers_ms", "encode_ms", "send_ms")
    QUEUED_MS_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_MS_FIELD_NUMBER: _ClassVar[int]
    DECODE_MS_FIELD_NUMBER: _ClassVar[int]
    LAYERS_MS_FIELD_NUMBER: _ClassVar[int]
    ENCODE_MS_FIELD_NUMBER: _ClassVar[int]
    SEND_MS_FIELD_NUMBER: _ClassVar[int]
    queued_ms: float
    handoff_ms: float
    decode_ms: float
    layers_ms: float
    encode_ms: float
    send_ms: float
    def __init__(self, queued_ms: _Optional[float] = ..., handoff_ms: _Optional[float] = ..., decode_ms: _Optional[float] = ..., layers_ms: _Optional[float] = ..., encode_ms: _Optional[float] = ..., send_ms: _Optional[float] = ...) -> None: ...

class LoadShardRequest(_message.Message):
    __slots__ = ("model_dir", "start", "end", "is_head", "is_tail", "dtype", "next_node", "cache_budget_bytes", "model_id", "model_digest", "weights_port", "weights_address", "prefix_budget_bytes", "next_node_links", "next_node_id", "epoch", "micro_batches", "warmup")
    MODEL_DIR_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    IS_HEAD_FIELD_NUMBER: _ClassVar[int]
    IS_TAIL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NEXT_NODE_FIELD_NUMBER: _ClassVar[int]
    CACHE_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_DIGEST_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_PORT_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    NEXT_NODE_LINKS_FIELD_NUMBER: _ClassVar[int]
    NEXT_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCHES_FIELD_NUMBER: _ClassVar[int]
    WARMUP_FIELD_NUMBER: _ClassVar[int]
    model_dir: str
    start: int
    end: int
    is_head: bool
    is_tail: bool
    dtype: str
    next_node: str
    cache_budget_bytes: int
    model_id: str
    model_digest: str
    weights_port: int
    weights_address: str
    prefix_budget_bytes: int
    next_node_links: _containers.RepeatedCompositeFieldContainer[NodeLink]
    next_node_id: str
    epoch: int
    micro_batches: int
    warmup: WarmupPlan
    def __init__(self, model_dir: _Optional[str] = ..., start: _Optional[int] = ..., end: _Optional[int] = ..., is_head: _Optional[bool] = ..., is_tail: _Optional[bool] = ..., dtype: _Optional[str] = ..., next_node: _Optional[str] = ..., cache_budget_bytes: _Optional[int] = ..., model_id: _Optional[str] = ..., model_digest: _Optional[str] = ..., weights_port: _Optional[int] = ..., weights_address: _Optional[str] = ..., prefix_budget_bytes: _Optional[int] = ..., next_node_links: _Optional[_Iterable[_Union[NodeLink, _Mapping]]] = ..., next_node_id: _Optional[str] = ..., epoch: _Optional[int] = ..., micro_batches: _Optional[int] = ..., warmup: _Optional[_Union[WarmupPlan, _Mapping]] = ...) -> None: ...

class WarmupPlan(_message.Message):
    __slots__ = ("prefill_chunk", "max_running", "max_context", "mtp_depth", "mtp_depth_auto", "has_mtp")
    PREFILL_CHUNK_FIELD_NUMBER: _ClassVar[int]
    MAX_RUNNING_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    MTP_DEPTH_FIELD_NUMBER: _ClassVar[int]
    MTP_DEPTH_AUTO_FIELD_NUMBER: _ClassVar[int]
    HAS_MTP_FIELD_NUMBER: _ClassVar[int]
    prefill_chunk: int
    max_running: int
    max_context: int
    mtp_depth: int
    mtp_depth_auto: bool
    has_mtp: bool
    def __init__(self, prefill_chunk: _Optional[int] = ..., max_running: _Optional[int] = ..., max_context: _Optional[int] = ..., mtp_depth: _Optional[int] = ..., mtp_depth_auto: _Optional[bool] = ..., has_mtp: _Optional[bool] = ...) -> None: ...

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
    __slots__ = ("sampling", "mtp", "logprobs", "top_logprobs", "mtp_depth", "mtp_depth_auto")
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MTP_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MTP_DEPTH_FIELD_NUMBER: _ClassVar[int]
    MTP_DEPTH_AUTO_FIELD_NUMBER: _ClassVar[int]
    sampling: SamplingParams
    mtp: bool
    logprobs: bool
    top_logprobs: int
    mtp_depth: int
    mtp_depth_auto: bool
    def __init__(self, sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., mtp: _Optional[bool] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., mtp_depth: _Optional[int] = ..., mtp_depth_auto: _Optional[bool] = ...) -> None: ...

class StepEntry(_message.Message):
    __slots__ = ("request_id", "tokens", "position", "draft_len", "rollback", "sample", "options", "token_masks", "prefix_from", "prefix_save", "next_token")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    DRAFT_LEN_FIELD_NUMBER: _ClassVar[int]
    ROLLBACK_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_MASKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FROM_FIELD_NUMBER: _ClassVar[int]
    PREFIX_SAVE_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tokens: _containers.RepeatedScalarFieldContainer[int]
    position: int
    draft_len: int
    rollback: int
    sample: bool
    options: RequestOptions
    token_masks: _containers.RepeatedScalarFieldContainer[bytes]
    prefix_from: int
    prefix_save: int
    next_token: int
    def __init__(self, request_id: _Optional[str] = ..., tokens: _Optional[_Iterable[int]] = ..., position: _Optional[int] = ..., draft_len: _Optional[int] = ..., rollback: _Optional[int] = ..., sample: _Optional[bool] = ..., options: _Optional[_Union[RequestOptions, _Mapping]] = ..., token_masks: _Optional[_Iterable[bytes]] = ..., prefix_from: _Optional[int] = ..., prefix_save: _Optional[int] = ..., next_token: _Optional[int] = ...) -> None: ...

class StepBatch(_message.Message):
    __slots__ = ("entries", "hidden", "sequence", "epoch")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[StepEntry]
    hidden: Tensor
    sequence: int
    epoch: int
    def __init__(self, entries: _Optional[_Iterable[_Union[StepEntry, _Mapping]]] = ..., hidden: _Optional[_Union[Tensor, _Mapping]] = ..., sequence: _Optional[int] = ..., epoch: _Optional[int] = ...) -> None: ...

class StepEvent(_message.Message):
    __slots__ = ("sequence",)
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    def __init__(self, sequence: _Optional[int] = ...) -> None: ...

class ResultsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResultEntry(_message.Message):
    __slots__ = ("request_id", "tokens", "keep", "drafts", "drafted", "accepted", "logprobs", "has_logprobs", "top_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    KEEP_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    HAS_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tokens: _containers.RepeatedScalarFieldContainer[int]
    keep: int
    drafts: _containers.RepeatedScalarFieldContainer[int]
    drafted: int
    accepted: int
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    has_logprobs: bool
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    def __init__(self, request_id: _Optional[str] = ..., tokens: _Optional[_Iterable[int]] = ..., keep: _Optional[int] = ..., drafts: _Optional[_Iterable[int]] = ..., drafted: _Optional[int] = ..., accepted: _Optional[int] = ..., logprobs: _Optional[_Iterable[float]] = ..., has_logprobs: _Optional[bool] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ...) -> None: ...

class TopLogprobs(_message.Message):
    __slots__ = ("tokens", "logprobs")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

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
    __slots__ = ("results", "errors", "prefix_dropped", "epoch")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_DROPPED_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[ResultEntry]
    errors: _containers.RepeatedCompositeFieldContainer[StepError]
    prefix_dropped: _containers.RepeatedScalarFieldContainer[int]
    epoch: int
    def __init__(self, results: _Optional[_Iterable[_Union[ResultEntry, _Mapping]]] = ..., errors: _Optional[_Iterable[_Union[StepError, _Mapping]]] = ..., prefix_dropped: _Optional[_Iterable[int]] = ..., epoch: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_id", "prefix_save", "prefix_positions")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PREFIX_SAVE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prefix_save: int
    prefix_positions: int
    def __init__(self, request_id: _Optional[str] = ..., prefix_save: _Optional[int] = ..., prefix_positions: _Optional[int] = ...) -> None: ...

class ReleaseReply(_message.Message):
    __slots__ = ("released", "prefix_saved")
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    PREFIX_SAVED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    prefix_saved: bool
    def __init__(self, released: _Optional[bool] = ..., prefix_saved: _Optional[bool] = ...) -> None: ...

class PrefixSnapshotDropRequest(_message.Message):
    __slots__ = ("snapshot_ids",)
    SNAPSHOT_IDS_FIELD_NUMBER: _ClassVar[int]
    snapshot_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, snapshot_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class PrefixSnapshotDropReply(_message.Message):
    __slots__ = ("dropped",)
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    dropped: int
    def __init__(self, dropped: _Optional[int] = ...) -> None: ...

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

class WeightsManifestRequest(_message.Message):
    __slots__ = ("model_digest", "omit_manifest")
    MODEL_DIGEST_FIELD_NUMBER: _ClassVar[int]
    OMIT_MANIFEST_FIELD_NUMBER: _ClassVar[int]
    model_digest: str
    omit_manifest: bool
    def __init__(self, model_digest: _Optional[str] = ..., omit_manifest: _Optional[bool] = ...) -> None: ...

class WeightsManifestReply(_message.Message):
    __slots__ = ("manifest_json", "bulk_port")
    MANIFEST_JSON_FIELD_NUMBER: _ClassVar[int]
    BULK_PORT_FIELD_NUMBER: _ClassVar[int]
    manifest_json: bytes
    bulk_port: int
    def __init__(self, manifest_json: _Optional[bytes] = ..., bulk_port: _Optional[int] = ...) -> None: ...

class WeightsChunkRef(_message.Message):
    __slots__ = ("tensor", "chunk")
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    tensor: str
    chunk: int
    def __init__(self, tensor: _Optional[str] = ..., chunk: _Optional[int] = ...) -> None: ...

class WeightsFetchRequest(_message.Message):
    __slots__ = ("model_digest", "node_id", "start", "end", "is_head", "is_tail", "chunks", "files", "total_bytes")
    MODEL_DIGEST_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    IS_HEAD_FIELD_NUMBER: _ClassVar[int]
    IS_TAIL_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    model_digest: str
    node_id: str
    start: int
    end: int
    is_head: bool
    is_tail: bool
    chunks: _containers.RepeatedCompositeFieldContainer[WeightsChunkRef]
    files: _containers.RepeatedScalarFieldContainer[str]
    total_bytes: int
    def __init__(self, model_digest: _Optional[str] = ..., node_id: _Optional[str] = ..., start: _Optional[int] = ..., end: _Optional[int] = ..., is_head: _Optional[bool] = ..., is_tail: _Optional[bool] = ..., chunks: _Optional[_Iterable[_Union[WeightsChunkRef, _Mapping]]] = ..., files: _Optional[_Iterable[str]] = ..., total_bytes: _Optional[int] = ...) -> None: ...

class WeightsChunk(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...

class WeightsCachedModel(_message.Message):
    __slots__ = ("digest", "name", "disk_bytes", "model_bytes", "present_bytes", "last_used")
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    DISK_BYTES_FIELD_NUMBER: _ClassVar[int]
    MODEL_BYTES_FIELD_NUMBER: _ClassVar[int]
    PRESENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAST_USED_FIELD_NUMBER: _ClassVar[int]
    digest: str
    name: str
    disk_bytes: int
    model_bytes: int
    present_bytes: int
    last_used: float
    def __init__(self, digest: _Optional[str] = ..., name: _Optional[str] = ..., disk_bytes: _Optional[int] = ..., model_bytes: _Optional[int] = ..., present_bytes: _Optional[int] = ..., last_used: _Optional[float] = ...) -> None: ...

class NodeLink(_message.Message):
    __slots__ = ("address", "interface", "kind")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    INTERFACE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    address: str
    interface: str
    kind: str
    def __init__(self, address: _Optional[str] = ..., interface: _Optional[str] = ..., kind: _Optional[str] = ...) -> None: ...

class HopLink(_message.Message):
    __slots__ = ("address", "kind", "interface", "rtt_ms", "measured", "tried", "failovers", "failbacks", "last_failover", "degraded", "best_address")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    INTERFACE_FIELD_NUMBER: _ClassVar[int]
    RTT_MS_FIELD_NUMBER: _ClassVar[int]
    MEASURED_FIELD_NUMBER: _ClassVar[int]
    TRIED_FIELD_NUMBER: _ClassVar[int]
    FAILOVERS_FIELD_NUMBER: _ClassVar[int]
    FAILBACKS_FIELD_NUMBER: _ClassVar[int]
    LAST_FAILOVER_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_FIELD_NUMBER: _ClassVar[int]
    BEST_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    address: str
    kind: str
    interface: str
    rtt_ms: float
    measured: bool
    tried: _containers.RepeatedCompositeFieldContainer[LinkTried]
    failovers: int
    failbacks: int
    last_failover: str
    degraded: bool
    best_address: str
    def __init__(self, address: _Optional[str] = ..., kind: _Optional[str] = ..., interface: _Optional[str] = ..., rtt_ms: _Optional[float] = ..., measured: _Optional[bool] = ..., tried: _Optional[_Iterable[_Union[LinkTried, _Mapping]]] = ..., failovers: _Optional[int] = ..., failbacks: _Optional[int] = ..., last_failover: _Optional[str] = ..., degraded: _Optional[bool] = ..., best_address: _Optional[str] = ...) -> None: ...

class LinkTried(_message.Message):
    __slots__ = ("address", "rtt_ms", "answered")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RTT_MS_FIELD_NUMBER: _ClassVar[int]
    ANSWERED_FIELD_NUMBER: _ClassVar[int]
    address: str
    rtt_ms: float
    answered: bool
    def __init__(self, address: _Optional[str] = ..., rtt_ms: _Optional[float] = ..., answered: _Optional[bool] = ...) -> None: ...

class LinkPingRequest(_message.Message):
    __slots__ = ("payload",)
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    payload: bytes
    def __init__(self, payload: _Optional[bytes] = ...) -> None: ...

class LinkPingReply(_message.Message):
    __slots__ = ("node_id", "payload")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    payload: bytes
    def __init__(self, node_id: _Optional[str] = ..., payload: _Optional[bytes] = ...) -> None: ...
