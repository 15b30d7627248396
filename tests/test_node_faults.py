"""Faults at real node processes: dead and silent nodes, malformed and oversized messages,
unknown request ids, missing tokens, an exhausted cache budget.

Each fault must come back as a gRPC status (on the RPC, or as a StepError on the Results
stream) within seconds, and the node must keep serving its other requests: the tests run a
normal generation through the same nodes during and after the faults and compare its tokens
with the single-process engine's.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager

import grpc
import nodes
import pytest
from conftest import CODE_PROMPTS, greedy_tokens, run
from nodes import NodeGroup, active_requests, node_infos, remote_engine

from cluster.decode.engine import GenerationOutput, GenerationRequest
from cluster.messages import RequestError, RequestOptions
from cluster.transport.auth import token_metadata
from cluster.transport.node_client import NodeUnavailable
from cluster.transport.wire import MAX_MESSAGE_BYTES, grpc_channel_options
from proto import cluster_pb2 as pb
from proto import cluster_pb2_grpc as pb_grpc

node_factory = nodes.node_factory  # the fixture, for this module

MAX_TOKENS = 48
HIDDEN = 256  # the bundled model's hidden size
DETECT_S = 5.0  # a dead or silent node must turn into an error within this
Code = grpc.StatusCode
_CODES = {code.value[0]: code for code in Code}


@pytest.fixture(scope="module")
def trio(node_factory) -> NodeGroup:
    return node_factory(3)


@pytest.fixture(scope="module")
def requests(tokenizer) -> list[GenerationRequest]:
    return [
        GenerationRequest(tuple(tokenizer.encode(p)), MAX_TOKENS, RequestOptions(mtp=True))
        for p in CODE_PROMPTS
    ]


@pytest.fixture(scope="module")
def expected(greedy_reference) -> list[tuple[int, ...]]:
    """The requests' tokens in one process."""
    return greedy_tokens(greedy_reference[True], MAX_TOKENS)


async def _generate(engine, requests: list[GenerationRequest]) -> list[tuple[int, ...]]:
    outputs: list[GenerationOutput] = await asyncio.gather(*(engine.generate(r) for r in requests))
    return [o.tokens for o in outputs]


# ---- a dead or silent node ----------------------------------------------------------------


def _fault_during_generation(trio, victim, model_dir, request, fault) -> tuple[Exception, float]:
    """Run `request` through [trio[0], victim, trio[2]]; after a few chunks, `fault(victim)`.
    Returns the error the generation ended with and how long after the fault it came."""

    async def go():
        faulted_at = None

        def on_chunk(_chunk) -> None:
            nonlocal faulted_at
            chunks.append(_chunk)
            if len(chunks) == 3:
                faulted_at = time.monotonic()
                fault(victim)

        chunks: list = []
        addresses = [trio[0].address, victim.address, trio[2].address]
        async with remote_engine(model_dir, addresses) as (engine, _):
            long = GenerationRequest(request.prompt, 4000, request.options)
            # The deadline only turns a hang into a failure; the assertion below is the 5 s.
            with pytest.raises((NodeUnavailable, RequestError)) as caught:
                await asyncio.wait_for(engine.generate(long, on_chunk), 30)
            assert faulted_at is not None, "the generation ended before the fault"
            return caught.value, time.monotonic() - faulted_at

    return run(go())


def test_killed_node_fails_its_requests_within_seconds(node_factory, trio, model_dir, requests):
    victim = node_factory(1)[0]
    error, elapsed = _fault_during_generation(
        trio, victim, model_dir, requests[0], lambda node: node.kill()
    )
    assert elapsed < DETECT_S, f"{elapsed:.1f} s to notice a dead node"
    assert victim.address in str(error)


def test_silent_node_fails_its_requests_within_seconds(node_factory, trio, model_dir, requests):
    victim = node_factory(1)[0]
    try:
        error, elapsed = _fault_during_generation(
            trio, victim, model_dir, requests[0], lambda node: node.pause()
        )
    finally:
        victim.resume()
        victim.kill()
    assert elapsed < DETECT_S, f"{elapsed:.1f} s to notice a silent node"
    assert victim.address in str(error)


# ---- malformed messages, unknown ids, missing tokens: the node keeps serving ---------------


class RawNode:
    """Hand-made messages to one node: its Steps stream, its Results, its unary RPCs."""

    def __init__(self, address: str, token: str | None, *, send_limit: bool = True):
        options = grpc_channel_options() if send_limit else [("grpc.enable_retries", 0)]
        self.channel = grpc.aio.insecure_channel(address, options=options)
        self.stub = pb_grpc.NodeStub(self.channel)
        self.metadata = token_metadata(token) if token is not None else ()
        self.errors: dict[str, tuple[Code, str]] = {}
        self._results: grpc.aio.UnaryStreamCall | None = None
        self._listener: asyncio.Task | None = None
        self._steps: grpc.aio.StreamStreamCall | None = None

    async def subscribe(self) -> None:
        """Collect the StepErrors the node publishes; returns once the stream is live."""
        self._results = self.stub.Results(pb.ResultsRequest(), metadata=self.metadata)
        await asyncio.wait_for(self._results.wait_for_connection(), 5.0)
        self._listener = asyncio.create_task(self._listen())

    async def _listen(self) -> None:
        async for batch in self._results:
            for e in batch.errors:
                self.errors[e.request_id] = (_CODES.get(e.code, Code.UNKNOWN), e.message)

    async def step(self, *entries: pb.StepEntry, hidden: pb.Tensor | None = None) -> None:
        if self._steps is None:
            self._steps = self.stub.Steps(metadata=self.metadata)
        batch = pb.StepBatch(entries=entries, sequence=1)
        if hidden is not None:
            batch.hidden.CopyFrom(hidden)
        await self._steps.write(batch)

    async def error_for(self, request_id: str, timeout: float = 5.0) -> tuple[Code, str]:
        deadline = time.monotonic() + timeout
        while request_id not in self.errors:
            assert time.monotonic() < deadline, f"no StepError for {request_id!r}"
            assert self._listener is not None and not self._listener.done()
            await asyncio.sleep(0.01)
        return self.errors[request_id]

    async def close(self) -> None:
        for call in (self._results, self._steps):
            if call is not None:
                call.cancel()
        if self._listener is not None:
            self._listener.cancel()
        await self.channel.close()


@asynccontextmanager
async def raw_node(address: str, token: str | None, **kwargs) -> AsyncIterator[RawNode]:
    node = RawNode(address, token, **kwargs)
    try:
        yield node
    finally:
        await node.close()


async def _status_of(call: Awaitable) -> Code:
    try:
        await call
    except grpc.aio.AioRpcError as error:
        return error.code()
    return Code.OK


def _entry(request_id: str, tokens=(1,), position: int = 0, **kwargs) -> pb.StepEntry:
    return pb.StepEntry(request_id=request_id, tokens=tokens, position=position, **kwargs)


def _hidden(positions: int, size: int = HIDDEN, dtype: str = "bfloat16", data=None) -> pb.Tensor:
    data = bytes(2 * positions * size) if data is None else data
    return pb.Tensor(data=data, dtype=dtype, shape=[1, positions, size])


async def _malformed_steps(trio: NodeGroup) -> None:
    """Each bad step gets its StepError with the right code, from the node it was sent to."""
    async with (
        raw_node(trio[0].address, trio.token) as head,
        raw_node(trio[1].address, trio.token) as middle,
    ):
        await head.subscribe()
        await middle.subscribe()
        await middle.step(_entry("bad-dtype"), hidden=_hidden(1, dtype="int8", data=bytes(HIDDEN)))
        await middle.step(_entry("bad-bytes"), hidden=_hidden(1, data=bytes(100)))
        await middle.step(_entry("bad-size"), hidden=_hidden(1, size=HIDDEN // 2))
        await middle.step(_entry("no-hidden"))
        await middle.step(_entry("middle-unknown", position=7), hidden=_hidden(1))
        await head.step(_entry("hidden-to-head"), hidden=_hidden(1))
        await head.step(_entry("head-unknown", tokens=(5, 6), position=40))
        await head.step(_entry("bad-draft", tokens=(5, 6), draft_len=2))
        for name in ("bad-dtype", "bad-bytes", "bad-size", "no-hidden"):
            assert (await middle.error_for(name))[0] == Code.INVALID_ARGUMENT, name
        assert (await middle.error_for("middle-unknown"))[0] == Code.NOT_FOUND
        assert (await head.error_for("hidden-to-head"))[0] == Code.INVALID_ARGUMENT
        assert (await head.error_for("bad-draft"))[0] == Code.INVALID_ARGUMENT
        code, message = await head.error_for("head-unknown")
        assert code == Code.NOT_FOUND and "head-unknown" in message


async def _unknown_ids(trio: NodeGroup) -> None:
    for address in trio.addresses:
        async with raw_node(address, trio.token) as node:
            rollback = node.stub.Rollback(pb.RollbackRequest(request_id="nobody", drop=1),
                                          timeout=5, metadata=node.metadata)  # fmt: skip
            assert await _status_of(rollback) == Code.NOT_FOUND
            release = node.stub.Release(pb.ReleaseRequest(request_id="nobody"), timeout=5,
                                        metadata=node.metadata)  # fmt: skip
            assert await _status_of(release) == Code.NOT_FOUND


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def _step_batch_bytes(entry: pb.StepEntry, positions: int) -> bytes:
    """A serialized StepBatch whose hidden holds `positions` zero rows, built by hand: going
    through protobuf would cost seconds for a message over the size limit."""
    data_len = 2 * positions * HIDDEN
    tensor_head = pb.Tensor(dtype="bfloat16", shape=[1, positions, HIDDEN]).SerializeToString()
    tensor_len = len(tensor_head) + 1 + len(_varint(data_len)) + data_len
    head = pb.StepBatch(entries=[entry], sequence=1).SerializeToString()
    head += b"\x12" + _varint(tensor_len) + tensor_head + b"\x0a" + _varint(data_len)
    return head + bytes(data_len)


async def _oversized(trio: NodeGroup) -> None:
    """A step over the maximum message size is refused; the stream ends, the node serves on."""
    small = pb.StepBatch(entries=[_entry("x")], sequence=1, hidden=_hidden(2))
    assert pb.StepBatch.FromString(_step_batch_bytes(_entry("x"), 2)) == small
    message = _step_batch_bytes(_entry("oversized"), MAX_MESSAGE_BYTES // (2 * HIDDEN) + 1)
    assert len(message) > MAX_MESSAGE_BYTES
    async with raw_node(trio[1].address, trio.token, send_limit=False) as node:
        steps = node.channel.stream_stream(
            "/cluster.v1.Node/Steps",
            request_serializer=bytes,
            response_deserializer=pb.StepEvent.FromString,
        )(metadata=node.metadata)
        await steps.write(message)
        assert await _status_of(steps.read()) == Code.RESOURCE_EXHAUSTED


async def _unauthenticated(trio: NodeGroup) -> None:
    """Every RPC kind, without the token and with a wrong one, is refused before it runs."""
    for token in (None, "wrong-secret"):
        for address in trio.addresses:
            async with raw_node(address, token) as node:
                stub, md = node.stub, node.metadata
                load = pb.LoadShardRequest(model_dir="/nonexistent", start=0, end=1)
                calls = {
                    "Info": stub.Info(pb.InfoRequest(), timeout=5, metadata=md),
                    "LoadShard": stub.LoadShard(load, timeout=5, metadata=md),
                    "Release": stub.Release(pb.ReleaseRequest(request_id="x"), timeout=5,
                                            metadata=md),
                    "Rollback": stub.Rollback(pb.RollbackRequest(request_id="x", drop=1),
                                              timeout=5, metadata=md),
                    "Results": stub.Results(pb.ResultsRequest(), timeout=5, metadata=md).read(),
                }  # fmt: skip
                steps = stub.Steps(timeout=5, metadata=md)
                calls["Steps"] = steps.read()
                codes = {name: await _status_of(call) for name, call in calls.items()}
                assert codes == dict.fromkeys(codes, Code.UNAUTHENTICATED), (token, codes)


def test_faults_get_status_codes_and_nodes_keep_serving(trio, model_dir, requests, expected):
    async def go():
        async with remote_engine(model_dir, trio.addresses) as (engine, _):
            during = asyncio.ensure_future(_generate(engine, requests))
            try:
                await _malformed_steps(trio)
                await _unknown_ids(trio)
                await _unauthenticated(trio)
                await _oversized(trio)
            finally:
                tokens_during = await during
            tokens_after = await _generate(engine, requests)
            assert await active_requests(trio.addresses) == [0, 0, 0]
            infos = await node_infos(trio.addresses)
        return tokens_during, tokens_after, infos

    tokens_during, tokens_after, infos = run(go())
    assert tokens_during == expected
    assert tokens_after == expected
    assert all(info.shard.model_dir for info in infos)  # the unauthenticated LoadShard did not run


# ---- the cache budget ---------------------------------------------------------------------


def test_cache_budget_refuses_a_long_prompt_and_serves_a_short_one(
    trio, model_dir, requests, expected
) -> None:
    # The head holds layers 0-3: one attention layer (128 KiB of KV per 256 positions) and
    # three GatedDeltaNet layers (67 KiB of state each). A short request needs ~330 KB there;
    # a 1024-token prompt in one chunk needs 512 KiB of KV at once.
    budget = 400_000
    ranges = [(0, 4), (4, 6), (6, 8)]

    async def go():
        async with remote_engine(
            model_dir, trio.addresses, ranges=ranges, prefill_chunk=1024, cache_budget_bytes=budget
        ) as (engine, _):
            assert [i.cache_budget_bytes for i in await node_infos(trio.addresses)] == [budget] * 3
            long = GenerationRequest(tuple(range(10, 10 + 1024)), 8)
            with pytest.raises(RequestError) as caught:
                await engine.generate(long)
            assert await active_requests(trio.addresses) == [0, 0, 0]
            short = await engine.generate(requests[0])
        return caught.value, short.tokens

    error, short = run(go())
    assert getattr(error, "code", None) == Code.RESOURCE_EXHAUSTED
    assert f"budget {budget}" in str(error)
    assert trio[0].address in str(error)  # the head refused it
    assert short == expected[0]
