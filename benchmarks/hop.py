"""The cost of one pipeline hop on loopback, by framing: which one the step stream should use.

    python -m benchmarks.hop --json out.json [--rounds 6 --iters 500] [--runs 5] [--ablate]
        [--uvloop] [--variants proto,grpc,...] [--shapes 1x2x5120 1x512x5120]

An echo server runs in a child process (a node is its own process); the client sends a
decode-size step (one request, 2 tokens, bf16 hidden states) and waits for the echo. One way
is half the round trip, and each way does a hop's real work:

  link       the nodes' step stream (`cluster.transport.step_link`), as between nodes now:
             the step as records (`cluster.transport.step_records`) each way over the
             product's TCP link (the server replies over a link of its own), decoded and
             encoded again as a node does
  proto      grpc.aio bidi stream of `StepBatch`, as every hop under TLS: the sender
             serializes as a node sends on the step it received (`wire.forwarded_step_bytes`),
             the receiver parses (`StepBatch.FromString`) and decodes (entries + mx.array);
             the server encodes its own output for the reply the same way
  proto-msg  the same, the step handed to gRPC as a message (`wire.step_batch_to_proto`, gRPC
             serializes it): the nodes' encode before `step_batch_bytes`, three copies of the
             hidden states instead of one
  msgpack    the same stream and work, the step framed with msgpack inside a bytes field
  grpc       grpc.aio bidi stream echoing raw bytes (the serialized step), no codec
  grpc+busy  the grpc echo plus, at each end, a busy loop as long as one hop's codec (the
             codec variant, timed first): the codec's CPU time with none of its memory traffic
  tcp        asyncio TCP echo of the same bytes, length-prefixed, no codec
  tcp+proto  the proto variant's work over that TCP framing instead of gRPC
  codec      the link's codec alone, no network (per hop): the step's records encoded and
             decoded (its hidden states into MLX)
  codec-cold the codec variant with the thread asleep 100 us before each hop (not timed), as
             a hop's codec runs: on a thread that has just woken
  driver     a driver's two legs, as the driver takes them now: a step (tokens as records, no
             hidden states) to the head's step port as a step stream, and the tail's result back on
             the driver's results stream from the same port (`cluster.transport.results_link`), each
             decoded as the node and the driver decode them
  driver-grpc the same two legs over gRPC, as before (and under TLS): the Steps stream and the
             Results stream, the result queued for the Results stream as a node queues it

Compare proto - grpc with grpc+busy - grpc, and codec-cold with codec: how much of a hop's
codec cost comes from running cold (caches and branch history lost to other threads' work
while it waited) rather than from its own CPU time. Every variant runs on its own long-lived
stream and all are timed in interleaved rounds, in a new shuffled order each round, so
background load and what ran just before hit them alike; codec-cold's rounds come after the
others' (its sleeps slow whatever runs next for a while). `--ablate` also times the proto
stream under gRPC defaults and with each tuned option left out or one added (a server process
per setting; gRPC may log the GOAWAYs of their teardown, GRPC_VERBOSITY=ERROR quiets it).

`--runs N` times everything N times over, each run with an echo server and streams of its
own: where the processes' threads fall on the cores moves a run's figures more than anything
compared here (the echo 44-89 µs from run to run on H200 hosts, BENCHMARKS.md), so
the link's ratio to the echo, the hop goal's, is printed per run. On a many-core machine, pin
the run to two cores (`taskset -c 2,3`) to time the transports rather than idle-core wakeups.
Like every cluster process it runs gRPC's older I/O path (`cluster.transport.grpc_io`);
`GRPC_EXPERIMENTS= python -m benchmarks.hop` times gRPC's defaults.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import itertools
import json
import multiprocessing as mp
import os
import platform
import random
import socket
import struct
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import grpc
import mlx.core as mx
import msgpack
import numpy as np
from google.protobuf import wrappers_pb2

from benchmarks.common import bench_parser
from cluster.messages import MAX_MTP_DEPTH, StepRequest, StepResult
from cluster.transport import step_records, wire
from cluster.transport.failover import Route, StepStreamLink
from cluster.transport.results_link import ResultsLink
from cluster.transport.step_link import StepListener, StepSender
from node.stage import Subscribers
from proto import cluster_pb2 as pb

SHAPES = ((1, 2, 5120), (1, 1, 256))  # Qwen3.5-27B's hidden size; a tiny model's
VARIANTS = (
    "link", "proto", "proto-msg", "msgpack", "grpc", "grpc+busy", "tcp", "tcp+proto", "codec",
    "codec-cold", "driver", "driver-grpc",
)  # fmt: skip
LINK_TOKEN = "hop-bench"
METHOD = "/bench.Hop/{}"
COLD_SLEEP_S = 100e-6
_LEN = struct.Struct("<I")
Options = list[tuple[str, int | str]]


@dataclass(frozen=True, slots=True)
class Row:
    options: str
    variant: str
    shape: str
    payload_bytes: int
    median_us: float
    p90_us: float
    iters: int
    run: int = 1  # which of `--runs` (each with processes of its own)


# ---- the step and its two codecs ----


def decode_size_step(shape: tuple[int, ...]) -> tuple[list[StepRequest], mx.array]:
    """One request's step of `shape[1]` positions: a token and its drafts, or (longer than
    any MTP step) a prompt's chunk."""
    n = shape[1]
    tokens = tuple(range(151_643, 151_643 - n, -1))
    drafts = n - 1 if n <= 1 + MAX_MTP_DEPTH else 0
    entries = [StepRequest("chatcmpl-0123456789abcdef", tokens, 1234, draft_len=drafts)]
    hidden = mx.random.normal(shape, key=mx.random.key(0)).astype(mx.bfloat16)
    mx.eval(hidden)
    return entries, hidden


def msgpack_encode(entries: list[StepRequest], hidden: mx.array, sequence: int) -> bytes:
    """A minimal rival codec: positional lists, bf16 only, no options, no checks."""
    steps = [
        [e.request_id, e.tokens, e.position, e.draft_len, e.rollback, e.sample] for e in entries
    ]
    tensor = [hidden.shape, bytes(memoryview(hidden))]  # bf16 only, as here
    return msgpack.packb([sequence, steps, tensor])


def msgpack_decode(data: bytes) -> tuple[list[StepRequest], mx.array, int]:
    sequence, steps, (shape, raw) = msgpack.unpackb(data)
    entries = [StepRequest(r, tuple(t), p, d, b, s) for r, t, p, d, b, s in steps]
    hidden = mx.array(np.frombuffer(raw, np.uint16).reshape(shape)).view(mx.bfloat16)
    return entries, hidden, sequence


@functools.cache
def _forward_output(shape: tuple[int, ...], dtype: mx.Dtype) -> mx.array:
    """Stands in for the layers: an evaluated array like the one received.

    A node encodes the output of its step's own `mx.eval`. Re-encoding the decoded (lazy) bf16
    view instead would time one extra MLX eval (~50 us on the CPU build), which is not the wire's.
    """
    out = mx.zeros(shape, dtype)
    mx.eval(out)
    return out


def received_step(step: tuple[list[StepRequest], mx.array]) -> pb.StepBatch:
    """The message a node receives for `step`: what it sends on (`forward_step`)."""
    return pb.StepBatch.FromString(wire.step_batch_bytes(*step, 0))


def forward_step(message: pb.StepBatch, hidden: mx.array) -> bytes:
    """A node's encode of its output: the entries it received, with its hidden states."""
    return wire.forwarded_step_bytes([message], hidden)


def link_encode(entries: list[StepRequest], hidden: mx.array, sequence: int) -> tuple[bytes, bool]:
    """A step as a node sends it on its step stream: (payload, whether it is records)."""
    records = step_records.encode(entries, hidden, sequence)
    if records is not None:
        return records, True
    return wire.step_batch_bytes(entries, hidden, sequence), False


def link_decode(
    step: step_records.StepRecords | pb.StepBatch,
) -> tuple[list[StepRequest], mx.array | None]:
    """A step from a node's step stream, decoded as the node decodes it."""
    if isinstance(step, step_records.StepRecords):
        return step.entries, step.hidden_array()
    entries, hidden, _ = wire.step_batch_from_proto(step)
    return entries, hidden


def _link_echo_step(step: step_records.StepRecords | pb.StepBatch) -> tuple[bytes, bool]:
    """A node's codec work on the step stream: decode the step, send it on with the layers'
    output."""
    entries, hidden = link_decode(step)
    return link_encode(entries, _forward_output(hidden.shape, hidden.dtype), 0)


def _proto_echo(msg: pb.StepBatch) -> bytes:
    """A node's codec work: decode the step, send its entries on with the layers' output."""
    _, hidden, _ = wire.step_batch_from_proto(msg)
    return forward_step(msg, _forward_output(hidden.shape, hidden.dtype))


def _proto_msg_echo(msg: pb.StepBatch) -> pb.StepBatch:
    entries, hidden, sequence = wire.step_batch_from_proto(msg)
    return wire.step_batch_to_proto(entries, _forward_output(hidden.shape, hidden.dtype), sequence)


def busy_wait(ns: int) -> None:
    """Burn `ns` of CPU in a loop that touches no memory to speak of."""
    end = time.perf_counter_ns() + ns
    while time.perf_counter_ns() < end:
        pass


def _msgpack_echo(msg: wrappers_pb2.BytesValue) -> wrappers_pb2.BytesValue:
    entries, hidden, sequence = msgpack_decode(msg.value)
    out = _forward_output(hidden.shape, hidden.dtype)
    return wrappers_pb2.BytesValue(value=msgpack_encode(entries, out, sequence))


# (echo, request deserializer, response serializer); None: raw bytes. A stream's echo is
# made per call from its metadata (`grpc+busy` takes its busy time from BUSY_NS).
BUSY_NS = "busy-ns"
_HANDLERS: dict[str, tuple[Callable, Callable | None, Callable | None]] = {
    "proto": (lambda md: _proto_echo, pb.StepBatch.FromString, None),
    "proto-msg": (
        lambda md: _proto_msg_echo,
        pb.StepBatch.FromString,
        pb.StepBatch.SerializeToString,
    ),
    "msgpack": (
        lambda md: _msgpack_echo,
        wrappers_pb2.BytesValue.FromString,
        wrappers_pb2.BytesValue.SerializeToString,
    ),
    "grpc": (lambda md: lambda b: b, None, None),
    "grpc+busy": (lambda md: functools.partial(_busy_echo, int(md[BUSY_NS])), None, None),
}


def _busy_echo(ns: int, b: bytes) -> bytes:
    busy_wait(ns)
    return b


# TCP echoes of whole frames
_TCP_ECHOES: dict[str, Callable[[bytes], bytes]] = {
    "tcp": lambda b: b,
    "tcp+proto": lambda b: _proto_echo(pb.StepBatch.FromString(b)),
}


def driver_step(i: int, records: bool = False) -> bytes:
    """A driver's decode step to the head: one request's tokens, no hidden states (as
    records, as the driver sends it on the head's step stream)."""
    entries, _ = decode_size_step((1, 1, 1))
    if records:
        return step_records.encode(entries, None, i)
    return wire.step_batch_to_proto(entries, None, i).SerializeToString()


def _tail_result(message: pb.StepBatch | step_records.StepRecords) -> pb.ResultBatch:
    """What a tail answers a step with, the layers and sampling left out."""
    entries = link_decode(message)[0]
    results = [StepResult(e.request_id, (42,), keep=len(e.tokens)) for e in entries]
    return wire.results_to_proto(results, [])


# ---- the echo server (child process) ----


def _stream_handler(make_echo: Callable) -> Callable:
    async def handle(requests, context: grpc.aio.ServicerContext):
        echo = make_echo(dict(context.invocation_metadata()))
        while (msg := await context.read()) is not grpc.aio.EOF:
            await context.write(echo(msg))

    return handle


def _tcp_handler(echo: Callable[[bytes], bytes]) -> Callable:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                (size,) = _LEN.unpack(await reader.readexactly(_LEN.size))
                reply = echo(await reader.readexactly(size))
                writer.write(_LEN.pack(len(reply)) + reply)
        except asyncio.IncompleteReadError:
            writer.close()

    return handle


async def _link_echo(client_port: int) -> tuple[StepListener, asyncio.Task]:
    """The nodes' step stream both ways: each step decoded, encoded again and sent back over
    a link to the client's own listener, in order."""
    replies: asyncio.Queue[tuple[bytes, bool]] = asyncio.Queue()  # (payload, records)
    listener = StepListener(LINK_TOKEN, lambda step: replies.put_nowait(_link_echo_step(step)))
    await listener.start("127.0.0.1")

    async def send_back() -> None:
        sender = await StepSender.open("127.0.0.1", client_port, LINK_TOKEN)
        while True:
            await sender.send(*await replies.get())

    return listener, asyncio.create_task(send_back())


def _driver_handlers(subscribers: Subscribers) -> dict[str, grpc.RpcMethodHandler]:
    """A node's Steps and Results streams, as `node.server` serves them: each step's result
    published to the subscribers' queues, each subscriber's queue drained by its stream."""

    async def steps(requests, context: grpc.aio.ServicerContext):
        async for message in requests:
            subscribers.publish(_tail_result(message))
        return
        yield  # a stream of answers, as the Steps method's, never written to

    async def results(request, context: grpc.aio.ServicerContext):
        queue = subscribers.add()
        try:
            await context.send_initial_metadata(())
            while True:
                yield await queue.get()
        finally:
            subscribers.remove(queue)

    return {
        "driver-steps": grpc.stream_stream_rpc_method_handler(
            steps, pb.StepBatch.FromString, pb.StepEvent.SerializeToString
        ),
        "driver-results": grpc.unary_stream_rpc_method_handler(
            results, pb.ResultsRequest.FromString, pb.ResultBatch.SerializeToString
        ),
    }


async def _serve(options: Options, ports: mp.Queue, stop: mp.Event, link_port: int) -> None:
    handlers = {
        name: grpc.stream_stream_rpc_method_handler(_stream_handler(echo), des, ser)
        for name, (echo, des, ser) in _HANDLERS.items()
    }
    # The driver variants' node: one set of subscribers per variant, as each has its own node.
    handlers |= _driver_handlers(Subscribers())
    linked = Subscribers()
    driver = StepListener(
        LINK_TOKEN, lambda message: linked.publish(_tail_result(message)), linked.add_link
    )
    server = grpc.aio.server(options=options)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("bench.Hop", handlers)])
    port = {"grpc": server.add_insecure_port("127.0.0.1:0")}
    tcp = {
        v: await asyncio.start_server(_tcp_handler(e), "127.0.0.1", 0)
        for v, e in _TCP_ECHOES.items()
    }
    port |= {v: s.sockets[0].getsockname()[1] for v, s in tcp.items()}
    link = await _link_echo(link_port) if link_port else None
    if link is not None:
        port["link"] = link[0].port
    port["driver"] = await driver.start("127.0.0.1")
    await server.start()
    ports.put(port)
    try:
        while not stop.is_set():
            await asyncio.sleep(0.05)
    finally:
        for s in tcp.values():
            s.close()
        if link is not None:
            link[1].cancel()
            await link[0].close()
        await driver.close()
        await server.stop(None)


def run_loop(coro, use_uvloop: bool = False):
    """asyncio.run, on uvloop's event loop if asked (it must be installed)."""
    factory = None
    if use_uvloop:
        import uvloop

        factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(coro)


def _server_main(
    options: Options, use_uvloop: bool, ports: mp.Queue, stop: mp.Event, link_port: int
) -> None:
    run_loop(_serve(options, ports, stop, link_port), use_uvloop)


class EchoServer:
    """The echo server in a child process, started and stopped as a context manager; with
    `link_port`, its link echo replies to the client's step listener there."""

    def __init__(self, options: Options, use_uvloop: bool = False, link_port: int = 0) -> None:
        ctx = mp.get_context("spawn")
        self._ports, self._stop = ctx.Queue(), ctx.Event()
        self._proc = ctx.Process(
            target=_server_main, args=(options, use_uvloop, self._ports, self._stop, link_port)
        )

    def __enter__(self) -> dict[str, int]:
        self._proc.start()
        return self._ports.get(timeout=60)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()


# ---- the client ----


@dataclass(frozen=True, slots=True)
class Setup:
    """gRPC options of one measured configuration (each gets its own server process)."""

    label: str
    server: Options
    channel: Options


class _Stream:
    """One long-lived bidi stream; `round_trip(i)` sends step `i` and takes in its echo."""

    def __init__(self, channel: grpc.aio.Channel, variant: str, step, busy_ns: int) -> None:
        entries, hidden = step
        payload = wire.step_batch_bytes(entries, hidden, 0)
        received = received_step(step)
        codecs = {
            "proto": (lambda i: forward_step(received, hidden), wire.step_batch_from_proto),
            "msgpack": (
                lambda i: wrappers_pb2.BytesValue(value=msgpack_encode(entries, hidden, i)),
                lambda m: msgpack_decode(m.value),
            ),
            "grpc": (lambda i: payload, lambda m: m),
            "proto-msg": (
                lambda i: wire.step_batch_to_proto(entries, hidden, i),
                wire.step_batch_from_proto,
            ),
            "grpc+busy": (lambda i: _busy_echo(busy_ns, payload), lambda m: m),
        }
        self._encode, self._decode = codecs[variant]
        _, des, ser = _HANDLERS[variant]  # the client serializes what the server deserializes
        metadata = ((BUSY_NS, str(busy_ns)),)
        self._call = channel.stream_stream(METHOD.format(variant), ser, des)(metadata=metadata)

    async def round_trip(self, i: int) -> None:
        await self._call.write(self._encode(i))
        self._decode(await self._call.read())

    async def close(self) -> None:
        await self._call.done_writing()
        await self._call.code()


class _Tcp:
    """asyncio TCP, length-prefixed frames, TCP_NODELAY; raw bytes or protobuf StepBatch."""

    def __init__(self, variant: str, step) -> None:
        entries, hidden = step
        payload = wire.step_batch_bytes(entries, hidden, 0)
        received = received_step(step)
        codecs = {
            "tcp": (lambda i: payload, lambda b: b),
            "tcp+proto": (
                lambda i: forward_step(received, hidden),
                lambda b: wire.step_batch_from_proto(pb.StepBatch.FromString(b)),
            ),
        }
        self._encode, self._decode = codecs[variant]

    async def open(self, port: int) -> _Tcp:
        self._reader, self._writer = await asyncio.open_connection("127.0.0.1", port)
        self._writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return self

    async def round_trip(self, i: int) -> None:
        payload = self._encode(i)
        self._writer.write(_LEN.pack(len(payload)) + payload)
        (size,) = _LEN.unpack(await self._reader.readexactly(_LEN.size))
        self._decode(await self._reader.readexactly(size))

    async def close(self) -> None:
        self._writer.close()


class _Link:
    """The nodes' step stream: steps out over a `StepStreamLink`, their echoes in through the
    client's `StepListener` (decoded as a node decodes a step)."""

    def __init__(self, step, inbox: asyncio.Queue) -> None:
        self._entries, self._hidden = step
        self._inbox = inbox

    async def open(self, port: int) -> _Link:
        # As a node streams to its successor: resumable, each frame kept until acknowledged.
        route = (Route("127.0.0.1", 0),)
        self._sender = await StepStreamLink.open("hop", route, "", LINK_TOKEN, None, port)
        return self

    async def round_trip(self, i: int) -> None:
        await self._sender.send(*link_encode(self._entries, self._hidden, i))
        link_decode(await self._inbox.get())

    async def close(self) -> None:
        await self._sender.close()


class _Driver:
    """A driver's legs: a step out to the "head", its result back from the "tail" (one
    process here), over the node's TCP port (`driver`) or its gRPC streams (`driver-grpc`)."""

    def __init__(self, variant: str) -> None:
        self._variant = variant
        self._inbox: asyncio.Queue[pb.ResultBatch] = asyncio.Queue()

    async def open(self, port: int, channel: grpc.aio.Channel) -> _Driver:
        if self._variant == "driver":
            self._sender = await StepSender.open("127.0.0.1", port, LINK_TOKEN)
            self._link = await ResultsLink.open(
                "127.0.0.1", port, LINK_TOKEN, self._inbox.put_nowait, print
            )
            return self
        steps = channel.stream_stream(METHOD.format("driver-steps"), None, pb.StepEvent.FromString)
        self._steps = steps()
        results = channel.unary_stream(
            METHOD.format("driver-results"),
            pb.ResultsRequest.SerializeToString,
            pb.ResultBatch.FromString,
        )
        self._results = results(pb.ResultsRequest())
        await self._results.wait_for_connection()
        return self

    async def round_trip(self, i: int) -> None:
        if self._variant == "driver":
            await self._sender.send(driver_step(i, records=True), records=True)
            batch = await self._inbox.get()
        else:
            await self._steps.write(driver_step(i))
            batch = await self._results.read()
        wire.results_from_proto(batch)

    async def close(self) -> None:
        if self._variant == "driver":
            self._link.close()
            await self._sender.close()
        else:
            self._results.cancel()
            self._steps.cancel()


class _Codec:
    """The link's codec alone: each 'round trip' is two hops of encode + decode, each hop
    after `sleep_s` asleep (not timed) if given."""

    def __init__(self, step, sleep_s: float = 0.0) -> None:
        self._entries, self._hidden = step
        self._sleep_s = sleep_s

    def hop(self, i: int) -> None:
        data, records = link_encode(self._entries, self._hidden, i)
        link_decode(step_records.decode(data) if records else pb.StepBatch.FromString(data))

    async def round_trip(self, i: int) -> int:
        if not self._sleep_s:
            for _ in range(2):
                self.hop(i)
            return 0
        slept = 0
        for _ in range(2):
            t0 = time.perf_counter_ns()
            time.sleep(self._sleep_s)  # blocks the loop on purpose: nothing else runs
            slept += time.perf_counter_ns() - t0
            self.hop(i)
        return slept

    async def close(self) -> None:
        pass


async def _time(probe, iters: int) -> list[int]:
    samples = []
    for i in range(iters):
        t0 = time.perf_counter_ns()
        untimed = await probe.round_trip(i)
        samples.append(time.perf_counter_ns() - t0 - (untimed or 0))
    return samples


def codec_ns(step, iters: int = 300) -> int:
    """Median time of one hop's codec (encode + parse + decode), timed hot."""
    codec = _Codec(step)
    samples = []
    for i in range(iters):
        t0 = time.perf_counter_ns()
        codec.hop(i)
        samples.append(time.perf_counter_ns() - t0)
    return int(np.median(samples))


async def measure(
    setups: list[Setup],
    variants: list[str],
    shapes,
    rounds: int,
    iters: int,
    warmup: int,
    use_uvloop: bool = False,
) -> list[Row]:
    """Every (setup, variant, shape) on its own stream, timed in interleaved rounds.

    Interleaving spreads the machine's background load evenly over what is compared.
    """
    steps = {shape: decode_size_step(shape) for shape in shapes}
    busy = {shape: codec_ns(step) for shape, step in steps.items()}
    inbox: asyncio.Queue[step_records.StepRecords | pb.StepBatch] = asyncio.Queue()
    link_listener = StepListener(LINK_TOKEN, inbox.put_nowait)
    link_port = await link_listener.start("127.0.0.1") if "link" in variants else 0
    with contextlib.ExitStack() as servers:
        ports = [servers.enter_context(EchoServer(s.server, use_uvloop, link_port)) for s in setups]
        async with contextlib.AsyncExitStack() as stack:
            stack.push_async_callback(link_listener.close)
            probes = {}
            for setup, port in zip(setups, ports, strict=True):
                ch = grpc.aio.insecure_channel(f"127.0.0.1:{port['grpc']}", options=setup.channel)
                await stack.enter_async_context(ch)
                await asyncio.wait_for(ch.channel_ready(), 30)
                for v, shape in itertools.product(variants, shapes):
                    if v.startswith("driver") and shape != shapes[0]:
                        continue  # a driver's step carries tokens: no shape of its own
                    step = steps[shape]
                    if v == "link":
                        probe = await _Link(step, inbox).open(port[v])
                    elif v.startswith("driver"):
                        probe = await _Driver(v).open(port["driver"], ch)
                    elif v in _TCP_ECHOES:
                        probe = await _Tcp(v, step).open(port[v])
                    elif v == "codec":
                        probe = _Codec(step)
                    elif v == "codec-cold":
                        probe = _Codec(step, sleep_s=COLD_SLEEP_S)
                    else:
                        probe = _Stream(ch, v, step, busy[shape])
                    stack.push_async_callback(probe.close)
                    probes[setup.label, v, shape] = probe
            samples = {key: [] for key in probes}
            # codec-cold's sleeps slow whatever runs after them for a while: it goes last
            cold = [key for key in probes if key[1] == "codec-cold"]
            for group in ([key for key in probes if key not in cold], cold):
                for key in group:
                    await _time(probes[key], warmup)
                for r in range(rounds):
                    # a variant runs slower after some others (the codec's hot loop): shuffle
                    for key in random.Random(r).sample(group, len(group)):
                        samples[key] += await _time(probes[key], iters)
    sizes = {s: len(wire.step_batch_bytes(*steps[s], 0)) for s in shapes}
    return [
        _row(
            label,
            v,
            shape,
            len(driver_step(0)) if v.startswith("driver") else sizes[shape],
            samples[label, v, shape],
        )
        for label, v, shape in probes
    ]


def _row(label: str, variant: str, shape, payload: int, samples: list[int]) -> Row:
    one_way = np.asarray(samples) / 2e3  # ns round trip -> us one way
    median, p90 = np.percentile(one_way, [50, 90])
    shape_name = "x".join(map(str, shape))
    return Row(label, variant, shape_name, payload, float(median), float(p90), len(samples))


# ---- option ablation ----


def _without(options: Options, key: str) -> Options:
    return [(k, v) for k, v in options if k != key]


def ablation_setups() -> list[Setup]:
    """gRPC defaults, the tuned options, and the tuned ones with one left out or one added."""
    server, channel = wire.grpc_server_options(), wire.grpc_channel_options()
    setups = [Setup("grpc defaults", [], []), Setup("tuned", server, channel)]
    for key in sorted({k for k, _ in server + channel}):
        setups.append(Setup(f"tuned - {key}", _without(server, key), _without(channel, key)))
    extras = [
        ("grpc.optimization_target", "latency"),
        ("grpc.http2.bdp_probe", 0),
        ("grpc.experimental.tcp_read_chunk_size", 256 * 1024),
        ("grpc.http2.write_buffer_size", 256 * 1024),
        ("grpc.enable_retries", 1),
    ]
    for key, value in extras:
        extra = [(key, value)]
        setups.append(
            Setup(
                f"tuned + {key}={value}",
                _without(server, key) + extra,
                _without(channel, key) + extra,
            )
        )
    return setups


def _table(rows: list[Row]) -> str:
    head = (
        f"{'options':<44} {'variant':<11} {'shape':<9} {'bytes':>6} {'median_us':>9} {'p90_us':>7}"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"{r.options:<44} {r.variant:<11} {r.shape:<9} {r.payload_bytes:>6} "
            f"{r.median_us:>9.1f} {r.p90_us:>7.1f}"
        )
    return "\n".join(lines)


def link_over_echo(rows: list[Row]) -> dict[str, list[float]]:
    """The hop goal's ratio, the link's one way over the bare gRPC echo's, by shape: one per
    run, in run order (empty where a run timed only one of them)."""
    median = {(r.run, r.variant, r.shape): r.median_us for r in rows}
    ratios: dict[str, list[float]] = {}
    for run, variant, shape in median:
        if variant == "link" and (run, "grpc", shape) in median:
            ratio = median[run, "link", shape] / median[run, "grpc", shape]
            ratios.setdefault(shape, []).append(ratio)
    return ratios


def _report(tuned: Setup, timing, loop: str, rows: list[Row], ablation: list[Row]) -> dict:
    affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    return {
        "machine": {
            "platform": platform.platform(),
            "python": sys.version.split()[0],
            "grpc": grpc.__version__,
            "cpus": os.cpu_count(),
            "affinity": sorted(affinity) if affinity else None,
            "load_average": os.getloadavg(),
            "event_loop": loop,
            "grpc_experiments": os.environ.get("GRPC_EXPERIMENTS"),  # cluster.transport.grpc_io
        },
        "timing": dict(zip(("rounds", "iters", "warmup"), timing, strict=True)),
        "server_options": tuned.server,
        "channel_options": tuned.channel,
        "rows": [asdict(r) for r in rows],
        "ablation": [asdict(r) for r in ablation],
    }


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser("hop", __doc__, model=False)
    parser.add_argument("--rounds", type=int, default=6, help="interleaved rounds")
    parser.add_argument("--iters", type=int, default=500, help="round trips per round")
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument(
        "--runs",
        type=int,
        default=1,
        help="times over, each with its own processes: where their threads fall sets a run's "
        "figures, so one run is one sample",
    )
    parser.add_argument("--ablate", action="store_true", help="also time each gRPC option")
    parser.add_argument("--uvloop", action="store_true", help="run both ends on uvloop")
    parser.add_argument(
        "--variants", type=lambda v: v.split(","), default=list(VARIANTS), help="comma-separated"
    )
    parser.add_argument(
        "--shapes",
        nargs="+",
        metavar="BxTxH",
        help="hidden-state shapes (default 1x2x5120 1x1x256)",
    )
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    if unknown := set(args.variants) - set(VARIANTS):
        parser.error(f"unknown variants {sorted(unknown)}; known: {', '.join(VARIANTS)}")
    mx.set_default_device(mx.cpu)
    timing = (args.rounds, args.iters, args.warmup)

    tuned = Setup("tuned", wire.grpc_server_options(), wire.grpc_channel_options())
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes] if args.shapes else SHAPES
    loop = "uvloop" if args.uvloop else "asyncio"
    experiments = os.environ.get("GRPC_EXPERIMENTS") or "gRPC's defaults"
    print(f"one way (round trip / 2) on loopback, {loop} event loop, microseconds")
    print(f"GRPC_EXPERIMENTS: {experiments} (cluster.transport.grpc_io)")
    rows = []
    for run in range(1, args.runs + 1):
        measured = run_loop(
            measure([tuned], args.variants, shapes, *timing, args.uvloop), args.uvloop
        )
        rows += [dataclasses.replace(row, run=run) for row in measured]
        if args.runs > 1:
            print(f"run {run} of {args.runs}")
        print(_table(measured))
    hop_over_echo = link_over_echo(rows)
    for shape, ratios in hop_over_echo.items():
        print(f"link / grpc echo at {shape}, by run: {' '.join(f'{r:.2f}' for r in ratios)}")

    ablation = []
    if args.ablate:
        setups = ablation_setups()
        ablation = run_loop(
            measure(setups, ["proto"], shapes[:1], *timing, args.uvloop), args.uvloop
        )
        print("\nthe proto stream by gRPC options")
        print(_table(ablation))

    if args.json:
        report = _report(tuned, timing, loop, rows, ablation) | {"link_over_echo": hop_over_echo}
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
