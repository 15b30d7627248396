"""Property-based fuzzing (hypothesis, bounded): whatever arrives, the answer is a clean error.

- The wire codec, fed arbitrary bytes and arbitrary field values, either decodes or raises its
  own errors (`WireError`, `RequestError`, protobuf's `DecodeError`), never anything else.
- A real node, sent arbitrary step messages, answers each with per-request errors (gRPC
  statuses) and keeps serving: a generation through it afterwards gives the right tokens.
- The HTTP API, sent arbitrary JSON bodies, answers 2xx or an OpenAI 4xx error: never a 500,
  never a hang; the app keeps serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json

import grpc
import nodes
import pytest
from conftest import run
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nodes import NodeGroup, remote_engine

from cluster.decode.engine import GenerationRequest
from cluster.decode.local_engine import open_local_engine
from cluster.messages import RequestError
from cluster.transport import step_records
from cluster.transport.auth import token_metadata
from cluster.transport.wire import (
    WireError,
    results_from_proto,
    step_batch_from_proto,
    tensor_from_proto,
)
from proto import cluster_pb2 as pb
from proto import cluster_pb2_grpc as pb_grpc
from tests.fakes import FakeEngine, serve

node_factory = nodes.node_factory

CODEC_EXAMPLES = 300
NODE_EXAMPLES = 25
HTTP_EXAMPLES = 150
INT32 = st.integers(-(2**31), 2**31 - 1)
UINT32 = st.integers(0, 2**32 - 1)
UINT64 = st.integers(0, 2**64 - 1)
CLEAN = (WireError, RequestError, DecodeError)

sampling = st.builds(
    pb.SamplingParams,
    temperature=st.floats(allow_nan=True, allow_infinity=True),
    top_p=st.floats(allow_nan=True, allow_infinity=True),
    top_k=INT32,
    min_p=st.floats(allow_nan=True, allow_infinity=True),
    seed=st.integers(-(2**63), 2**63 - 1),
)
options = st.builds(
    pb.RequestOptions,
    sampling=sampling,
    mtp=st.booleans(),
    logprobs=st.booleans(),
    top_logprobs=UINT32,
)
entries = st.builds(
    pb.StepEntry,
    request_id=st.text(max_size=20),
    tokens=st.lists(INT32, max_size=6),
    position=UINT64,
    draft_len=UINT32,
    rollback=UINT32,
    sample=st.booleans(),
    options=options,
    next_token=INT32,
    prefix_from=UINT64,
    prefix_save=UINT64,
)
tensors = st.builds(
    pb.Tensor,
    data=st.binary(max_size=64),
    dtype=st.sampled_from(["bfloat16", "float16", "float32", "int8", "", "float64"]),
    shape=st.lists(st.integers(-4, 2**40), max_size=4),
)
batches = st.builds(
    pb.StepBatch,
    entries=st.lists(entries, max_size=3),
    hidden=st.one_of(st.none(), tensors),
    sequence=UINT64,
    epoch=UINT64,
)


@settings(max_examples=CODEC_EXAMPLES, deadline=None)
@given(st.binary(max_size=200))
def test_codec_with_arbitrary_bytes(data: bytes) -> None:
    for decode in (
        lambda b: step_batch_from_proto(pb.StepBatch.FromString(b)),
        lambda b: results_from_proto(pb.ResultBatch.FromString(b)),
        lambda b: tensor_from_proto(pb.Tensor.FromString(b)),
        lambda b: step_records.decode(b).hidden_array(),
    ):
        with contextlib.suppress(CLEAN):
            decode(data)


@settings(max_examples=CODEC_EXAMPLES, deadline=None)
@given(batches)
def test_codec_with_arbitrary_field_values(batch: pb.StepBatch) -> None:
    try:
        steps, hidden, _ = step_batch_from_proto(batch)
    except CLEAN:
        return
    for step in steps:  # what decodes is a valid step
        assert step.tokens and 0 <= step.draft_len < len(step.tokens)
    if hidden is not None:
        assert list(hidden.shape) == list(batch.hidden.shape)


# ---- a live node ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair(node_factory) -> NodeGroup:
    return node_factory(2)


@pytest.fixture(scope="module")
def expected(model_dir, tokenizer) -> tuple[tuple[int, ...], tuple[int, ...]]:
    prompt = tuple(tokenizer.encode("def quicksort(items):\n"))

    async def go():
        local = await open_local_engine(model_dir)
        try:
            return prompt, (await local.engine.generate(GenerationRequest(prompt, 12))).tokens
        finally:
            local.close()

    return run(go())


def test_node_answers_arbitrary_steps_and_keeps_serving(pair, model_dir, expected) -> None:
    addresses = pair.addresses
    prompt, tokens = expected

    async def go():
        async with remote_engine(model_dir, addresses) as (engine, pipeline):
            for client in pipeline.clients:  # load the shards, then fuzz both of them
                assert (await client.info()).shard.end > 0
            for address in addresses:
                await _fuzz_node(address)
            for address in addresses:  # still answering
                channel = grpc.aio.insecure_channel(address)
                stub = pb_grpc.NodeStub(channel)
                await stub.Info(pb.InfoRequest(), metadata=token_metadata(pair.token), timeout=5)
                await channel.close()
            assert (await engine.generate(GenerationRequest(prompt, 12))).tokens == tokens

    run(go())


async def _fuzz_node(address: str) -> None:
    """Arbitrary step messages on one Steps stream; every refused one is answered."""
    messages: list[pb.StepBatch] = []

    @settings(
        max_examples=NODE_EXAMPLES,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        database=None,
    )
    @given(batches)
    def collect(batch: pb.StepBatch) -> None:
        messages.append(batch)

    collect()
    channel = grpc.aio.insecure_channel(address)
    stub = pb_grpc.NodeStub(channel)
    call = stub.Steps(metadata=token_metadata(nodes.TOKEN))
    try:
        for message in messages:
            message.epoch = 0  # the epoch the test's pipeline loaded: reach the decoder
            await call.write(message)
        await call.done_writing()
        async with asyncio.timeout(30):
            async for _ in call:  # the node's answers about messages it could not read
                pass
    finally:
        call.cancel()
        await channel.close()


# ---- the HTTP API --------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=12,
)
field_names = st.sampled_from(
    ["model", "messages", "prompt", "max_tokens", "temperature", "top_p", "top_k", "seed",
     "stop", "stream", "stream_options", "logprobs", "top_logprobs", "n", "tools",
     "response_format", "min_p", "max_completion_tokens", "role", "content"]
)  # fmt: skip
bodies = st.one_of(
    st.dictionaries(field_names, json_values, max_size=6),
    st.fixed_dictionaries(
        {"messages": st.lists(st.dictionaries(field_names, json_values, max_size=3), max_size=3)}
    ),
    json_values,
)


@pytest.fixture(scope="module")
def served():
    with serve(FakeEngine(reply=lambda request: (5, 6, 7, 2), chunk_size=2)) as served:
        yield served


@settings(
    max_examples=HTTP_EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(body=bodies, path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]))
def test_http_bodies_get_clean_answers(served, body, path: str) -> None:
    status, reply = _post(served.app.port, path, json.dumps(body).encode())
    assert status < 500, (status, reply)
    if status >= 400:
        assert "error" in json.loads(reply), reply


@settings(max_examples=50, deadline=None, suppress_health_check=list(HealthCheck))
@given(raw=st.binary(max_size=100))
def test_http_raw_bytes_get_clean_answers(served, raw: bytes) -> None:
    status, _ = _post(served.app.port, "/v1/chat/completions", raw)
    assert 400 <= status < 500
    status, _ = _post(served.app.port, "/v1/completions", b'{"prompt": "x", "max_tokens": 2}')
    assert status == 200


def _post(port: int, path: str, body: bytes) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()
