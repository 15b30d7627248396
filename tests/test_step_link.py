"""The step stream between nodes over plain TCP (`node.step_link`).

In one process: steps arrive whole and in order; a wrong token, a malformed step and an
oversized frame each end the stream, and the sender then sees it broken (a clear error, never a
step lost in silence). Against real node processes: a node advertises its step port and its
predecessor's `Downstream` takes it, or gRPC where it cannot connect (the pipeline tests run
over it; `test_tls` checks that a TLS node offers none).
"""

from __future__ import annotations

import asyncio

import grpc
import mlx.core as mx
import nodes
import pytest
from conftest import run

from cluster import wire
from cluster.messages import StepRequest
from node.client import NodeClient
from node.stage import Downstream
from node.step_link import FRAME, StepLinkError, StepListener, StepSender
from proto import cluster_pb2 as pb

node_factory = nodes.node_factory
TOKEN = "step-link-secret"


def _step(sequence: int, positions: int = 2) -> bytes:
    entries = [StepRequest(f"r{sequence}", tuple(range(positions)), 40 + sequence)]
    hidden = mx.full((1, positions, 64), sequence, mx.bfloat16)
    return wire.step_batch_bytes(entries, hidden, sequence)


async def _until(condition, timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.01)


async def _listening(received: list[pb.StepBatch]) -> StepListener:
    listener = StepListener(TOKEN, received.append)
    await listener.start("127.0.0.1")
    return listener


def test_steps_arrive_whole_and_in_order() -> None:
    async def go() -> None:
        received: list[pb.StepBatch] = []
        listener = await _listening(received)
        sender = await StepSender.open("127.0.0.1", listener.port, TOKEN)
        sent = [_step(i, positions=1 + i % 5) for i in range(200)]
        sent.append(_step(200, positions=600))  # a prefill-sized step: 77 KB
        for payload in sent:
            await sender.send(payload)
        await _until(lambda: len(received) == len(sent))
        assert [m.SerializeToString() for m in received] == sent
        await sender.close()
        await listener.close()

    run(go())


@pytest.mark.parametrize(
    ("frame", "why"),
    [(FRAME.pack(3) + b"\xff\xff\xff", "a malformed step"), (FRAME.pack(2**31), "too large")],
)
def test_a_bad_frame_ends_the_stream_and_the_sender_sees_it(frame: bytes, why: str) -> None:
    async def go() -> None:
        received: list[pb.StepBatch] = []
        listener = await _listening(received)
        sender = await StepSender.open("127.0.0.1", listener.port, TOKEN)
        await sender.send(_step(1))
        sender._writer.write(frame)  # what no sender of this module writes
        await _until(lambda: sender.broken)
        with pytest.raises(StepLinkError, match="was closed"):
            await sender.send(_step(2))
        assert [m.sequence for m in received] == [1]
        await sender.close()
        await listener.close()

    run(go())


def test_a_wrong_token_is_refused_before_any_step() -> None:
    async def go() -> None:
        received: list[pb.StepBatch] = []
        listener = await _listening(received)
        with pytest.raises(StepLinkError, match="refused the step stream"):
            await StepSender.open("127.0.0.1", listener.port, "not-the-token")
        with pytest.raises(StepLinkError, match="cannot open"):
            await StepSender.open("127.0.0.1", 1, TOKEN)  # nobody listens there
        await listener.close()
        assert received == []

    run(go())


@pytest.fixture(scope="module")
def solo(node_factory) -> nodes.NodeGroup:
    return node_factory(1)


def test_a_node_takes_steps_from_its_predecessor_over_tcp(solo) -> None:
    group = solo

    async def go() -> None:
        client = NodeClient(group.addresses[0], group.token)
        info = await client.info()
        await client.close()
        assert info.step_port > 0
        downstream = Downstream(group.addresses[0], group.token)
        client = NodeClient(group.addresses[0], group.token)
        results = client.stub.Results(pb.ResultsRequest(), metadata=client.metadata)
        try:
            await results.wait_for_connection()
            await downstream.send(_step(1))
            assert downstream.transport == "tcp"
            # No shard loaded: the step's request fails where the driver listens, as the gRPC
            # stream would refuse it.
            batch = await asyncio.wait_for(results.read(), 10)
            assert [(e.request_id, e.message) for e in batch.errors] == [("r1", "no shard loaded")]
        finally:
            results.cancel()
            await client.close()
            await downstream.close()

    run(go())


def test_a_predecessor_that_cannot_reach_the_step_port_streams_over_grpc(solo, monkeypatch):
    async def unreachable(*args, **kwargs):
        raise StepLinkError("cannot open a step stream to 127.0.0.1:1: refused")

    monkeypatch.setattr(StepSender, "open", unreachable)

    async def go() -> None:
        downstream = Downstream(solo.addresses[0], solo.token)
        try:
            try:  # the node refuses the step (no shard); the write may return before it does
                await downstream.send(_step(1))
            except grpc.aio.AioRpcError as error:
                assert "no shard loaded" in error.details()
            assert downstream.transport == "grpc"
        finally:
            await downstream.close()

    run(go())
