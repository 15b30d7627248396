"""A node's per-token path: step messages in, its layers, step messages (or tokens) out.

Messages from the upstream (the driver for the head, the previous node otherwise) queue up
while the shard computes; when it is free, everything queued (at most one step per request)
is merged into one packed batch, so requests in flight share each pass over the weights. The
output goes to the successor over one long-lived stream, or, on the tail, to the drivers
subscribed to the node's results. Per-request errors go to the subscribers too; the other
requests of the batch carry on.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import grpc
import mlx.core as mx
import numpy as np

from cluster.decode.late_input import LateInput
from cluster.decode.pipeline import is_prompt_chunk, take_batch
from cluster.decode.runner import CacheBudgetError, ShardRunner, without_tokens
from cluster.decode.worker import MLXWorker
from cluster.messages import RequestError, StepRequest, UnknownRequestError
from cluster.transport import step_records
from cluster.transport.auth import TLSConfig, open_channel, token_metadata
from cluster.transport.failover import LinkState, Route, StepStreamLink
from cluster.transport.hop_choice import split_host_port
from cluster.transport.hop_probe import HopProbe
from cluster.transport.results_link import ResultsOutbox
from cluster.transport.step_link import StepLinkError
from cluster.transport.step_records import StepRecords
from cluster.transport.wire import (
    WireError,
    dtype_name,
    forwarded_step_bytes,
    results_to_proto,
    step_batch_bytes,
    step_entries_from_proto,
    tensor_from_proto,
)
from proto import cluster_pb2 as pb

log = logging.getLogger(__name__)

Reply = Callable[[pb.StepEvent], None]
# A step as it arrives: a StepBatch, or a batch of plain decode steps as records (the step
# stream's short form). Both have `entries` with `request_id`, `tokens` and `draft_len`, a
# `sequence` and an `epoch`.
Inbound = pb.StepBatch | StepRecords
# The Node service's Steps method, for a stream that sends pre-serialized StepBatch bytes.
STEPS_METHOD = "/{}/Steps".format(pb.DESCRIPTOR.services_by_name["Node"].full_name)
INFO_METHOD = "/{}/Info".format(pb.DESCRIPTOR.services_by_name["Node"].full_name)
LINK_INFO_TIMEOUT_S = 10.0
# The most positions (prompt chunks and decode steps) that one batch of a stage computes.
MAX_BATCH_POSITIONS = 4096
# How long a step built ahead waits for its message before the node releases it. On CUDA its
# input kernel keeps the GPU busy while it waits, which slows other processes on the same GPU;
# a pipeline's next step comes within a token's time (tens of ms at the 27B shape).
AHEAD_WAIT_S = 0.1


def status_of(error: Exception) -> grpc.StatusCode:
    if isinstance(error, CacheBudgetError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(error, UnknownRequestError):
        return grpc.StatusCode.NOT_FOUND
    if isinstance(error, (RequestError, WireError)):
        return grpc.StatusCode.INVALID_ARGUMENT
    return grpc.StatusCode.INTERNAL


class Subscribers:
    """The drivers listening to this node's results and errors: over gRPC (a queue that the
    Results stream drains) or over a TCP results stream (`cluster.transport.step_link`),
    written to as each batch is published."""

    def __init__(self) -> None:
        self._queues: set[asyncio.Queue[pb.ResultBatch]] = set()
        self._links: dict[int, Callable[[bytes], None]] = {}
        self._link_ids = itertools.count()
        self._outboxes: dict[bytes, ResultsOutbox] = {}  # resumable results streams, by id

    def add(self) -> asyncio.Queue[pb.ResultBatch]:
        queue: asyncio.Queue[pb.ResultBatch] = asyncio.Queue()
        self._queues.add(queue)
        return queue

    def remove(self, queue: asyncio.Queue[pb.ResultBatch]) -> None:
        self._queues.discard(queue)

    def add_link(self, write: Callable[[bytes], None]) -> Callable[[], None]:
        """Subscribe a results stream's writer of serialized batches; returns its removal."""
        key = next(self._link_ids)
        self._links[key] = write
        return lambda: self._links.pop(key, None)

    def resume_link(self, stream_id: bytes, received: int) -> ResultsOutbox | None:
        """The resumable results subscription `stream_id` (a new one for an id not seen, when
        `received` is 0), to attach a stream to; None when batches it lacks are gone."""
        outbox = self._outboxes.get(stream_id)
        if outbox is None:
            if received:
                return None
            unsubscribe: Callable[[], None] | None = None

            def expired() -> None:
                self._outboxes.pop(stream_id, None)
                if unsubscribe is not None:
                    unsubscribe()

            outbox = self._outboxes[stream_id] = ResultsOutbox(expired)
            unsubscribe = self.add_link(outbox.publish)
        return outbox if outbox.can_resume(received) else None

    def publish(self, batch: pb.ResultBatch) -> None:
        for queue in self._queues:
            queue.put_nowait(batch)
        if self._links:
            payload = batch.SerializeToString()
            for write in list(self._links.values()):
                write(payload)

    def fail(
        self, request_ids: list[str], code: grpc.StatusCode, message: str, epoch: int = 0
    ) -> None:
        if request_ids:
            errors = [(rid, code, message) for rid in request_ids]
            self.publish(results_to_proto([], errors, epoch))


@dataclass(slots=True)
class _Inbound:
    message: Inbound
    reply: Reply
    request_ids: frozenset[str]
    arrived: float = field(default_factory=time.perf_counter)


@dataclass(frozen=True, slots=True)
class _Forward:
    """A step for the successor, serialized on the MLX worker: a StepBatch, or `records`."""

    payload: bytes
    request_ids: list[str]
    records: bool = False


def _entries(message: Inbound) -> list[StepRequest]:
    """A step's entries; `RequestError` for an invalid one (`WireError`: a bad option)."""
    if isinstance(message, StepRecords):
        return message.entries
    return step_entries_from_proto(message)


# A batch's way through the stage (`pb.StepPhases`), in its fields' order.
PHASES = ("queued", "handoff", "decode", "layers", "encode", "send")


@dataclass(slots=True)
class _Clock:
    """The instants of one batch's way through the stage (`time.perf_counter`); the worker's
    are set on the MLX thread."""

    arrived: float
    started: float = 0.0  # handed to the MLX thread
    computing: float = 0.0  # on the MLX thread, from here on
    ran: float = 0.0  # decoded
    run_done: float = 0.0  # `ShardRunner.run` returned
    computed: float = 0.0  # encoded; the MLX thread hands back
    returned: float = 0.0  # back on the event loop
    sent: float = 0.0

    def phases_ms(self) -> tuple[float, ...]:
        handoff = (self.computing - self.started) + (self.returned - self.computed)
        spans = (
            self.started - self.arrived,
            handoff,
            self.ran - self.computing,
            self.run_done - self.ran,
            self.computed - self.run_done,
            self.sent - self.returned,
        )
        return tuple(1000 * span for span in spans)


@dataclass(slots=True)
class StageStats:
    messages_in: int = 0
    batches_total: int = 0
    busy_s_total: float = 0.0  # compute time of every batch: busy share = its rate of growth
    latencies_ms: deque[float] = field(default_factory=lambda: deque(maxlen=100))
    # Where recent decode batches' time went, in PHASES' order.
    phases_ms: deque[tuple[float, ...]] = field(default_factory=lambda: deque(maxlen=100))

    @property
    def mean_latency_ms(self) -> float:
        return sum(self.latencies_ms) / len(self.latencies_ms) if self.latencies_ms else 0.0

    def mean_phases(self) -> pb.StepPhases:
        """Where recent decode batches' time went, means in ms (zeros before any)."""
        if not (n := len(self.phases_ms)):
            return pb.StepPhases()
        means = [sum(column) / n for column in zip(*self.phases_ms, strict=True)]
        return pb.StepPhases(**{f"{name}_ms": v for name, v in zip(PHASES, means, strict=True)})


class Downstream:
    """The long-lived step stream to the successor, reopened if it breaks. It sends the
    StepBatch serialized already (`step_batch_bytes`): over the successor's TCP step stream
    (`cluster.transport.step_link`) where it has one, else over gRPC, which passes the bytes
    on as they are. Plain decode steps go as records (`cluster.transport.step_records`) where
    the successor's stream takes them (`takes_records`, read when the stage encodes a step).
    """

    def __init__(
        self,
        address: str,
        token: str,
        tls: TLSConfig | None = None,
        routes: tuple[Route, ...] = (),
        node_id: str = "",
        on_moved: Callable[[LinkState], None] | None = None,
    ):
        self.address = address
        self._token = token
        self._tls = tls
        # Every address of the successor, best first: the TCP stream fails over among them
        # (`cluster.transport.failover`); none given: `address` alone.
        self._routes = routes
        self._node_id = node_id
        self._on_moved = on_moved
        self._channel: grpc.aio.Channel | None = None
        self._call: grpc.aio.StreamStreamCall | None = None
        self._link: StepStreamLink | None = None
        self.takes_records = False
        self.link_state: LinkState | None = None  # the TCP stream's, once opened

    async def send(self, payload: bytes, records: bool = False) -> None:
        if self._link is not None and self._link.broken:
            await self.close()
        if self._link is None and (self._call is None or self._call.done()):
            await self.close()
            await self._open()
        if records and not self.takes_records:  # encoded for a stream since replaced
            payload, records = step_records.step_batch_of(payload), False
        if self._link is not None:
            await self._link.send(payload, records)
        else:
            await self._call.write(payload)

    async def _open(self) -> None:
        self._channel = open_channel(self.address, self._tls)
        self._link = await self._open_link()
        if self._link is not None:
            return
        steps = self._channel.stream_stream(
            STEPS_METHOD, response_deserializer=pb.StepEvent.FromString
        )
        self._call = steps(metadata=token_metadata(self._token))

    @property
    def transport(self) -> str | None:
        """The stream in use: "tcp" (`cluster.transport.step_link`), "grpc", or None before a
        step."""
        if self._link is not None:
            return "tcp"
        return "grpc" if self._call is not None else None

    async def _open_link(self) -> StepStreamLink | None:
        """The successor's TCP step stream, if it serves one (its Info says), over the best of
        its addresses that answers, moving among them when one fails."""
        info = self._channel.unary_unary(
            INFO_METHOD,
            request_serializer=pb.InfoRequest.SerializeToString,
            response_deserializer=pb.NodeInfo.FromString,
        )
        reply = await info(
            pb.InfoRequest(), metadata=token_metadata(self._token), timeout=LINK_INFO_TIMEOUT_S
        )
        if not reply.step_port:
            return None
        host, port = split_host_port(self.address)
        routes = self._routes or (Route(host, port),)
        name = f"next node {self._node_id or reply.node_id or self.address}"
        try:
            link = await StepStreamLink.open(
                name, routes, reply.node_id, self._token, self._tls, reply.step_port, self._on_moved
            )
        except StepLinkError as error:  # a firewall, say: the gRPC stream still works
            log.warning("%s; streaming steps to %s over gRPC", error, self.address)
            return None
        self.takes_records = reply.step_records
        self.link_state = link.state
        return link

    async def close(self) -> None:
        if self._link is not None:
            await self._link.close()
        if self._call is not None:
            self._call.cancel()
        if self._channel is not None:
            await self._channel.close()
        self._call = self._channel = self._link = None
        self.takes_records = False


def _log_build_failure(built: Future) -> None:
    """A step built ahead that failed left the caches as they were; its batch runs anyway."""
    if not built.cancelled() and built.exception() is not None:
        log.warning("building the next step ahead failed", exc_info=built.exception())


@dataclass(frozen=True, slots=True)
class Successor:
    """The next node of the pipeline, as a stage streams to it: its address, the cluster
    token, and the TLS configuration when the cluster uses TLS."""

    address: str
    token: str
    tls: TLSConfig | None = None
    routes: tuple[Route, ...] = ()  # every address measured, best first (failover's order)
    node_id: str = ""


class Stage:
    def __init__(
        self,
        runner: ShardRunner,
        worker: MLXWorker,
        subscribers: Subscribers,
        *,
        successor: Successor | None = None,
        epoch: int = 0,
        micro_batches: int = 1,
        doorbell: LateInput | None = None,
    ):
        """A stage of pipeline epoch `epoch` over `runner`, passing its steps on to
        `successor` (None: the tail, which publishes results to `subscribers`)."""
        # The driver's placement this stage serves: a message of another epoch (from a node
        # that hung and woke up with an old placement's work) is refused, never computed.
        self.epoch = epoch
        self.runner = runner
        self.worker = worker
        self.subscribers = subscribers
        self.downstream: Downstream | None = None
        self.hop_probe: HopProbe | None = None
        if successor is not None:
            self.downstream = Downstream(
                successor.address,
                successor.token,
                successor.tls,
                successor.routes,
                successor.node_id,
                self._hop_moved,
            )
            self.hop_probe = HopProbe(successor.address, successor.token, successor.tls)
        self._successor = successor
        self.max_batch_positions = MAX_BATCH_POSITIONS
        # Pipeline parallelism: with one batch of every request, a node waits while the others
        # compute it. The head lets a share of the live requests in at a time instead, so the
        # groups follow one another through the nodes (LoadShardRequest.micro_batches).
        self.micro_batches = micro_batches if runner.spec.is_head and successor else 1
        self.stats = StageStats()
        # Where a batch of plain decode steps ran, the batch after it is built ahead on the
        # doorbell (cluster.decode.late_input), which the next batch's message rings.
        self.doorbell = doorbell
        self._expected: list[StepRequest] = []  # the steps built ahead, tokens zeroed
        if doorbell is not None:
            worker.before_submit = self._release_doorbell
        self._inbound: deque[_Inbound] = deque()
        self._wakeup = asyncio.Event()
        self._event_loop = asyncio.get_running_loop()
        self._task = asyncio.create_task(self._loop())

    def accept(self, message: Inbound, reply: Reply) -> None:
        self.stats.messages_in += 1
        rids = frozenset(entry.request_id for entry in message.entries)
        if message.epoch != self.epoch:
            text = f"step of pipeline epoch {message.epoch}; this node serves epoch {self.epoch}"
            log.info("refused a %s", text)
            reply(pb.StepEvent(sequence=message.sequence))
            # Answered in the message's own epoch: only a driver of that epoch listens to it.
            self.subscribers.fail(
                list(rids), grpc.StatusCode.FAILED_PRECONDITION, text, message.epoch
            )
            return
        self._inbound.append(_Inbound(message, reply, rids))
        self._wakeup.set()

    def _hop_moved(self, state: LinkState) -> None:
        """The hop now runs over another of the successor's addresses: ping that one."""
        old, successor = self.hop_probe, self._successor
        self.hop_probe = HopProbe(state.current.address, successor.token, successor.tls)
        if old is not None:
            task = asyncio.create_task(old.close())
            task.add_done_callback(lambda done: done.exception())

    async def close(self) -> None:
        self._task.cancel()
        self._inbound.clear()
        if self.doorbell is not None:
            self._release_doorbell()
            self.worker.before_submit = None
        if self.downstream:
            await self.downstream.close()
        if self.hop_probe:
            await self.hop_probe.close()
        await self.worker.run(self.runner.close)

    async def _loop(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while self._inbound:
                batch = self._take()
                try:
                    await self._process(batch)
                except Exception:  # keep serving; the requests of the batch get the error
                    log.exception("step batch failed")
                    rids = [rid for item in batch for rid in item.request_ids]
                    self.subscribers.fail(
                        rids, grpc.StatusCode.INTERNAL, "step failed on node", self.epoch
                    )

    def _take(self) -> list[_Inbound]:
        """Queued messages to run together, in arrival order (`take_batch`); on a head with
        micro-batches, at most its share of the requests live on the pipeline in decode steps,
        and every prompt chunk queued beside them (`is_prompt_chunk`)."""
        share = None
        if self.micro_batches > 1:
            # Held by the shard, or queued for their first step. (Lookups only: releases
            # change the shard's dict on the MLX worker thread meanwhile.)
            held = self.runner.requests
            new = {rid for item in self._inbound for rid in item.request_ids if rid not in held}
            share = -(-(len(held) + len(new)) // self.micro_batches)
        return take_batch(
            self._inbound,
            self.max_batch_positions,
            ids=lambda item: item.request_ids,
            size=lambda item: sum(len(e.tokens) for e in item.message.entries),
            max_requests=share,
            capped=lambda item: not all(map(is_prompt_chunk, item.message.entries)),
        )

    async def _process(self, batch: list[_Inbound]) -> None:
        clock = _Clock(arrived=min(item.arrived for item in batch))
        rung, parsed = False, None
        if self.doorbell is not None and self.doorbell.pending is not None:
            parsed = self._parse(batch)
            data = self._doorbell_input(batch, parsed) if parsed is not None else None
            self.doorbell.ring(data)
            rung = data is not None
        clock.started = time.perf_counter()
        output, errors, dropped, successors = await self.worker.run(
            self._compute, batch, clock, rung, parsed
        )
        clock.returned = time.perf_counter()
        elapsed = clock.returned - clock.started
        self.stats.latencies_ms.append(elapsed * 1000)
        self.stats.busy_s_total += elapsed
        self.stats.batches_total += 1
        if errors:
            self.subscribers.publish(results_to_proto([], errors, self.epoch))
        if dropped:  # the driver drops them on every node
            self.subscribers.publish(pb.ResultBatch(prefix_dropped=dropped, epoch=self.epoch))
        if output is None:
            return
        try:
            if self.downstream is None:
                self.subscribers.publish(output)
            else:
                await self._forward(output)
            if successors:
                self._build_ahead(successors)
        finally:
            clock.sent = time.perf_counter()
            if all(e.draft_len + 1 == len(e.tokens) for i in batch for e in i.message.entries):
                # Decode batches only: a prefill chunk's time would bend a token's figures.
                self.stats.phases_ms.append(clock.phases_ms())

    def _build_ahead(self, successors: list[StepRequest]) -> None:
        """Build (on CUDA, launch) the batch expected next on the doorbell; the MLX thread
        may stay in it until the next message rings the doorbell."""
        nbytes = self.runner.input_nbytes(successors)
        if nbytes is None or self.doorbell.pending is not None:
            return
        seq = self.doorbell.prepare(nbytes)
        built = self.worker.submit(self.runner.build_ahead, successors, self.doorbell, seq)
        built.add_done_callback(_log_build_failure)
        self._expected = successors
        self.doorbell.arm(seq)  # after the submission, which would release it
        self._event_loop.call_later(AHEAD_WAIT_S, self._release_doorbell, seq)

    def _release_doorbell(self, seq: int | None = None) -> None:
        """Release the step built ahead (`seq`: only if it is still that one)."""
        if self.doorbell.pending is not None and seq in (None, self.doorbell.pending):
            self.doorbell.ring(None)

    @staticmethod
    def _parse(batch: list[_Inbound]) -> list[list[StepRequest]] | None:
        """Each message's entries; None if one is invalid (`_compute` answers it)."""
        try:
            return [_entries(item.message) for item in batch]
        except (WireError, RequestError):
            return None

    def _doorbell_input(
        self, batch: list[_Inbound], parsed: list[list[StepRequest]]
    ) -> bytes | None:
        """The input of the steps built ahead, if `batch` (its entries `parsed`) is them: the
        head's token ids, or the hidden states every message carries, in order. None for
        anything else (the runner then undoes what was built and runs the batch as it came)."""
        entries = [e for item in parsed for e in item]
        if [without_tokens(e) for e in entries] != self._expected:
            return None
        if self.runner.spec.is_head:
            tokens = [e.tokens[0] for e in entries]
            if not all(0 <= t < self.runner.shard.vocab_size for t in tokens):
                return None  # refused by the runner, with its error
            return np.array(tokens, dtype=np.uint32).tobytes()
        dtype, width = dtype_name(self.runner.hidden_dtype), self.runner.shard.hidden_size
        parts = []
        for item in batch:
            message, shape = item.message, (1, len(item.message.entries), width)
            if isinstance(message, StepRecords):
                if message.dtype != dtype or message.hidden_shape != shape:
                    return None
                parts.append(message.hidden)
            else:
                if message.hidden.dtype != dtype or tuple(message.hidden.shape) != shape:
                    return None
                parts.append(message.hidden.data)  # a copy: read once it is known to fit
        data = b"".join(parts)
        return data if len(data) == self.runner.input_nbytes(entries) else None

    async def _forward(self, output: _Forward) -> None:
        try:
            await self.downstream.send(output.payload, output.records)
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, OSError) as error:
            await self.downstream.close()
            rids = output.request_ids
            message = f"next node {self.downstream.address} is unreachable: {error}"
            log.warning(message)
            self.subscribers.fail(rids, grpc.StatusCode.UNAVAILABLE, message, self.epoch)

    def _compute(
        self,
        batch: list[_Inbound],
        clock: _Clock,
        rung: bool = False,
        parsed: list[list[StepRequest]] | None = None,
    ) -> tuple[
        _Forward | pb.ResultBatch | None,
        list[tuple[str, grpc.StatusCode, str]],
        list[int],
        list[StepRequest] | None,
    ]:
        """On the MLX worker: decode, run the shard, encode; also the prefix snapshots that
        the shard no longer holds, and the steps to build ahead (`plain_successors`, where
        the stage has a doorbell; `rung`: the batch's input rang it; `parsed`: each message's
        entries, where the event loop parsed them already). Marks `clock` at each part's end."""
        clock.computing = time.perf_counter()
        errors: list[tuple[str, grpc.StatusCode, str]] = []
        steps: list[StepRequest] = []
        hidden: list[mx.array] = []
        ran = batch  # the messages whose entries are `steps`
        if rung and self.runner.ahead_matches(entries := [e for i in parsed for e in i]):
            steps = entries  # built ahead: their hidden states are in the doorbell already
        else:
            ran = []
            for i, item in enumerate(batch):
                try:
                    entries, h = self._decode(item.message, parsed[i] if parsed else None)
                except (WireError, RequestError) as error:
                    code = status_of(error)
                    # Answer on the sender's own stream too (from this worker thread, safely).
                    event = pb.StepEvent(sequence=item.message.sequence)
                    self._event_loop.call_soon_threadsafe(item.reply, event)
                    errors += [(rid, code, str(error)) for rid in item.request_ids]
                    continue
                ran.append(item)
                steps += entries
                if h is not None:
                    hidden.append(h)
        if not steps:
            return None, errors, [], None
        x = None
        if hidden:
            x = hidden[0] if len(hidden) == 1 else mx.concatenate(hidden, axis=1)
        clock.ran = time.perf_counter()
        out = self.runner.run(steps, x)
        clock.run_done = time.perf_counter()
        errors += [(rid, status_of(e), str(e)) for rid, e in out.errors.items()]
        for rid in out.errors:  # a failed request is dropped on this node too
            self.runner.release(rid)
        dropped = out.prefix_dropped
        if not out.steps:
            return None, errors, dropped, None
        if out.hidden is None:
            encoded = results_to_proto(out.results, [], self.epoch)
        else:
            # The runner leaves out only failed requests: all ran, the entries are the same.
            encoded = self._encode(out.steps, out.hidden, ran, len(out.steps) == len(steps))
        clock.computed = time.perf_counter()
        successors = None
        if self.doorbell is not None and not errors:
            successors = self.runner.plain_successors(out.steps)
        return encoded, errors, dropped, successors

    def _decode(
        self, message: Inbound, entries: list[StepRequest] | None
    ) -> tuple[list[StepRequest], mx.array | None]:
        """A message's entries (parsed here unless given) and hidden states, checked."""
        if entries is None:
            entries = _entries(message)
        if isinstance(message, StepRecords):
            hidden = message.hidden_array()
        else:
            hidden = tensor_from_proto(message.hidden) if message.HasField("hidden") else None
        self._check_hidden(entries, hidden)
        return entries, hidden

    def _encode(
        self, steps: list[StepRequest], hidden: mx.array, ran: list[_Inbound], all_ran: bool
    ) -> _Forward:
        """The successor's step: records where its stream takes them and the steps fit
        them; else the entries received, as they came, if every one ran; else built again."""
        rids = [step.request_id for step in steps]
        if self.downstream is not None and self.downstream.takes_records:
            payload = step_records.encode(steps, hidden, 0, self.epoch)
            if payload is not None:
                return _Forward(payload, rids, records=True)
        messages = [item.message for item in ran]
        if all_ran and all(isinstance(m, pb.StepBatch) for m in messages):
            return _Forward(forwarded_step_bytes(messages, hidden, self.epoch), rids)
        return _Forward(step_batch_bytes(steps, hidden, 0, self.epoch), rids)

    def _check_hidden(self, entries: list[StepRequest], hidden: mx.array | None) -> None:
        spec = self.runner.spec
        if spec.is_head:
            if hidden is not None:
                raise RequestError("the head embeds tokens itself; a step for it has no hidden")
            return
        positions = sum(len(e.tokens) for e in entries)
        expected = (1, positions, self.runner.shard.hidden_size)
        if hidden is None or tuple(hidden.shape) != expected:
            got = None if hidden is None else tuple(hidden.shape)
            raise RequestError(f"hidden states of shape {got}, expected {expected}")
