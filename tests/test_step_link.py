"""The step stream between nodes over plain TCP (`cluster.transport.step_link`), and a driver's
results stream on the same port (`cluster.transport.results_link`).

In one process: steps and results arrive whole and in order; a wrong token, a malformed
message and an oversized frame each end the stream, and the other end then sees it ended (a
clear error, never a message lost in silence). Against real node processes: a node advertises
its step port and its predecessor's `Downstream` takes it, or gRPC where it cannot connect; a
driver takes it for its steps and results, with the same tokens as over gRPC, and a node that
dies fails its requests with its name (the pipeline tests run over it; `test_tls` checks that a
TLS node offers none).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import time
from pathlib import Path

import grpc
import mlx.core as mx
import nodes
import pytest
from conftest import run

from cluster.decode.engine import GenerationEngine, GenerationRequest
from cluster.decode.remote_pipeline import PipelineSettings, load_pipeline
from cluster.messages import RequestOptions, StepRequest, StepResult
from cluster.transport import step_records, wire
from cluster.transport.node_client import NodeClient, NodeUnavailable
from cluster.transport.results_link import ResultsLink
from cluster.transport.step_link import (
    ACCEPTED,
    FRAME,
    MAGIC,
    RECORDS_FLAG,
    FrameReader,
    StepLinkError,
    StepListener,
    StepSender,
)
from node.stage import Downstream, Subscribers
from proto import cluster_pb2 as pb

node_factory = nodes.node_factory
TOKEN = "step-link-secret"


def _step(sequence: int, positions: int = 2) -> bytes:
    entries = [StepRequest(f"r{sequence}", tuple(range(positions)), 40 + sequence)]
    hidden = mx.full((1, positions, 64), sequence, mx.bfloat16)
    return wire.step_batch_bytes(entries, hidden, sequence)


def _records(sequence: int) -> bytes:
    """`_step(sequence)` as records."""
    return step_records.encode(
        [StepRequest(f"r{sequence}", (0, 1), 40 + sequence)],
        mx.full((1, 2, 64), sequence, mx.bfloat16),
        sequence,
    )


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


def test_records_and_step_batches_arrive_whole_and_in_order() -> None:
    """Decode steps as records between step batches on one stream: each arrives as it was
    sent, records decoded (`StepRecords`), the rest parsed (`StepBatch`)."""

    async def go() -> None:
        received: list = []
        listener = await _listening(received)
        sender = await StepSender.open("127.0.0.1", listener.port, TOKEN)
        for i in range(60):
            await sender.send(_records(i), records=True) if i % 3 else await sender.send(_step(i))
        await _until(lambda: len(received) == 60)
        for i, message in enumerate(received):
            if i % 3:
                assert isinstance(message, step_records.StepRecords)
                assert step_records.step_batch_of(_records(i)) == _step(i)
            else:
                assert message.SerializeToString() == _step(i)
            assert message.sequence == i and message.entries[0].request_id == f"r{i}"
        await sender.close()
        await listener.close()

    run(go())


def _framed(sequence: int) -> bytes:
    """Step `sequence` as a frame on the wire: records for odd ones, else a `StepBatch`."""
    if sequence % 2:
        payload = _records(sequence)
        return FRAME.pack(len(payload) | RECORDS_FLAG) + payload
    payload = _step(sequence, positions=1 + sequence % 7)
    return FRAME.pack(len(payload)) + payload


def _pieces(data: bytes, seed: int) -> list[bytes]:
    """`data` cut at random places: pieces of 1 byte to about two frames."""
    rng, pieces, at = random.Random(seed), [], 0
    while at < len(data):
        size = rng.choice([1, 2, 3, 5, rng.randint(1, 4000)])
        pieces.append(data[at : at + size])
        at += size
    return pieces


def test_frames_cut_anywhere_between_reads_come_out_whole_and_in_order() -> None:
    """However the stream's bytes are cut into reads (a byte at a time, several frames in one
    read, the end of one frame with the start of the next), `FrameReader` yields each message
    once, as it was sent, and keeps nothing once the last frame is whole; so does `each`, which
    takes a read of one whole frame (a frame a read, as steps usually come) by a shorter way."""
    frames = [_framed(i) for i in range(40)]
    stream = b"".join(frames)
    cuts = {"one read": [stream], "bytes": [stream[i : i + 1] for i in range(len(stream))]}
    cuts |= {"a frame a read": frames}
    cuts |= {f"random {seed}": _pieces(stream, seed) for seed in range(4)}
    for (name, pieces), way in itertools.product(cuts.items(), ("frames", "each")):
        name = f"{name}, {way}"
        reader = FrameReader(pb.StepBatch, "step", records=True)
        if way == "frames":
            received = [message for piece in pieces for message in reader.frames(piece)]
        else:
            received = []
            for piece in pieces:
                reader.each(piece, received.append)
        assert [m.sequence for m in received] == list(range(40)), name
        for i, message in enumerate(received):
            if i % 2:
                assert isinstance(message, step_records.StepRecords), name
                again = step_records.encode(message.entries, message.hidden_array(), i)
                assert again == _records(i), name
            else:
                assert message.SerializeToString() == _step(i, positions=1 + i % 7), name
        assert not reader.pending, name


def test_frames_a_reader_did_not_take_stay_pending() -> None:
    """A caller that raises while handling a message (or stops) leaves the frames after it
    pending, whole: the next read carries on from there, from bytes or from what was
    pending."""
    stream = b"".join(_framed(i) for i in range(6))
    for pieces in ([stream], [stream[:7], stream[7:]]):
        reader = FrameReader(pb.StepBatch, "step", records=True)
        taken = []
        with pytest.raises(RuntimeError):
            for piece in pieces:
                for message in reader.frames(piece):
                    taken.append(message.sequence)
                    if message.sequence == 2:
                        raise RuntimeError("the caller failed on step 2")
        taken += [message.sequence for message in reader.frames(b"")]
        assert taken == list(range(6))
        assert not reader.pending


def test_a_frame_whose_handler_failed_is_not_handled_again() -> None:
    """`each` on a read of one whole frame (its short way) and on reads of several: a handler
    that raises on a message has taken it; the frames after it stay pending, whole."""
    frames = [_framed(i) for i in range(6)]
    for pieces in (frames, [b"".join(frames[:4]), b"".join(frames[4:])]):
        reader = FrameReader(pb.StepBatch, "step", records=True)
        taken = []

        def take(message, taken=taken) -> None:
            taken.append(message.sequence)
            if message.sequence == 2:
                raise RuntimeError("the handler failed on step 2")

        for piece in pieces:
            with contextlib.suppress(RuntimeError):
                reader.each(piece, take)
        reader.each(b"", take)
        assert taken == list(range(6))
        assert not reader.pending


def test_a_hello_and_steps_in_one_read_or_cut_anywhere_reach_the_listener() -> None:
    """The listener takes the hello and the steps after it from the same read, and from reads
    cut anywhere, hello included."""

    async def go() -> None:
        received: list = []
        listener = await _listening(received)
        hello = MAGIC + FRAME.pack(len(TOKEN)) + TOKEN.encode()
        steps = b"".join(_framed(i) for i in range(12))
        for pieces in ([hello + steps], _pieces(hello + steps, seed=7)):
            received.clear()
            reader, writer = await asyncio.open_connection("127.0.0.1", listener.port)
            for piece in pieces:
                writer.write(piece)
                await writer.drain()
            assert await reader.readexactly(len(ACCEPTED)) == ACCEPTED
            await _until(lambda: len(received) == 12)
            assert [m.sequence for m in received] == list(range(12))
            writer.close()
        await listener.close()

    run(go())


@pytest.mark.parametrize(
    ("frame", "why"),
    [
        (FRAME.pack(3) + b"\xff\xff\xff", "a malformed step"),
        (FRAME.pack(RECORDS_FLAG | 3) + b"\xff\xff\xff", "malformed records"),
        (FRAME.pack(2**31 - 1), "too large"),
        (FRAME.pack(RECORDS_FLAG | 2**30 + 1), "records too large"),
    ],
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
        assert info.step_port > 0 and info.step_records
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
            # The node said it reads records: a decode step goes as records, and is refused
            # the same way.
            assert downstream.takes_records
            await downstream.send(_records(2), records=True)
            batch = await asyncio.wait_for(results.read(), 10)
            assert [(e.request_id, e.message) for e in batch.errors] == [("r2", "no shard loaded")]
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
            # The node refuses the step (no shard; the test above reads its reason). The write
            # may return before the refusal, or fail with it, or, losing the race to the
            # call's end, with gRPC core's own INTERNAL: which one is not this test's subject.
            with contextlib.suppress(grpc.aio.AioRpcError):
                await downstream.send(_step(1))
            assert downstream.transport == "grpc" and not downstream.takes_records
        finally:
            await downstream.close()

    run(go())


def test_records_for_a_stream_that_does_not_take_them_go_as_their_step_batch() -> None:
    """A step encoded as records while the successor's TCP stream was up, sent after it was
    replaced by a gRPC stream: it goes as the StepBatch it stands for."""

    class Call:
        def __init__(self) -> None:
            self.written: list[bytes] = []

        def done(self) -> bool:
            return False

        async def write(self, payload: bytes) -> None:
            self.written.append(payload)

    async def go() -> None:
        downstream = Downstream("127.0.0.1:1", TOKEN)
        downstream._call = call = Call()  # a gRPC stream, open
        await downstream.send(_records(3), records=True)
        await downstream.send(_step(4))
        assert call.written == [_step(3), _step(4)]

    run(go())


# ---- a driver's results stream --------------------------------------------------------------


def _results(sequence: int) -> pb.ResultBatch:
    result = StepResult(f"r{sequence}", (sequence, sequence + 1), keep=2)
    errors = [(f"e{sequence}", grpc.StatusCode.NOT_FOUND, "unknown")] if sequence % 7 == 0 else []
    return wire.results_to_proto([result], errors, epoch=3)


class _Ends:
    """A results link's `on_closed`: why the stream ended, once."""

    def __init__(self) -> None:
        self.whys: list[str] = []

    def __call__(self, why: str) -> None:
        self.whys.append(why)


def test_results_arrive_whole_and_in_order_until_the_driver_closes() -> None:
    async def go() -> None:
        subscribers = Subscribers()
        listener = StepListener(TOKEN, lambda message: None, subscribers.add_link)
        await listener.start("127.0.0.1")
        received: list[pb.ResultBatch] = []
        ends = _Ends()
        link = await ResultsLink.open("127.0.0.1", listener.port, TOKEN, received.append, ends)
        sent = [_results(i) for i in range(300)]
        for batch in sent:  # subscribed once open: nothing published from here on is lost
            subscribers.publish(batch)
        await _until(lambda: len(received) == len(sent))
        assert received == sent
        link.close()
        await _until(lambda: not subscribers._links)  # the node drops the subscription
        subscribers.publish(_results(1))
        await listener.close()
        assert ends.whys == []  # a close of our own is no news

    run(go())


def test_a_results_stream_needs_the_token_and_a_listener_that_serves_results() -> None:
    async def go() -> None:
        subscribers = Subscribers()
        serving = StepListener(TOKEN, lambda message: None, subscribers.add_link)
        steps_only = StepListener(TOKEN, lambda message: None)
        for listener in (serving, steps_only):
            await listener.start("127.0.0.1")
        with pytest.raises(StepLinkError, match="refused the results stream"):
            await ResultsLink.open("127.0.0.1", serving.port, "nope", print, print)
        with pytest.raises(StepLinkError, match="refused the results stream"):
            await ResultsLink.open("127.0.0.1", steps_only.port, TOKEN, print, print)
        with pytest.raises(StepLinkError, match="no results stream"):
            await ResultsLink.open("127.0.0.1", 1, TOKEN, print, print)  # nobody listens
        assert not subscribers._links
        for listener in (serving, steps_only):
            await listener.close()

    run(go())


def test_a_node_that_never_answers_the_hello_is_given_up_and_hung_up_on() -> None:
    async def go() -> None:
        hung_up = asyncio.Event()

        async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.read()  # until the driver closes its end
            hung_up.set()
            writer.close()

        server = await asyncio.start_server(silent, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        with pytest.raises(StepLinkError, match="no results stream"):
            await ResultsLink.open("127.0.0.1", port, TOKEN, print, print, timeout_s=0.3)
        await asyncio.wait_for(hung_up.wait(), 5)
        server.close()
        await server.wait_closed()

    run(go())


@pytest.mark.parametrize(
    ("frame", "why"),
    [
        (FRAME.pack(3) + b"\xff\xff\xff", "a malformed result batch"),
        (FRAME.pack(2**31), "2147483648-byte frame"),
        (b"", "closed the results stream"),
    ],
)
def test_a_bad_results_frame_or_a_lost_node_ends_the_stream_and_says_so(
    frame: bytes, why: str
) -> None:
    async def go() -> None:
        async def node_side(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.read(4 + 4 + len(TOKEN))  # the hello
            good = _results(1).SerializeToString()
            writer.write(ACCEPTED + FRAME.pack(len(good)) + good + frame)
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(node_side, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        received: list[pb.ResultBatch] = []
        ends = _Ends()
        await ResultsLink.open("127.0.0.1", port, TOKEN, received.append, ends)
        await _until(lambda: ends.whys)
        await asyncio.sleep(0.05)
        assert received == [_results(1)]
        assert len(ends.whys) == 1 and why in ends.whys[0]
        server.close()
        await server.wait_closed()

    run(go())


def test_the_node_ends_a_results_stream_that_sends_it_anything() -> None:
    async def go() -> None:
        subscribers = Subscribers()
        listener = StepListener(TOKEN, lambda message: None, subscribers.add_link)
        await listener.start("127.0.0.1")
        ends = _Ends()
        link = await ResultsLink.open("127.0.0.1", listener.port, TOKEN, print, ends)
        link._transport.write(b"x")  # what no driver of this module writes
        await _until(lambda: ends.whys)
        assert "closed the results stream" in ends.whys[0]
        await _until(lambda: not subscribers._links)
        await listener.close()

    run(go())


def _generate_all(engine: GenerationEngine, prompts: list[tuple[int, ...]]):
    requests = [GenerationRequest(p, 12, RequestOptions(mtp=True)) for p in prompts]
    return asyncio.gather(*(engine.generate(r) for r in requests))


def test_a_driver_streams_steps_and_results_over_tcp_with_the_grpc_tokens(
    solo, model_dir: Path, tokenizer
) -> None:
    prompts = [tuple(tokenizer.encode(text)) for text in ("def add(a, b):", "import os\nimport")]

    async def go() -> None:
        tokens = {}
        for links in (True, False):
            pipeline = await load_pipeline(
                model_dir, solo.addresses, PipelineSettings(solo.token, links=links)
            )
            try:
                expected = "tcp" if links else "grpc"
                assert pipeline.transports == {"steps": expected, "results": [expected]}
                outputs = await _generate_all(GenerationEngine(pipeline), prompts)
                tokens[links] = [output.tokens for output in outputs]
                # Over TCP the decode steps went as records (the first steps, with their
                # options, as StepBatch messages).
                sent = (pipeline.records_sent, pipeline.messages_sent)
                assert 0 < sent[0] < sent[1] if links else sent[0] == 0
            finally:
                await pipeline.close()
        assert tokens[True] == tokens[False] and all(len(t) == 12 for t in tokens[True])

    run(go())


def test_a_driver_whose_results_stream_is_refused_listens_over_grpc(
    solo, model_dir: Path, tokenizer, monkeypatch
) -> None:
    """A node that serves steps but no results stream (one of an older version, say): the
    driver's steps still take its TCP port, its results come over gRPC."""

    async def refused(host: str, port: int, *args, **kwargs):
        raise StepLinkError(f"no results stream from {host}:{port}: refused")

    monkeypatch.setattr(ResultsLink, "open", refused)
    prompt = tuple(tokenizer.encode("def add(a, b):"))

    async def go() -> None:
        pipeline = await load_pipeline(model_dir, solo.addresses, PipelineSettings(solo.token))
        try:
            assert pipeline.transports == {"steps": "tcp", "results": ["grpc"]}
            output = await GenerationEngine(pipeline).generate(GenerationRequest(prompt, 6))
            assert len(output.tokens) == 6
        finally:
            await pipeline.close()

    run(go())


def test_a_node_that_dies_under_tcp_streams_fails_its_requests_with_its_name(
    node_factory, model_dir: Path, tokenizer
) -> None:
    victim = node_factory(1)[0]
    prompt = tuple(tokenizer.encode("def add(a, b):"))

    async def go() -> None:
        pipeline = await load_pipeline(model_dir, [victim.address], PipelineSettings(nodes.TOKEN))
        try:
            assert pipeline.transports == {"steps": "tcp", "results": ["tcp"]}
            engine = GenerationEngine(pipeline)
            chunks: list = []
            killed_at = 0.0

            def on_chunk(chunk) -> None:
                nonlocal killed_at
                chunks.append(chunk)
                if len(chunks) == 3:
                    killed_at = time.monotonic()
                    victim.kill()

            request = GenerationRequest(prompt, 4000, RequestOptions(mtp=True))
            with pytest.raises(NodeUnavailable) as caught:
                await asyncio.wait_for(engine.generate(request, on_chunk), 30)
            assert time.monotonic() - killed_at < 5.0
            assert victim.address in str(caught.value)
            with pytest.raises(NodeUnavailable):  # and so does every later submission
                await engine.generate(GenerationRequest(prompt, 4, RequestOptions()))
        finally:
            await pipeline.close()

    run(go())
