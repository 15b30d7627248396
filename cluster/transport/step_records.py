"""A batch of plain decode steps as fixed-size records: the step stream's short form.

A node hands each decode step to its successor, so the step's codec runs once per hop per
token, on a thread that has just woken from waiting for it (its caches cold). As a `StepBatch`
(`cluster.transport.wire`) it costs protobuf's Python objects, built and read on that path. A
step whose entries carry nothing but ids, tokens and positions packs into records that `struct`
reads and writes in a few calls, and its hidden states follow as raw bytes, which the node copies
into MLX or its doorbell as they are.

    header   u64 sequence, u64 epoch, u16 entries, u8 dtype (0: no hidden states, else 1 +
             its index in DTYPES), u32 width (the hidden size)
    entry    u16 request id bytes, u8 tokens, u8 drafts, u32 position, u16 rollback, then the
             id (UTF-8) and the tokens (u32 each)
    hidden   [1, positions, width] of that dtype, little-endian, row-major: to the end

Only steps that need nothing else take this form (`encode` returns None for the rest: a
request's first step with its options, masks, prefix snapshots, a replay's next token, a
prefill chunk that samples nothing), and only on a step stream whose listener says it reads
them (`NodeInfo.step_records`); everything else travels as a `StepBatch`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import mlx.core as mx

from cluster.messages import StepRequest
from cluster.transport.wire import WireError, array_from_bytes, step_batch_bytes

HEADER = struct.Struct("<QQHBI")
ENTRY = struct.Struct("<HBBIH")
DTYPES = (("bfloat16", 2), ("float16", 2), ("float32", 4))  # (name, bytes per value)
_CODES = {getattr(mx, name): code for code, (name, _) in enumerate(DTYPES, start=1)}
_TOKENS = [struct.Struct(f"<{n}I") for n in range(256)]  # an entry's u32 tokens, by count


@dataclass(slots=True)  # not frozen: a frozen __init__ sets each field the slow way, per hop
class StepRecords:
    """A decoded records frame: a `StepBatch`'s `entries`, `sequence` and `epoch`, and its
    hidden states as raw bytes (`dtype` None where it has none). Read only."""

    entries: list[StepRequest]
    sequence: int
    epoch: int
    dtype: str | None
    hidden_shape: tuple[int, int, int]
    hidden: bytes

    def hidden_array(self) -> mx.array | None:
        if self.dtype is None:
            return None
        return array_from_bytes(self.hidden, self.dtype, self.hidden_shape)


def plain(step: StepRequest) -> bool:
    """Whether a step carries nothing but its id, tokens, drafts, position and rollback."""
    return (
        step.sample
        and step.options is None
        and not step.token_masks
        and not step.prefix_from
        and not step.prefix_save
        and step.next_token is None
    )


def encode(
    entries: list[StepRequest], hidden: mx.array | None, sequence: int, epoch: int = 0
) -> bytes | None:
    """The records of a batch of plain steps with its hidden states ([1, positions, width]),
    or None where it does not fit them (send it as a `StepBatch`)."""
    positions = 0
    for e in entries:  # one loop, not two generators: this runs once per hop per step
        if not plain(e):
            return None
        positions += len(e.tokens)
    if not positions:
        return None
    dtype, width = 0, 0
    if hidden is not None:
        shape = hidden.shape
        if len(shape) != 3 or shape[0] != 1 or shape[1] != positions:
            return None
        dtype, width = _CODES.get(hidden.dtype, 0), shape[2]
        if not dtype:
            return None
    try:
        parts = [HEADER.pack(sequence, epoch, len(entries), dtype, width)]
        for e in entries:
            rid = e.request_id.encode()
            n = len(e.tokens)
            parts += (
                ENTRY.pack(len(rid), n, e.draft_len, e.position, e.rollback),
                rid,
                _TOKENS[n].pack(*e.tokens),  # n < 256: ENTRY's u8 refused more already
            )
    except struct.error:  # a value out of the records' range: protobuf's varints take it
        return None
    if hidden is not None:
        data = memoryview(hidden)  # evaluates a lazy array
        parts.append(data if data.c_contiguous else data.tobytes())
    return b"".join(parts)


def decode(data: bytes | memoryview) -> StepRecords:
    """The records of `data`; `WireError` where it is not a whole records frame, and
    `RequestError` for an entry that is not a valid step."""
    try:
        sequence, epoch, count, dtype, width = HEADER.unpack_from(data)
        offset = HEADER.size
        entries = []
        positions = 0
        for _ in range(count):
            rid_len, n, drafts, position, rollback = ENTRY.unpack_from(data, offset)
            offset += ENTRY.size
            if offset + rid_len > len(data):
                raise struct.error("a request id past the frame's end")
            rid = str(data[offset : offset + rid_len], "utf-8")
            tokens = _TOKENS[n].unpack_from(data, offset + rid_len)
            offset += rid_len + 4 * n
            positions += n
            entries.append(_plain_step(rid, tokens, position, drafts, rollback))
    except (struct.error, UnicodeDecodeError) as error:
        raise WireError(f"a malformed step records frame ({error})") from None
    if dtype > len(DTYPES):
        raise WireError(f"a step records frame of dtype code {dtype}")
    name, itemsize = DTYPES[dtype - 1] if dtype else (None, 0)
    hidden = bytes(data[offset:])
    if len(hidden) != positions * width * itemsize:
        raise WireError(
            f"a step records frame's hidden states of {name} {[1, positions, width]} in "
            f"{len(hidden)} bytes"
        )
    return StepRecords(entries, sequence, epoch, name, (1, positions, width), hidden)


_new, _set = object.__new__, object.__setattr__


def _plain_step(
    request_id: str, tokens: tuple[int, ...], position: int, draft_len: int, rollback: int
) -> StepRequest:
    """`StepRequest(request_id, tokens, position, draft_len, rollback)`, its other fields at
    their defaults, built without the dataclass's `__init__`: a frozen dataclass's `__init__`
    sets each field through `object.__setattr__` and checks them all, once per hop per step. A
    records entry can only break the draft rule (its counts are unsigned); that one goes to the
    checks."""
    if not 0 <= draft_len < len(tokens):
        return StepRequest(request_id, tokens, position, draft_len, rollback)  # raises
    step = _new(StepRequest)
    _set(step, "request_id", request_id)
    _set(step, "tokens", tokens)
    _set(step, "position", position)
    _set(step, "draft_len", draft_len)
    _set(step, "rollback", rollback)
    _set(step, "sample", True)
    _set(step, "options", None)
    _set(step, "token_masks", ())
    _set(step, "prefix_from", 0)
    _set(step, "prefix_save", 0)
    _set(step, "next_token", None)
    return step


def step_batch_of(data: bytes) -> bytes:
    """A records frame as the serialized `StepBatch` it stands for (a stream that does not
    take records: the successor's stream reopened over gRPC)."""
    records = decode(data)
    return step_batch_bytes(
        records.entries, records.hidden_array(), records.sequence, records.epoch
    )


__all__ = ["DTYPES", "StepRecords", "decode", "encode", "plain", "step_batch_of"]
