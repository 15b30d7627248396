"""The step stream from a node to its successor over plain TCP, beside gRPC; and on the same
port, a driver's results stream from a node.

A decode step crosses every hop, so a hop's cost is paid once per node per token. Over a
grpc.aio stream a hop costs well over a bare grpc.aio echo: the step's codec runs inside gRPC's
message path, cold, and gRPC's own per-message Python work comes on top. The same serialized
`StepBatch` (`wire.step_batch_bytes`) sent as a length-prefixed frame on an asyncio TCP stream
costs about what the echo costs. The control
plane (LoadShard, Info, Release) stays on gRPC. Under TLS the stream is TLS over the same
port, with the cluster certificate (`TLSConfig.server_context`), checked against the address
dialled as gRPC checks it.

The stream is one-way, as the gRPC one is used:

    sender:   MAGIC, u32 token length, token         (once; a wrong token closes the stream)
    listener: ACCEPTED                               (once)
    sender:   per step: u32 length, a serialized StepBatch; or, to a listener whose node says
              it reads them (`NodeInfo.step_records`), u32 length | RECORDS_FLAG and a batch
              of plain decode steps as records (`cluster.transport.step_records`)

A malformed frame closes the stream (the sender sees it broken and opens a new one); results
and errors reach the driver over its results stream.

A resumable step stream (`cluster.transport.failover` opens them) names itself, so that it can
move to another of the successor's addresses without losing or repeating a step:

    sender:   RESUMABLE_MAGIC, u32 token length, token, 16-byte stream id   (once)
    listener: ACCEPTED, u64 frames of that stream taken so far (UNKNOWN_STREAM: a new id)
    sender:   frames as above; a zero-length frame is a keepalive
    listener: u64 frames taken, now and then (after frames, and for each keepalive)

A frame counts as taken once the listener handed it to its node, which computes it whatever
becomes of the stream. A stream id that reconnects closes its older connection first, so a
frame is taken at most once: the sender resends only the frames after the count.

The driver's legs take the same port where it can: its steps to the head as a step stream, and
each node's results back as a results stream (`cluster.transport.results_link`), the gRPC
Results stream's twin, which answers its hello once the subscription is in place:

    driver:   RESULTS_MAGIC, u32 token length, token (once)
    listener: ACCEPTED                               (once, subscribed: nothing later is lost)
    listener: per result batch: u32 length, a serialized ResultBatch
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import socket
import ssl
import struct
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol, TypeVar

from google.protobuf.message import DecodeError

from cluster.messages import RequestError
from cluster.transport import step_records
from cluster.transport.step_records import StepRecords
from cluster.transport.wire import WireError
from proto import cluster_pb2 as pb

log = logging.getLogger(__name__)

MAGIC = b"CSL1"
RESUMABLE_MAGIC = b"CSL2"
RESULTS_MAGIC = b"CSR1"
RESUMABLE_RESULTS_MAGIC = b"CSR2"
FRAME = struct.Struct("<I")
COUNT = struct.Struct("<Q")  # a resumable stream's frame count (acks, resume points)
STREAM_ID_BYTES = 16
UNKNOWN_STREAM = (1 << 64) - 1  # the resume point of a stream id the listener never saw
KEEPALIVE = FRAME.pack(0)
ACK_DELAY_S = 0.005  # acks of frames close together go as one
KEPT_STREAMS = 1024  # resumable streams whose counts a listener remembers
MAX_TOKEN_BYTES = 4096
MAX_FRAME_BYTES = 1 << 30  # a prefill chunk's hidden states, with room to spare
RECORDS_FLAG = 1 << 31  # in a step frame's length: the frame holds step records
HELLO_TIMEOUT_S = 10.0
ACCEPTED = b"\x01"  # the listener's one answer, after a good hello


class StepLinkError(ConnectionError):
    """The link to the successor could not be opened or broke."""


class FrameError(ValueError):
    """A frame that does not hold a message of its stream."""


# The messages that travel in frames: steps one way, a driver's results the other.
Message = TypeVar("Message", pb.StepBatch, pb.ResultBatch)


class FrameReader:
    """The messages of a stream's whole frames (u32 length, a serialized `kind`; with
    `records`, also step records frames), read by read. A read that starts with no partial
    frame pending, as a step's read does, is parsed from its own bytes, not copied into a
    buffer first; only a frame's unfinished part is kept (`pending`) for the next read."""

    def __init__(self, kind: type[Message], what: str, records: bool = False):
        self._parse = kind.FromString
        self._what = what
        self._records = records
        self.pending = bytearray()  # the start of a frame (or of a hello) not yet whole

    def each(self, data: bytes, handle: Callable[[Message | StepRecords | None], None]) -> None:
        """`handle` the message of each whole frame in `pending` and then `data`, as `frames`
        yields them (None for a zero-length frame, a resumable stream's keepalive). A read
        that is one whole frame with nothing pending, as a decode step's is, skips the
        generator's bookkeeping: a fifth of a hop's receive."""
        if not self.pending and len(data) >= FRAME.size:
            size, parse = self._header(data, 0)
            if len(data) == FRAME.size + size:
                handle(self._message(data, FRAME.size, len(data), parse))
                return
        for message in self.frames(data):
            handle(message)

    def frames(self, data: bytes) -> Iterator[Message | StepRecords | None]:
        """The messages of the whole frames in `pending` and then `data`, each parsed from
        the bytes themselves; a frame over MAX_FRAME_BYTES, or one that is not a `what`,
        raises FrameError. What the caller does not take (it stopped, or raised while
        handling a message) stays pending, from the frame after the last one yielded."""
        if self.pending:
            self.pending += data
            data, self.pending = self.pending, bytearray()
        offset = 0
        try:
            while len(data) - offset >= FRAME.size:
                size, parse = self._header(data, offset)
                end = offset + FRAME.size + size
                if len(data) < end:
                    break
                message = self._message(data, offset + FRAME.size, end, parse)
                offset = end
                yield message
        finally:  # the rest goes before any read that came meanwhile (none, as used here)
            if isinstance(data, bytearray):  # what was pending: keep its rest, not a copy
                del data[:offset]  # no view holds it now: it cannot shrink while one does
                data += self.pending
                self.pending = data
            elif offset < len(data):
                self.pending[:0] = memoryview(data)[offset:]

    def _header(self, data: bytes, offset: int) -> tuple[int, Callable]:
        """The size of the frame at `offset` and what parses it; FrameError if too big."""
        (size,) = FRAME.unpack_from(data, offset)
        parse = self._parse
        if self._records and size & RECORDS_FLAG:
            size, parse = size & ~RECORDS_FLAG, step_records.decode
        if size > MAX_FRAME_BYTES:
            raise FrameError(f"a {size}-byte frame")
        return size, parse

    def _message(
        self, data: bytes, start: int, end: int, parse: Callable
    ) -> Message | StepRecords | None:
        if end == start:
            return None  # a keepalive (never a message: a message's frame has bytes)
        with memoryview(data) as view, view[start:end] as frame:
            try:
                return parse(frame)
            except (DecodeError, WireError, RequestError) as error:
                raise FrameError(f"a malformed {self._what} ({error})") from None


def _no_delay(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


# A results subscription: given the stream's writer of serialized ResultBatch messages, it
# registers it and returns what unregisters it (`node.stage.Subscribers.add_link`).
Subscribe = Callable[[Callable[[bytes], None]], Callable[[], None]]


class ResumedResults(Protocol):
    """A resumable results subscription (`cluster.transport.results_link.ResultsOutbox`)."""

    def attach(self, write: Callable[[bytes], None], received: int) -> None: ...

    def ack(self, received: int) -> None: ...

    def detach(self, write: Callable[[bytes], None]) -> None: ...


# A resumable results subscription: (stream id, frames the driver received) to the
# subscription, ready to attach; None when it cannot resume (frames the driver lacks are gone).
ResumeResults = Callable[[bytes, int], ResumedResults | None]


@dataclass(slots=True)
class _Taken:
    """A resumable step stream as its listener knows it: frames taken, and its connection."""

    count: int = 0
    stream: _StepStream | None = None


class StepListener:
    """Accepts step streams from predecessors and hands each message to `accept`, in the
    event loop's own callback as its bytes arrive (no task per stream: a step reaches the
    stage without a task switch). With `subscribe`, it also serves results streams."""

    def __init__(
        self,
        token: str,
        accept: Callable[[pb.StepBatch | StepRecords], None],
        subscribe: Subscribe | None = None,
        resume_results: ResumeResults | None = None,
        tls_context: ssl.SSLContext | None = None,
    ):
        self.token = token.encode()
        self.tls_context = tls_context  # TLS: every stream is encrypted (`TLSConfig`)
        self.accept = accept
        self.subscribe = subscribe
        self.resume_results = resume_results
        # Resumable step streams by id, the most recent last (at most KEPT_STREAMS).
        self.taken: OrderedDict[bytes, _Taken] = OrderedDict()
        self._server: asyncio.Server | None = None
        self.streams: set[_StepStream] = set()
        self.port = 0

    async def start(self, host: str, port: int = 0) -> int:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _StepStream(self), host, port, ssl=self.tls_context
        )
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    def take_over(self, stream_id: bytes, stream: _StepStream) -> int:
        """Make `stream` the connection of resumable stream `stream_id`, closing an older
        one first: the frames taken so far (UNKNOWN_STREAM for an id never seen)."""
        taken = self.taken.get(stream_id)
        if taken is None:
            taken = self.taken[stream_id] = _Taken()
            while len(self.taken) > KEPT_STREAMS:
                self.taken.popitem(last=False)
            count = UNKNOWN_STREAM
        else:
            self.taken.move_to_end(stream_id)
            count = taken.count
        if taken.stream is not None and taken.stream is not stream:
            taken.stream.supersede()
        taken.stream = stream
        return count

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for stream in list(self.streams):
                stream.close()
            await self._server.wait_closed()
            self._server = None


class _StepStream(asyncio.Protocol):
    """One predecessor's stream: the hello, then length-prefixed steps; or a driver's results
    stream: the hello, then length-prefixed results the other way."""

    def __init__(self, listener: StepListener):
        self._listener = listener
        self._reader = FrameReader(pb.StepBatch, "step", records=True)
        self._greeted = False
        self._transport: asyncio.Transport | None = None
        self._hello_timer: asyncio.TimerHandle | None = None
        self._unsubscribe: Callable[[], None] | None = None  # a results stream's
        self._taken: _Taken | None = None  # a resumable step stream's count
        self._ack_timer: asyncio.TimerHandle | None = None
        self._results: ResumedResults | None = None  # a resumable results stream's
        self._superseded = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport
        self._peer = transport.get_extra_info("peername")
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._listener.streams.add(self)
        loop = asyncio.get_running_loop()
        self._hello_timer = loop.call_later(HELLO_TIMEOUT_S, self._refuse, "no hello in time")

    def connection_lost(self, exc: Exception | None) -> None:
        self._listener.streams.discard(self)
        if self._hello_timer is not None:
            self._hello_timer.cancel()
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        if self._ack_timer is not None:
            self._ack_timer.cancel()
        if self._results is not None:
            self._results.detach(self._write_results)
            self._results = None
        if self._taken is not None and self._taken.stream is self:
            self._taken.stream = None

    def supersede(self) -> None:
        """A newer connection of the same resumable stream took over: nothing more of this
        one is taken (what it still holds is resent there)."""
        self._superseded = True
        self._reader.pending.clear()
        if self._transport is not None:
            self._transport.abort()

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def data_received(self, data: bytes) -> None:
        if self._superseded:
            return
        if self._results is not None:
            self._results_acks(data)
            return
        if self._unsubscribe is not None:
            self._refuse("data on a results stream")  # a driver only ever reads from it
            return
        if not self._greeted:
            self._reader.pending += data
            if not self._hello():
                return
            data = b""
        self._steps(data)

    def _hello(self) -> bool:
        """Read the hello at the start of the pending bytes: True once a good one opened a
        step stream (the bytes after it are steps)."""
        buffer = self._reader.pending
        head = len(MAGIC) + FRAME.size
        if len(buffer) < head:
            return False
        (size,) = FRAME.unpack_from(buffer, len(MAGIC))
        magic = bytes(buffer[: len(MAGIC)])
        listener = self._listener
        results = magic == RESULTS_MAGIC and listener.subscribe is not None
        resumed_results = magic == RESUMABLE_RESULTS_MAGIC and listener.resume_results is not None
        known = (MAGIC, RESUMABLE_MAGIC)
        if (magic not in known and not results and not resumed_results) or size > MAX_TOKEN_BYTES:
            self._refuse("bad hello")
            return False
        extra = {RESUMABLE_MAGIC: STREAM_ID_BYTES, RESUMABLE_RESULTS_MAGIC: STREAM_ID_BYTES + 8}
        end = head + size + extra.get(magic, 0)
        if len(buffer) < end:
            return False
        if not hmac.compare_digest(bytes(buffer[head : head + size]), listener.token):
            self._refuse("wrong cluster token")
            return False
        stream_id = bytes(buffer[head + size : head + size + STREAM_ID_BYTES])
        received = COUNT.unpack_from(buffer, end - 8)[0] if resumed_results else 0
        del buffer[:end]
        self._greeted = True
        self._hello_timer.cancel()
        if resumed_results:
            if buffer:
                self._refuse("data before the results stream opened")
                return False
            self._results = listener.resume_results(stream_id, received)
            if self._results is None:
                self._refuse("results stream cannot resume: results it lacks are gone")
                return False
            self._transport.write(ACCEPTED)  # before the frames the subscription resends
            self._results.attach(self._write_results, received)
            return False
        if magic == RESUMABLE_MAGIC:
            count = listener.take_over(stream_id, self)
            self._taken = listener.taken[stream_id]
            self._transport.write(ACCEPTED + COUNT.pack(count))
            return True
        if results:
            if buffer:
                self._refuse("data on a results stream")
                return False
            self._unsubscribe = self._listener.subscribe(self._write_results)
        self._transport.write(ACCEPTED)
        return not results

    def _write_results(self, payload: bytes) -> None:
        """One serialized ResultBatch to the driver (buffered by the transport, as the gRPC
        stream's queue buffers for a slow reader)."""
        self._transport.write(FRAME.pack(len(payload)) + payload)

    def _steps(self, data: bytes) -> None:
        try:
            if self._taken is None:
                self._reader.each(data, self._accept_plain)
            else:
                self._reader.each(data, self._take)
                if self._ack_timer is None:
                    loop = asyncio.get_running_loop()
                    self._ack_timer = loop.call_later(ACK_DELAY_S, self._ack)
        except FrameError as error:
            self._refuse(str(error))

    def _accept_plain(self, message: pb.StepBatch | StepRecords | None) -> None:
        if message is not None:
            self._listener.accept(message)

    def _take(self, message: pb.StepBatch | StepRecords | None) -> None:
        """One frame of a resumable stream: counted once handed on (a keepalive is not)."""
        if message is not None:
            self._taken.count += 1
            self._listener.accept(message)

    def _ack(self) -> None:
        self._ack_timer = None
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(COUNT.pack(self._taken.count))

    def _results_acks(self, data: bytes) -> None:
        """A resumable results stream's driver writes the count of frames it received (also
        its keepalive): the subscription drops what it holds up to there, and a zero-length
        frame answers, so that the driver knows the stream is alive."""
        buffer = self._reader.pending
        buffer += data
        whole = len(buffer) - len(buffer) % COUNT.size
        if not whole:
            return
        (received,) = COUNT.unpack_from(buffer, whole - COUNT.size)
        del buffer[:whole]
        self._results.ack(received)
        self._transport.write(KEEPALIVE)

    def _refuse(self, why: str) -> None:
        log.warning("closed the step stream from %s: %s", self._peer, why)
        self._reader.pending.clear()
        self.close()


def _consume(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


class StepSender:
    """One step stream to a successor's `StepListener`. A resumable one (`stream_id`) counts
    its frames: `sent` and `acked` are the stream's totals across its connections, `resumed_at`
    the listener's count when this connection opened (UNKNOWN_STREAM: a new id), and
    `waiting_since` the moment since which an answer is due and has not come (None: none due)."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        address: str,
        resumed_at: int | None = None,
    ):
        self.address = address
        self._writer = writer
        self.resumed_at = resumed_at
        base = 0 if resumed_at in (None, UNKNOWN_STREAM) else resumed_at
        self.sent = self.acked = base
        self.waiting_since: float | None = None
        if resumed_at is None:
            # The successor never writes after its hello answer: a read that ends is the
            # stream closed under us (the successor stopped, or refused a frame).
            self._closed = asyncio.ensure_future(reader.read())
        else:
            self._closed = asyncio.ensure_future(self._read_acks(reader))
        self._closed.add_done_callback(_consume)  # a reset is what `broken` reports, no more

    @classmethod
    async def open(
        cls,
        host: str,
        port: int,
        token: str,
        timeout_s: float = 10.0,
        stream_id: bytes | None = None,
        tls_context: ssl.SSLContext | None = None,
    ) -> StepSender:
        """Connect and say hello; with `stream_id`, as that resumable stream; with
        `tls_context`, over TLS (the node's certificate checked against `host`)."""
        address = f"{host}:{port}"
        secret = token.encode()
        hostname = host if tls_context is not None else None
        try:
            async with asyncio.timeout(timeout_s):
                reader, writer = await asyncio.open_connection(
                    host, port, ssl=tls_context, server_hostname=hostname
                )
        except (OSError, TimeoutError) as error:
            raise StepLinkError(f"cannot open a step stream to {address}: {error}") from None
        _no_delay(writer)
        magic = MAGIC if stream_id is None else RESUMABLE_MAGIC
        writer.write(magic + FRAME.pack(len(secret)) + secret + (stream_id or b""))
        answer_size = len(ACCEPTED) + (0 if stream_id is None else COUNT.size)
        try:
            async with asyncio.timeout(timeout_s):
                answer = await reader.readexactly(answer_size)
        except (OSError, TimeoutError, asyncio.IncompleteReadError):
            answer = b""  # closed or reset on us: refused
        if answer[: len(ACCEPTED)] != ACCEPTED:
            writer.transport.abort()
            raise StepLinkError(f"{address} refused the step stream (a wrong cluster token?)")
        resumed_at = None if stream_id is None else COUNT.unpack_from(answer, 1)[0]
        return cls(reader, writer, address, resumed_at)

    async def _read_acks(self, reader: asyncio.StreamReader) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                data = await reader.readexactly(COUNT.size)
            except (asyncio.IncompleteReadError, OSError):
                return
            self.acked = max(self.acked, COUNT.unpack(data)[0])
            self.waiting_since = loop.time() if self.acked < self.sent else None

    def _expect_answer(self) -> None:
        if self.waiting_since is None:
            self.waiting_since = asyncio.get_running_loop().time()

    def keepalive(self) -> None:
        """Ask a resumable stream's listener for its count (an answer shows the link alive)."""
        if not self.broken:
            self._writer.write(KEEPALIVE)
            self._expect_answer()

    def abort(self) -> None:
        """Drop the connection at once, unsent bytes too (a send waiting on it fails)."""
        self._writer.transport.abort()

    @property
    def broken(self) -> bool:
        return self._closed.done() or self._writer.is_closing()

    async def ended(self) -> None:
        """Wait until the successor ends the stream (it stopped, or refused a frame)."""
        await asyncio.wait([self._closed])

    async def send(self, payload: bytes, records: bool = False) -> None:
        """Queue one serialized StepBatch (`records`: step records, to a listener whose node
        reads them) and wait while the socket's buffer is full."""
        if self.broken:
            raise StepLinkError(f"the step stream to {self.address} was closed")
        if len(payload) > MAX_FRAME_BYTES:
            raise StepLinkError(f"a step of {len(payload)} bytes exceeds {MAX_FRAME_BYTES}")
        size = len(payload) | RECORDS_FLAG if records else len(payload)
        self._writer.writelines((FRAME.pack(size), payload))
        if self.resumed_at is not None:
            self.sent += 1
            self._expect_answer()
        await self._writer.drain()

    async def close(self) -> None:
        self._closed.cancel()
        self._writer.close()
        with contextlib.suppress(OSError):
            await self._writer.wait_closed()
