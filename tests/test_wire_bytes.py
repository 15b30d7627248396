"""`wire.step_batch_bytes`: the serialized StepBatch a node sends its successor is protobuf's own
serialization, byte for byte, and decodes to bit-exact hidden states."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from cluster.messages import RequestOptions, SamplingParams, StepRequest
from cluster.transport import wire
from proto import cluster_pb2 as pb

DTYPES = [mx.bfloat16, mx.float16, mx.float32]
SHAPES = [(1, 2, 5120), (1, 1, 256), (3, 7), (5,), (), (0, 4)]
# zeros (proto3 writes nothing), one-byte and ten-byte varints, the top of the range
NUMBERS = [(0, 0), (1, 0), (127, 128), (300, 2**63), (2**64 - 1, 2**64 - 1)]


def _entries() -> list[StepRequest]:
    return [
        StepRequest("chatcmpl-0123456789abcdef", (151_643, 9_707), 1234, draft_len=1),
        StepRequest("r-opts", (1, 2, 3), 0, sample=False, options=RequestOptions(SamplingParams())),
        StepRequest("r-next", (7,), 40, sample=False, next_token=8, prefix_save=3),
    ]


def _bits(a: mx.array) -> bytes:
    return np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a).tobytes()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize(("sequence", "epoch"), NUMBERS, ids=str)
def test_bytes_are_protobufs_serialization(dtype, shape, sequence, epoch):
    hidden = (mx.random.normal(shape, key=mx.random.key(3)) * 100).astype(dtype)
    expected = wire.step_batch_to_proto(_entries(), hidden, sequence, epoch).SerializeToString()
    assert wire.step_batch_bytes(_entries(), hidden, sequence, epoch) == expected


@pytest.mark.parametrize(("sequence", "epoch"), NUMBERS, ids=str)
def test_bytes_without_hidden_are_protobufs_serialization(sequence, epoch):
    for entries in (_entries(), []):
        expected = wire.step_batch_to_proto(entries, None, sequence, epoch).SerializeToString()
        assert wire.step_batch_bytes(entries, None, sequence, epoch) == expected


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_bytes_decode_bit_exact(dtype):
    hidden = (mx.random.normal((1, 30, 64), key=mx.random.key(4)) * 1e4).astype(dtype)
    msg = pb.StepBatch.FromString(wire.step_batch_bytes(_entries(), hidden, 9, 2))
    entries, got, sequence = wire.step_batch_from_proto(msg)
    assert entries == _entries() and sequence == 9 and msg.epoch == 2
    assert got.dtype == dtype and got.shape == hidden.shape
    assert _bits(got) == _bits(hidden)


def test_bf16_special_values_survive_the_bytes():
    values = np.array([0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC1, 0x0001, 0x3F80], dtype=np.uint16)
    hidden = mx.array(values).view(mx.bfloat16)
    msg = pb.StepBatch.FromString(wire.step_batch_bytes([], hidden, 1))
    assert msg.hidden.data == values.tobytes()
    assert _bits(wire.step_batch_from_proto(msg)[1]) == values.tobytes()


def test_strided_and_lazy_arrays_go_in_row_major_order():
    strided = mx.arange(12, dtype=mx.float32).reshape(3, 4).T
    lazy = mx.arange(6, dtype=mx.float16).reshape(2, 3) * 2  # not evaluated yet
    for hidden in (strided, lazy):
        expected = wire.step_batch_to_proto([], hidden, 1).SerializeToString()
        assert wire.step_batch_bytes([], hidden, 1) == expected
        got = wire.step_batch_from_proto(pb.StepBatch.FromString(expected))[1]
        assert np.array_equal(np.array(got), np.array(hidden))


def test_unencodable_values_raise_wire_error():
    with pytest.raises(wire.WireError, match="dtype"):
        wire.step_batch_bytes([], mx.zeros((2,), dtype=mx.int8), 0)
    with pytest.raises(wire.WireError):
        wire.step_batch_bytes([StepRequest("r", (2**40,), 0)], None, 0)
    for sequence, epoch in ((-1, 0), (2**64, 0), (0, -1), (0, 2**64)):
        with pytest.raises(wire.WireError, match="uint64"):
            wire.step_batch_bytes([], None, sequence, epoch)


@pytest.mark.parametrize("epoch", [0, 1, 2**63], ids=str)
def test_a_forwarded_step_is_the_step_its_decoded_entries_make(epoch):
    """What a node sends on (the entries it received, serialized from the parsed messages) is
    byte for byte what encoding their decoded entries makes, over several messages too."""
    entries = _entries()
    hidden = mx.random.normal((1, 6, 64), key=mx.random.key(5)).astype(mx.bfloat16)
    received = [
        pb.StepBatch.FromString(wire.step_batch_bytes(part, None, sequence, 7))
        for sequence, part in enumerate([entries[:1], entries[1:], []], start=3)
    ]
    expected = wire.step_batch_bytes(entries, hidden, 0, epoch)
    assert wire.forwarded_step_bytes(received, hidden, epoch) == expected
    assert wire.forwarded_step_bytes(received, None, epoch) == wire.step_batch_bytes(
        entries, None, 0, epoch
    )
    decoded, got, sequence = wire.step_batch_from_proto(pb.StepBatch.FromString(expected))
    assert decoded == entries and sequence == 0 and _bits(got) == _bits(hidden)


def test_a_tensor_spec_that_disagrees_is_refused_every_time():
    """The dtype and shape checks are cached per (dtype, shape); a bad one raises each time."""
    for _ in range(2):
        with pytest.raises(wire.WireError, match="dtype"):
            wire.tensor_from_proto(pb.Tensor(dtype="int8", shape=[2], data=b"ab"))
        with pytest.raises(wire.WireError, match="negative"):
            wire.tensor_from_proto(pb.Tensor(dtype="float32", shape=[-1], data=b""))
        with pytest.raises(wire.WireError, match="needs 8 bytes"):
            wire.tensor_from_proto(pb.Tensor(dtype="float32", shape=[2], data=b"abc"))
