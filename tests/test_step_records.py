"""`cluster.transport.step_records`: plain decode steps as records, the step stream's short form.
A batch comes back as the same steps and bit-exact hidden states; a step that needs more than
records hold is left to the `StepBatch` (None); a frame that is not whole records is refused."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from cluster.messages import RequestError, RequestOptions, StepRequest
from cluster.transport import step_records, wire
from proto import cluster_pb2 as pb

STEPS = [
    StepRequest("chatcmpl-0123456789abcdef", (151_643, 9_707), 1234, draft_len=1, rollback=1),
    StepRequest("r-é", (0,), 0),
    StepRequest("r-deep", tuple(range(9)), 2**32 - 10, draft_len=8, rollback=2**16 - 1),
]


def _bits(a: mx.array) -> bytes:
    return np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a).tobytes()


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32, None], ids=str)
def test_a_batch_comes_back_as_it_went(dtype) -> None:
    positions = sum(len(s.tokens) for s in STEPS)
    hidden = None
    if dtype is not None:
        hidden = (mx.random.normal((1, positions, 48), key=mx.random.key(1)) * 1e3).astype(dtype)
    data = step_records.encode(STEPS, hidden, 2**64 - 1, 7)
    records = step_records.decode(memoryview(data))
    assert (records.entries, records.sequence, records.epoch) == (STEPS, 2**64 - 1, 7)
    if dtype is None:
        assert records.dtype is None and records.hidden_array() is None
        return
    got = records.hidden_array()
    assert got.dtype == dtype and got.shape == hidden.shape and _bits(got) == _bits(hidden)
    assert records.hidden == bytes(memoryview(hidden))  # what a doorbell takes, as it is
    # The StepBatch it stands for, byte for byte (a stream reopened over gRPC).
    assert step_records.step_batch_of(data) == wire.step_batch_bytes(STEPS, hidden, 2**64 - 1, 7)


def test_a_strided_or_lazy_hidden_goes_in_row_major_order() -> None:
    steps = [StepRequest("a", (1, 2, 3), 5, draft_len=2)]
    strided = mx.arange(12, dtype=mx.float32).reshape(4, 3).T.reshape(3, 4)[None][:, :, :3]
    lazy = mx.arange(9, dtype=mx.float16).reshape(1, 3, 3) * 2
    for hidden in (strided, lazy):
        got = step_records.decode(step_records.encode(steps, hidden, 0)).hidden_array()
        assert np.array_equal(np.array(got), np.array(hidden))


@pytest.mark.parametrize(
    "step",
    [
        StepRequest("a", (1, 2), 0, options=RequestOptions()),
        StepRequest("a", (1, 2), 0, sample=False),
        StepRequest("a", (1,), 3, token_masks=(b"\x01",)),
        StepRequest("a", (1,), 3, prefix_from=2),
        StepRequest("a", (1,), 3, prefix_save=2),
        StepRequest("a", (1,), 3, sample=False, next_token=4),
        StepRequest("a", (1,), 2**32),  # beyond the records' fields: protobuf's varints
        StepRequest("a", (2**32,), 3),
        StepRequest("a", (1,), 3, rollback=2**16),
        StepRequest("a" * 2**16, (1,), 3),
    ],
    ids=lambda s: repr(s)[:60],
)
def test_a_step_that_needs_more_than_records_is_left_to_the_step_batch(step) -> None:
    hidden = mx.zeros((1, len(step.tokens), 8), mx.bfloat16)
    assert step_records.encode([step], hidden, 0) is None
    assert step_records.encode([STEPS[1], step], None, 0) is None  # one such step: the batch
    assert step_records.encode([STEPS[1]], None, 0) is not None


def test_hidden_states_that_do_not_match_the_steps_are_left_to_the_step_batch() -> None:
    steps = [StepRequest("a", (1, 2), 0, draft_len=1)]
    for hidden in (
        mx.zeros((1, 3, 8), mx.bfloat16),  # positions
        mx.zeros((2, 2, 8), mx.bfloat16),
        mx.zeros((2, 8), mx.bfloat16),
        mx.zeros((1, 2, 8), mx.int32),  # a dtype the wire does not carry
    ):
        assert step_records.encode(steps, hidden, 0) is None
    assert step_records.encode([], None, 0) is None


def test_a_frame_that_is_not_whole_records_is_refused() -> None:
    hidden = mx.ones((1, 2, 4), mx.bfloat16)
    data = step_records.encode(STEPS[:1], hidden, 3)
    for end in range(len(data)):  # every truncation
        with pytest.raises(wire.WireError):
            step_records.decode(data[:end])
    with pytest.raises(wire.WireError, match="in 17 bytes"):
        step_records.decode(data + b"x")
    header = step_records.HEADER
    bad_dtype = header.pack(3, 0, 1, 9, 4) + data[header.size :]
    with pytest.raises(wire.WireError, match="dtype code 9"):
        step_records.decode(bad_dtype)
    no_hidden = step_records.encode(STEPS[:1], None, 3)
    with pytest.raises(wire.WireError, match="in 1 bytes"):
        step_records.decode(no_hidden + b"x")
    entry = step_records.ENTRY
    bad_id = header.pack(3, 0, 1, 0, 0) + entry.pack(1, 1, 0, 5, 0) + b"\xff" + bytes(4)
    with pytest.raises(wire.WireError, match="malformed"):
        step_records.decode(bad_id)
    # Records of a step that is not a valid step: the step's own error.
    bad_step = header.pack(3, 0, 1, 0, 0) + entry.pack(1, 1, 1, 5, 0) + b"a" + bytes(4)
    with pytest.raises(RequestError, match="draft_len"):
        step_records.decode(bad_step)


def test_records_are_smaller_than_the_step_batch_they_stand_for() -> None:
    hidden = mx.zeros((1, 2, 5120), mx.bfloat16)
    steps = STEPS[:1]
    records = step_records.encode(steps, hidden, 9, 1)
    batch = wire.step_batch_bytes(steps, hidden, 9, 1)
    assert len(records) <= len(batch)
    assert pb.StepBatch.FromString(batch).hidden.data == step_records.decode(records).hidden
