"""The codec between protobuf (`proto/cluster.proto`) and the internal messages.

Protobuf never leaks past this module: the node and the coordinator hand it the dataclasses of
`cluster.messages` and `mx.array`s and get them back. Tensors travel as raw little-endian bytes
plus dtype and shape; bfloat16 bytes are copied as they are (decoded as a uint16 array viewed as
bfloat16), never through float32.

Zero is never read as "unset": the fields where zero means something are proto3 `optional`,
and the decoders test `HasField`, so an absent field takes the dataclass default and a present
zero stays zero (temperature 0 is greedy). Invalid values surface as `RequestError` (raised by
the dataclasses) or `WireError` (a malformed tensor, an unencodable value).

This is on the per-token path (`python -m benchmarks.hop` times it), so the functions stay
plain loops over the fields; plain decode steps between nodes take a shorter form still
(`cluster.transport.step_records`). A node sends its successor `step_batch_bytes`
(`forwarded_step_bytes` where the entries are the ones it received): the serialized message,
built with the hidden states copied once. Through a protobuf message they would be copied three
times, into fresh buffers each time, and a long prefill chunk's hidden states would pay the page
faults of each fresh buffer.
"""

from __future__ import annotations

import functools
import math

import grpc
import mlx.core as mx

from cluster.messages import RequestOptions, SamplingParams, StepRequest, StepResult
from proto import cluster_pb2 as pb

__all__ = [
    "MAX_MESSAGE_BYTES",
    "ErrorEntry",
    "WireError",
    "array_from_bytes",
    "forwarded_step_bytes",
    "grpc_channel_options",
    "grpc_server_options",
    "options_from_proto",
    "options_to_proto",
    "results_from_proto",
    "results_to_proto",
    "sampling_from_proto",
    "sampling_to_proto",
    "step_batch_bytes",
    "step_batch_from_proto",
    "step_batch_to_proto",
    "tensor_from_proto",
    "tensor_to_proto",
    "varint",
]

MAX_MESSAGE_BYTES = 256 * 1024 * 1024  # a long prefill chunk's hidden states fit with room


class WireError(ValueError):
    """A message that cannot be converted (malformed tensor, value out of the wire's range)."""


# Errors travel as (request_id, status code, message).
ErrorEntry = tuple[str, grpc.StatusCode, str]

# wire name -> (mx dtype, the buffer format of its values, bytes per value). Python's buffers
# have no bfloat16 and memoryview.cast takes no float16: both arrive as uint16 ("H") and are
# viewed as their dtype.
_DTYPES: dict[str, tuple[mx.Dtype, str, int]] = {
    "bfloat16": (mx.bfloat16, "H", 2),
    "float16": (mx.float16, "H", 2),
    "float32": (mx.float32, "f", 4),
}
_DTYPE_NAMES = {spec[0]: name for name, spec in _DTYPES.items()}
_STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}
_SAMPLING = SamplingParams()
_OPTIONS = RequestOptions()
_SAMPLE_DEFAULT = True  # StepRequest.sample


# ---- gRPC settings shared by the node daemon, the coordinator and the benchmark ----


def _common_options() -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        # Liveness: a silent peer breaks the stream within ~15 s even with no call in flight.
        ("grpc.keepalive_time_ms", 10_000),
        ("grpc.keepalive_timeout_ms", 5_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


def grpc_channel_options() -> list[tuple[str, int]]:
    """Channel arguments for every node channel (`grpc.aio.insecure_channel(..., options=)`)."""
    return [
        *_common_options(),
        # Retries make the channel buffer each message of a stream for a possible replay; a
        # step stream is never replayed (the caller fails the requests instead).
        ("grpc.enable_retries", 0),
        ("grpc.default_compression_algorithm", 0),  # GRPC_COMPRESS_NONE
    ]


def grpc_server_options() -> list[tuple[str, int]]:
    """Server arguments for every node server (`grpc.aio.server(options=)`)."""
    return [
        *_common_options(),
        # Fail loudly if the port is taken instead of silently sharing it with a stale node.
        ("grpc.so_reuseport", 0),
        # Accept the clients' keepalive pings (the default would answer them with GOAWAY).
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
        ("grpc.http2.max_ping_strikes", 0),
    ]


# ---- tensors ----


def _fill_tensor(t: pb.Tensor, a: mx.array) -> None:
    name = _DTYPE_NAMES.get(a.dtype)
    if name is None:
        raise WireError(f"tensor dtype {a.dtype} is not one of {sorted(_DTYPES)}")
    # The buffer protocol exports bfloat16 too; bytes() copies in C order even from a strided
    # array. An unevaluated `a` is evaluated here: encode the output of the step's own eval.
    t.data = bytes(memoryview(a))
    t.dtype = name
    t.shape.extend(a.shape)


def tensor_to_proto(a: mx.array) -> pb.Tensor:
    """An array as raw bytes + dtype + shape (bfloat16, float16 or float32)."""
    t = pb.Tensor()
    _fill_tensor(t, a)
    return t


def dtype_name(dtype: mx.Dtype) -> str | None:
    """A dtype's name on the wire (None: one the wire does not carry)."""
    return _DTYPE_NAMES.get(dtype)


def tensor_from_proto(t: pb.Tensor) -> mx.array:
    """The array of a `Tensor`, bit-exact; `WireError` if dtype, shape and bytes disagree."""
    return array_from_bytes(t.data, t.dtype, tuple(t.shape))


def array_from_bytes(data: bytes, wire_dtype: str, shape: tuple[int, ...]) -> mx.array:
    """The array of raw little-endian bytes of `wire_dtype` (a name of `_DTYPES`);
    `WireError` if they do not make `shape`."""
    dtype, values, nbytes = _tensor_spec(wire_dtype, shape)
    if len(data) != nbytes:
        raise WireError(
            f"tensor of shape {list(shape)} and dtype {wire_dtype} needs {nbytes} bytes, "
            f"got {len(data)}"
        )
    if not nbytes:  # memoryview.cast refuses a zero in the shape
        return mx.zeros(shape, dtype)
    # MLX copies the buffer straight in, without numpy's intermediate array: once a hop.
    a = mx.array(memoryview(data).cast(values, shape))
    # bfloat16, float16: a lazy view of the uint16 copy, which the consumer's eval absorbs.
    return a if a.dtype == dtype else a.view(dtype)


@functools.lru_cache(maxsize=64)  # a decode step's dtype and shape repeat token after token
def _tensor_spec(name: str, shape: tuple[int, ...]) -> tuple[mx.Dtype, str, int]:
    """(mx dtype, buffer format of its values, byte count) of a tensor on the wire."""
    spec = _DTYPES.get(name)
    if spec is None:
        raise WireError(f"tensor dtype {name!r} is not one of {sorted(_DTYPES)}")
    if min(shape, default=0) < 0:
        raise WireError(f"tensor shape {list(shape)} has a negative dimension")
    dtype, values, itemsize = spec
    return dtype, values, math.prod(shape) * itemsize


# ---- request options ----


def sampling_to_proto(s: SamplingParams, m: pb.SamplingParams | None = None) -> pb.SamplingParams:
    """Every field is written, zeros included; `seed` only when set."""
    m = pb.SamplingParams() if m is None else m
    m.temperature = s.temperature
    m.top_p = s.top_p
    m.top_k = s.top_k
    m.min_p = s.min_p
    if s.seed is not None:
        m.seed = s.seed
    return m


def sampling_from_proto(m: pb.SamplingParams) -> SamplingParams:
    """Absent fields take the dataclass defaults; present zeros stay zero."""
    d = _SAMPLING
    return SamplingParams(
        temperature=m.temperature if m.HasField("temperature") else d.temperature,
        top_p=m.top_p if m.HasField("top_p") else d.top_p,
        top_k=m.top_k if m.HasField("top_k") else d.top_k,
        min_p=m.min_p if m.HasField("min_p") else d.min_p,
        seed=m.seed if m.HasField("seed") else d.seed,
    )


def options_to_proto(o: RequestOptions, m: pb.RequestOptions | None = None) -> pb.RequestOptions:
    m = pb.RequestOptions() if m is None else m
    sampling_to_proto(o.sampling, m.sampling)
    m.mtp = o.mtp
    m.logprobs = o.logprobs
    m.top_logprobs = o.top_logprobs
    if o.mtp_depth == "auto":
        m.mtp_depth_auto = True
    else:
        m.mtp_depth = o.mtp_depth
    return m


def options_from_proto(m: pb.RequestOptions) -> RequestOptions:
    return RequestOptions(
        sampling=sampling_from_proto(m.sampling) if m.HasField("sampling") else _OPTIONS.sampling,
        mtp=m.mtp if m.HasField("mtp") else _OPTIONS.mtp,
        logprobs=m.logprobs,
        top_logprobs=m.top_logprobs,
        mtp_depth="auto"
        if m.mtp_depth_auto
        else (m.mtp_depth if m.HasField("mtp_depth") else _OPTIONS.mtp_depth),
    )


# ---- the step stream ----


def step_batch_to_proto(
    entries: list[StepRequest], hidden: mx.array | None, sequence: int, epoch: int = 0
) -> pb.StepBatch:
    """One pipeline step: the requests' entries, their hidden states (None to the head)."""
    try:
        msg = pb.StepBatch(sequence=sequence, epoch=epoch)
        add = msg.entries.add
        for e in entries:
            m = add(
                request_id=e.request_id,
                tokens=e.tokens,
                position=e.position,
                draft_len=e.draft_len,
                rollback=e.rollback,
                sample=e.sample,
                token_masks=e.token_masks,
                prefix_from=e.prefix_from,
                prefix_save=e.prefix_save,
            )
            if e.options is not None:
                options_to_proto(e.options, m.options)
            if e.next_token is not None:
                m.next_token = e.next_token
        if hidden is not None:
            _fill_tensor(msg.hidden, hidden)
    except WireError:
        raise
    except (TypeError, ValueError) as exc:  # protobuf's range and type checks
        raise WireError(f"step batch {sequence} cannot be encoded: {exc}") from exc
    return msg


def step_batch_from_proto(msg: pb.StepBatch) -> tuple[list[StepRequest], mx.array | None, int]:
    """(entries, hidden or None, sequence); `RequestError` for an invalid entry."""
    hidden = tensor_from_proto(msg.hidden) if msg.HasField("hidden") else None
    return step_entries_from_proto(msg), hidden, msg.sequence


def step_entries_from_proto(msg: pb.StepBatch) -> list[StepRequest]:
    """The entries of a `StepBatch` alone; `RequestError` for an invalid entry."""
    return [
        StepRequest(
            request_id=m.request_id,
            tokens=tuple(m.tokens),
            position=m.position,
            draft_len=m.draft_len,
            rollback=m.rollback,
            sample=m.sample if m.HasField("sample") else _SAMPLE_DEFAULT,
            options=options_from_proto(m.options) if m.HasField("options") else None,
            token_masks=tuple(m.token_masks),
            prefix_from=m.prefix_from,
            prefix_save=m.prefix_save,
            next_token=m.next_token if m.HasField("next_token") else None,
        )
        for m in msg.entries
    ]


def step_batch_bytes(
    entries: list[StepRequest], hidden: mx.array | None, sequence: int, epoch: int = 0
) -> bytes:
    """`step_batch_to_proto(...).SerializeToString()`, byte for byte, with `hidden`'s bytes
    copied once, straight into the result (send it on a stream whose serializer passes bytes).

    Protobuf serializes the fields in field-number order, each key + length + bytes, so the
    small fields go through protobuf and only the tensor's data is placed by hand.
    """
    head = step_batch_to_proto(entries, None, 0).SerializeToString()
    return _step_batch_frame(head, hidden, sequence, epoch)


def forwarded_step_bytes(
    messages: list[pb.StepBatch], hidden: mx.array | None, epoch: int = 0
) -> bytes:
    """The step batch of every entry of `messages`, in order, with `hidden` (sequence 0), as
    `step_batch_bytes` would write it from their decoded entries: what a node sends on when
    every request of the batch it received ran. Each entry is serialized from the parsed
    message (protobuf's own code) instead of being built again from its `StepRequest`, which
    would be most of a decode step's encode."""
    serialize = pb.StepEntry.SerializeToString
    head = b"".join(
        _ENTRIES_KEY + varint(len(data)) + data
        for message in messages
        for data in map(serialize, message.entries)
    )
    return _step_batch_frame(head, hidden, 0, epoch)


def _step_batch_frame(head: bytes, hidden: mx.array | None, sequence: int, epoch: int) -> bytes:
    """A serialized StepBatch from its serialized entries, `hidden`, `sequence` and `epoch`."""
    # StepBatch: entries (1), hidden (2), sequence (3), epoch (170); proto3 writes no zeros.
    tail = _uint64_field(_SEQUENCE_KEY, sequence) + _uint64_field(_EPOCH_KEY, epoch)
    if hidden is None:
        return head + tail
    data = memoryview(hidden)  # evaluates a lazy array
    if not data.c_contiguous:
        data = memoryview(data.tobytes())  # row-major, as tensor_to_proto sends it
    # Tensor: data (1), dtype (2), shape (3); proto3 writes no empty bytes field.
    data_key = _TENSOR_DATA_KEY + varint(data.nbytes) if data.nbytes else b""
    dtype_shape = _tensor_dtype_shape(hidden.dtype, hidden.shape)
    tensor_size = len(data_key) + data.nbytes + len(dtype_shape)
    hidden_key = _STEP_BATCH_HIDDEN_KEY + varint(tensor_size)
    return b"".join((head, hidden_key, data_key, data, dtype_shape, tail))


def _uint64_field(key: bytes, value: int) -> bytes:
    if not 0 <= value < 1 << 64:
        raise WireError(f"{value} is out of the range of a uint64 field")
    return key + varint(value) if value else b""


@functools.lru_cache(maxsize=64)  # a decode step's shape repeats token after token
def _tensor_dtype_shape(dtype: mx.Dtype, shape: tuple[int, ...]) -> bytes:
    """The serialized dtype and shape fields of a `Tensor`."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        raise WireError(f"tensor dtype {dtype} is not one of {sorted(_DTYPES)}")
    return pb.Tensor(dtype=name, shape=shape).SerializeToString()


def varint(value: int) -> bytes:
    """Protobuf's base-128 varint of a non-negative int."""
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _key(message: type, field: str, wire_type: int) -> bytes:
    return varint(message.DESCRIPTOR.fields_by_name[field].number << 3 | wire_type)


# wire types: 0 varint, 2 length-delimited
_ENTRIES_KEY = _key(pb.StepBatch, "entries", 2)
_STEP_BATCH_HIDDEN_KEY = _key(pb.StepBatch, "hidden", 2)
_SEQUENCE_KEY = _key(pb.StepBatch, "sequence", 0)
_EPOCH_KEY = _key(pb.StepBatch, "epoch", 0)
_TENSOR_DATA_KEY = _key(pb.Tensor, "data", 2)


# ---- the results stream ----


def results_to_proto(
    results: list[StepResult], errors: list[ErrorEntry], epoch: int = 0
) -> pb.ResultBatch:
    """The tail's results and any node's per-request errors, in one message."""
    try:
        msg = pb.ResultBatch(epoch=epoch)
        add = msg.results.add
        for r in results:
            m = add(
                request_id=r.request_id,
                tokens=r.tokens,
                keep=r.keep,
                drafts=r.drafts,
                drafted=r.drafted,
                accepted=r.accepted,
            )
            if r.logprobs is not None:
                m.logprobs.extend(r.logprobs)
                m.has_logprobs = True
            for top in r.top_logprobs or ():
                m.top_logprobs.add(tokens=[t for t, _ in top], logprobs=[lp for _, lp in top])
        add_error = msg.errors.add
        for request_id, code, message in errors:
            add_error(request_id=request_id, code=code.value[0], message=message)
    except (TypeError, ValueError) as exc:
        raise WireError(f"result batch cannot be encoded: {exc}") from exc
    return msg


def results_from_proto(msg: pb.ResultBatch) -> tuple[list[StepResult], list[ErrorEntry]]:
    """(results, errors); an unknown status number reads as `StatusCode.UNKNOWN`."""
    results = [
        StepResult(
            request_id=m.request_id,
            tokens=tuple(m.tokens),
            keep=m.keep,
            drafts=tuple(m.drafts),
            drafted=m.drafted,
            accepted=m.accepted,
            logprobs=tuple(m.logprobs) if m.has_logprobs else None,
            top_logprobs=_top_logprobs_from_proto(m),
        )
        for m in msg.results
    ]
    errors = [
        (e.request_id, _STATUS_CODES.get(e.code, grpc.StatusCode.UNKNOWN), e.message)
        for e in msg.errors
    ]
    return results, errors


def _top_logprobs_from_proto(
    m: pb.ResultEntry,
) -> tuple[tuple[tuple[int, float], ...], ...] | None:
    if not m.top_logprobs:
        return None
    return tuple(tuple(zip(top.tokens, top.logprobs, strict=True)) for top in m.top_logprobs)


def step_phases_ms(info: pb.NodeInfo) -> dict[str, float]:
    """A node's `step_phases` by phase name ("layers": ms, ...); empty before its first step."""
    if not info.HasField("step_phases"):
        return {}
    phases = info.step_phases
    return {f.name.removesuffix("_ms"): getattr(phases, f.name) for f in phases.DESCRIPTOR.fields}
