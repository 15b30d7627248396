"""Round trips through `cluster.transport.wire`: every message, every tensor dtype, defaults and
errors."""

from __future__ import annotations

import grpc
import mlx.core as mx
import numpy as np
import pytest

from cluster.messages import (
    RequestError,
    RequestOptions,
    SamplingParams,
    StepRequest,
    StepResult,
)
from cluster.transport import wire
from proto import cluster_pb2 as pb

DTYPES = [mx.bfloat16, mx.float16, mx.float32]
SHAPES = [(1, 2, 5120), (1, 1, 256), (3, 7), (5,), (), (0, 4)]


def _over_the_wire(msg):
    """Serialize and parse, as the stream does."""
    return type(msg).FromString(msg.SerializeToString())


def _bits(a: mx.array) -> np.ndarray:
    raw = a.view(mx.uint16) if a.dtype == mx.bfloat16 else a
    return np.array(raw)


# ---- tensors ----


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_tensor_round_trip_is_bit_exact(dtype, shape):
    a = (mx.random.normal(shape, key=mx.random.key(1)) * 100).astype(dtype)
    t = _over_the_wire(wire.tensor_to_proto(a))
    b = wire.tensor_from_proto(t)
    assert b.dtype == dtype and b.shape == a.shape
    assert _bits(b).tobytes() == _bits(a).tobytes()


def test_bf16_special_values_survive():
    values = np.array([0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC1, 0x0001, 0x3F80], dtype=np.uint16)
    a = mx.array(values).view(mx.bfloat16)
    t = wire.tensor_to_proto(a)
    assert t.dtype == "bfloat16" and t.data == values.tobytes()
    assert np.array_equal(_bits(wire.tensor_from_proto(t)), values)


def test_strided_array_goes_in_row_major_order():
    a = mx.arange(12, dtype=mx.float32).reshape(3, 4).T
    b = wire.tensor_from_proto(wire.tensor_to_proto(a))
    assert np.array_equal(np.array(b), np.array(a))


def test_unsupported_dtype_is_refused_on_encode():
    with pytest.raises(wire.WireError, match="dtype"):
        wire.tensor_to_proto(mx.zeros((2,), dtype=mx.int32))


@pytest.mark.parametrize(
    ("tensor", "problem"),
    [
        (pb.Tensor(data=b"\0" * 8, dtype="int8", shape=[8]), "dtype"),
        (pb.Tensor(data=b"\0" * 8, dtype="", shape=[4]), "dtype"),
        (pb.Tensor(data=b"\0" * 8, dtype="float32", shape=[3]), "needs 12 bytes, got 8"),
        (pb.Tensor(data=b"\0" * 8, dtype="bfloat16", shape=[2, 3]), "needs 12 bytes"),
        (pb.Tensor(data=b"\0" * 7, dtype="float16", shape=[4]), "got 7"),
        (pb.Tensor(data=b"", dtype="float32", shape=[-1, 0]), "negative"),
        (pb.Tensor(data=b"\0" * 8, dtype="float32", shape=[-2, -1]), "negative"),
    ],
)
def test_malformed_tensor_raises_wire_error(tensor, problem):
    with pytest.raises(wire.WireError, match=problem):
        wire.tensor_from_proto(tensor)


def test_wire_error_is_a_value_error():
    assert issubclass(wire.WireError, ValueError)


# ---- sampling and options ----


def test_sampling_round_trip_keeps_zero_temperature():
    for s in [
        SamplingParams(),
        SamplingParams(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, seed=0),
        SamplingParams(temperature=0.7, top_p=0.95, top_k=20, min_p=0.05, seed=12345),
        SamplingParams(temperature=1e-3, top_p=1e-9, top_k=1, min_p=0.999, seed=2**62),
    ]:
        m = _over_the_wire(wire.sampling_to_proto(s))
        assert m.HasField("temperature") and m.HasField("top_p")
        assert wire.sampling_from_proto(m) == s


def test_absent_sampling_fields_take_the_defaults():
    assert wire.sampling_from_proto(pb.SamplingParams()) == SamplingParams()
    s = wire.sampling_from_proto(pb.SamplingParams(temperature=0.8))
    assert s == SamplingParams(temperature=0.8)
    assert s.top_p == 1.0 and s.seed is None


def test_present_zero_is_not_the_default():
    m = pb.SamplingParams(top_k=0, seed=0)
    assert wire.sampling_from_proto(m).seed == 0


def test_options_round_trip():
    for o in [
        RequestOptions(),
        RequestOptions(SamplingParams(temperature=0.0), mtp=False, logprobs=True),
        RequestOptions(SamplingParams(temperature=1.3, top_k=50, seed=7), mtp=True),
        RequestOptions(logprobs=True, top_logprobs=20),
    ]:
        assert wire.options_from_proto(_over_the_wire(wire.options_to_proto(o))) == o


def test_absent_options_fields_take_the_defaults():
    assert wire.options_from_proto(pb.RequestOptions()) == RequestOptions()
    assert wire.options_from_proto(pb.RequestOptions(mtp=False)).mtp is False


def test_invalid_sampling_surfaces_as_request_error():
    with pytest.raises(RequestError, match="top_p"):
        wire.sampling_from_proto(pb.SamplingParams(top_p=0.0))
    with pytest.raises(RequestError, match="temperature"):
        wire.sampling_from_proto(pb.SamplingParams(temperature=-1.0))


# ---- step batches ----


def _entries() -> list[StepRequest]:
    return [
        StepRequest("r-prefill", tuple(range(1000, 1017)), 0, sample=False),
        StepRequest(
            "r-first",
            (151643, 9),
            0,
            options=RequestOptions(SamplingParams(temperature=0.0, seed=3), logprobs=True),
        ),
        StepRequest("r-decode", (42, 43), 1234, draft_len=1, rollback=1),
        StepRequest("r-masked", (5, 6), 9, draft_len=1, token_masks=(b"\x01\xff", b"\x00")),
        StepRequest("r-deep", (42, 43, 44, 45), 99, draft_len=3, rollback=2),
        StepRequest("r-greedy-off", (7,), 2**40, options=RequestOptions(mtp=False)),
        StepRequest("r-depth-0", (7,), 0, options=RequestOptions(mtp_depth=0)),
        StepRequest("r-depth-4", (7,), 0, options=RequestOptions(mtp_depth=4)),
        StepRequest("r-auto", (7,), 0, options=RequestOptions(mtp_depth="auto")),
        StepRequest("r-resume", (7,), 300, prefix_from=2**63 - 1, prefix_save=5),
    ]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_step_batch_round_trip(dtype):
    entries = _entries()
    hidden = mx.random.normal((1, 30, 64), key=mx.random.key(2)).astype(dtype)
    msg = _over_the_wire(wire.step_batch_to_proto(entries, hidden, 2**63 + 5))
    got, got_hidden, sequence = wire.step_batch_from_proto(msg)
    assert got == entries
    assert sequence == 2**63 + 5
    assert got_hidden.dtype == dtype and _bits(got_hidden).tobytes() == _bits(hidden).tobytes()


def test_step_batch_to_the_head_has_no_hidden():
    entries = [StepRequest("r", (1, 2, 3), 0)]
    msg = _over_the_wire(wire.step_batch_to_proto(entries, None, 0))
    assert not msg.HasField("hidden")
    assert wire.step_batch_from_proto(msg) == (entries, None, 0)


def test_decode_step_keeps_the_greedy_temperature():
    step = StepRequest("r", (5, 6), 10, draft_len=1, options=RequestOptions(SamplingParams()))
    (got,), _, _ = wire.step_batch_from_proto(
        _over_the_wire(wire.step_batch_to_proto([step], None, 1))
    )
    assert got.options.sampling.temperature == 0.0 and got.options.sampling.greedy


def test_absent_entry_fields_take_the_defaults():
    msg = pb.StepBatch(entries=[pb.StepEntry(request_id="r", tokens=[9])])
    (got,), hidden, sequence = wire.step_batch_from_proto(msg)
    assert got == StepRequest("r", (9,), 0)
    assert got.sample is True and got.options is None
    assert hidden is None and sequence == 0


def test_explicit_false_sample_is_kept():
    msg = pb.StepBatch(entries=[pb.StepEntry(request_id="r", tokens=[9], sample=False)])
    assert wire.step_batch_from_proto(msg)[0][0].sample is False


def test_empty_batch_round_trips():
    assert wire.step_batch_from_proto(wire.step_batch_to_proto([], None, 3)) == ([], None, 3)


@pytest.mark.parametrize(
    "entry",
    [
        pb.StepEntry(request_id="r"),  # no tokens
        pb.StepEntry(request_id="r", tokens=[1, 2], draft_len=2),  # all drafts
    ],
)
def test_invalid_entry_surfaces_as_request_error(entry):
    with pytest.raises(RequestError):
        wire.step_batch_from_proto(pb.StepBatch(entries=[entry]))


def test_malformed_hidden_in_a_batch_raises_wire_error():
    msg = pb.StepBatch(hidden=pb.Tensor(data=b"\0" * 3, dtype="bfloat16", shape=[2]))
    with pytest.raises(wire.WireError):
        wire.step_batch_from_proto(msg)


def test_unencodable_values_raise_wire_error():
    with pytest.raises(wire.WireError):
        wire.step_batch_to_proto([StepRequest("r", (2**40,), 0)], None, 0)
    with pytest.raises(wire.WireError):
        wire.step_batch_to_proto([], mx.zeros((2,), dtype=mx.int8), 0)


# ---- results ----


def _results() -> list[StepResult]:
    return [
        StepResult("r-prefill", (), keep=17),
        StepResult("r-decode", (11, 12), keep=2, drafts=(13,), drafted=1, accepted=1),
        StepResult("r-reject", (21,), keep=1, drafts=(0,), drafted=1, accepted=0),
        StepResult("r-deep", (21, 22, 23), keep=3, drafts=(5, 0, 7), drafted=3, accepted=2),
        StepResult("r-logprobs", (31, 32), keep=2, drafts=(33,), logprobs=(-0.5, -1.25)),
        StepResult("r-asked-none", (), keep=4, logprobs=()),
        StepResult(
            "r-top",
            (41, 42),
            keep=2,
            logprobs=(-0.5, -0.25),
            top_logprobs=(((41, -0.5), (7, -1.5)), ((42, -0.25), (0, -2.0))),
        ),
    ]


def test_results_round_trip():
    results = _results()
    errors = [
        ("r-bad", grpc.StatusCode.INVALID_ARGUMENT, "prompt too long"),
        ("r-oom", grpc.StatusCode.RESOURCE_EXHAUSTED, "cache budget spent"),
        ("r-gone", grpc.StatusCode.NOT_FOUND, ""),
    ]
    msg = _over_the_wire(wire.results_to_proto(results, errors))
    assert msg.errors[0].code == 3
    assert wire.results_from_proto(msg) == (results, errors)


def test_draft_zero_is_not_absent():
    msg = _over_the_wire(wire.results_to_proto([StepResult("r", (1,), 1, drafts=(0,))], []))
    assert wire.results_from_proto(msg)[0][0].drafts == (0,)


def test_absent_mtp_depth_is_the_default_and_zero_stays_zero():
    absent = wire.options_from_proto(pb.RequestOptions())
    assert absent.mtp_depth == RequestOptions().mtp_depth == 1
    zero = wire.options_to_proto(RequestOptions(mtp_depth=0))
    assert wire.options_from_proto(_over_the_wire_options(zero)).mtp_depth == 0


def _over_the_wire_options(msg: pb.RequestOptions) -> pb.RequestOptions:
    return pb.RequestOptions.FromString(msg.SerializeToString())


def test_logprobs_are_float32_on_the_wire():
    result = StepResult("r", (1,), 1, logprobs=(-0.1,))
    (got,), _ = wire.results_from_proto(_over_the_wire(wire.results_to_proto([result], [])))
    assert got.logprobs == pytest.approx((-0.1,), rel=1e-7)


def test_token_masks_need_one_per_sampled_position():
    with pytest.raises(RequestError, match="token_masks"):
        StepRequest("r", (5, 6), 0, draft_len=1, token_masks=(b"\x01",))
    with pytest.raises(RequestError, match="token_masks"):
        StepRequest("r", (5,), 0, sample=False, token_masks=(b"\x01",))


def test_top_logprobs_need_logprobs_and_at_most_20():
    with pytest.raises(RequestError, match="needs logprobs"):
        RequestOptions(top_logprobs=2)
    with pytest.raises(RequestError, match="top_logprobs"):
        wire.options_from_proto(pb.RequestOptions(logprobs=True, top_logprobs=21))


def test_absent_result_fields_take_the_defaults():
    msg = pb.ResultBatch(results=[pb.ResultEntry(request_id="r")])
    assert wire.results_from_proto(msg) == ([StepResult("r", (), 0)], [])


def test_unknown_status_number_reads_as_unknown():
    msg = pb.ResultBatch(errors=[pb.StepError(request_id="r", code=999, message="?")])
    assert wire.results_from_proto(msg)[1] == [("r", grpc.StatusCode.UNKNOWN, "?")]


# ---- gRPC options ----


def test_grpc_options_set_message_limits():
    for options in (wire.grpc_channel_options(), wire.grpc_server_options()):
        d = dict(options)
        assert d["grpc.max_send_message_length"] == 256 * 1024 * 1024
        assert d["grpc.max_receive_message_length"] == 256 * 1024 * 1024
        assert len(d) == len(options)  # no key given twice
