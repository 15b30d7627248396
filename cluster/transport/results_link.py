"""A driver's results stream from one node over plain TCP, beside gRPC's Results stream.

Every token of a pipeline comes back to the driver from the tail, so this leg is paid once per
token, like a hop. The gRPC Results stream costs what a gRPC step stream costs
(`cluster.transport.step_link` says why); this one is the node's step port in its other
direction (the hello, then length-prefixed `ResultBatch` frames), and each batch reaches
`on_batch` in the event loop's own callback as its bytes arrive, with no task switch.

A resumable results stream (`stream_id`) survives its connection: the node keeps each batch in
the subscription's `ResultsOutbox` until the driver acknowledges it, and a driver that
reconnects, over any of the node's addresses, says how many it received and gets the rest.
The driver writes its count every `ACK_INTERVAL_S` (`send_ack`); the node answers each with a
zero-length frame, so that a driver that hears nothing knows the link is gone.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
from collections import deque
from collections.abc import Callable

from cluster.transport.step_link import (
    ACCEPTED,
    COUNT,
    FRAME,
    RESULTS_MAGIC,
    RESUMABLE_RESULTS_MAGIC,
    FrameError,
    FrameReader,
    StepLinkError,
)
from proto import cluster_pb2 as pb

log = logging.getLogger(__name__)

DETACHED_KEEP_S = 60.0  # how long a node keeps a detached subscription's batches for a resume


class ResultsOutbox:
    """A node's side of one resumable results subscription: every batch published, numbered
    from 1 and kept until the driver acknowledges it; written to the stream attached, if any.
    Detached for DETACHED_KEEP_S, it ends (`on_expired`) and a resume of it is refused."""

    def __init__(self, on_expired: Callable[[], None]) -> None:
        self._on_expired = on_expired
        self.published = 0
        self._kept: deque[tuple[int, bytes]] = deque()
        self._write: Callable[[bytes], None] | None = None
        self._expiry: asyncio.TimerHandle | None = None

    def can_resume(self, received: int) -> bool:
        """Whether a driver that received `received` batches can have every later one."""
        first_kept = self._kept[0][0] if self._kept else self.published + 1
        return first_kept - 1 <= received <= self.published

    def publish(self, payload: bytes) -> None:
        self.published += 1
        self._kept.append((self.published, payload))
        if self._write is not None:
            self._write(payload)

    def attach(self, write: Callable[[bytes], None], received: int = 0) -> None:
        """Write to `write` from now on, after the batches kept beyond `received`."""
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        self.ack(received)
        self._write = write
        for _, payload in self._kept:
            write(payload)

    def ack(self, received: int) -> None:
        while self._kept and self._kept[0][0] <= received:
            self._kept.popleft()

    def detach(self, write: Callable[[bytes], None]) -> None:
        """The stream that wrote with `write` ended: unless another took over, keep the
        batches for a resume, for DETACHED_KEEP_S."""
        if self._write != write:
            return  # an older connection, ending after its successor attached
        self._write = None
        if self._expiry is None:
            loop = asyncio.get_running_loop()
            self._expiry = loop.call_later(DETACHED_KEEP_S, self._on_expired)


class ResultsLink(asyncio.Protocol):
    """One node's results, each batch to `on_batch`; `on_closed` is told, once, why the
    stream ended under us (the node stopped, or sent what is not a ResultBatch), never when
    `close` ends it."""

    def __init__(
        self,
        token: bytes,
        on_batch: Callable[[pb.ResultBatch], None],
        on_closed: Callable[[str], None],
        stream_id: bytes | None = None,
        received: int = 0,
    ):
        self._token = token
        self._on_batch = on_batch
        self._on_closed = on_closed
        self._reader = FrameReader(pb.ResultBatch, "result batch")
        self._transport: asyncio.Transport | None = None
        self._accepted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._closing = False
        self.stream_id = stream_id
        self.received = received  # a resumable stream's batches, across its connections
        self.heard_at = asyncio.get_running_loop().time()  # the node's last bytes

    @classmethod
    async def open(
        cls,
        host: str,
        port: int,
        token: str,
        on_batch: Callable[[pb.ResultBatch], None],
        on_closed: Callable[[str], None],
        timeout_s: float = 10.0,
        stream_id: bytes | None = None,
        received: int = 0,
        tls_context: ssl.SSLContext | None = None,
    ) -> ResultsLink:
        """Connect and subscribe: once this returns, nothing the node publishes is lost. With
        `stream_id`, as that resumable subscription, of which `received` batches came; with
        `tls_context`, over TLS (the node's certificate checked against `host`)."""
        address = f"{host}:{port}"
        loop = asyncio.get_running_loop()
        link = None
        try:
            async with asyncio.timeout(timeout_s):
                _, link = await loop.create_connection(
                    lambda: cls(token.encode(), on_batch, on_closed, stream_id, received),
                    host,
                    port,
                    ssl=tls_context,
                    server_hostname=host if tls_context is not None else None,
                )
                await link._accepted
        except (OSError, TimeoutError, StepLinkError) as error:
            if link is not None:  # connected, but no answer in time
                link.close()
            raise StepLinkError(f"no results stream from {address}: {error}") from None
        return link

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        hello = FRAME.pack(len(self._token)) + self._token
        if self.stream_id is None:
            transport.write(RESULTS_MAGIC + hello)
        else:
            transport.write(
                RESUMABLE_RESULTS_MAGIC + hello + self.stream_id + COUNT.pack(self.received)
            )

    def data_received(self, data: bytes) -> None:
        self.heard_at = asyncio.get_running_loop().time()
        if not self._accepted.done():
            if data[:1] != ACCEPTED:
                self._end("refused the results stream (a wrong cluster token?)")
                return
            data = data[1:]
            self._accepted.set_result(None)
        try:
            self._reader.each(data, self._batch)
        except FrameError as error:
            self._end(f"sent {error}")

    def _batch(self, batch: pb.ResultBatch | None) -> None:
        if batch is not None:  # None: the node's answer to an ack
            self.received += 1
            self._on_batch(batch)

    def send_ack(self) -> None:
        """Tell a resumable stream's node how many batches came (it answers: a keepalive)."""
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(COUNT.pack(self.received))

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._accepted.done():  # closed on us before its answer: refused
            self._end("refused the results stream (a wrong cluster token?)")
        else:
            self._end(f"closed the results stream ({exc})" if exc else "closed the results stream")

    def _end(self, why: str) -> None:
        if self._transport is not None:
            self._transport.close()
        if not self._accepted.done():
            self._accepted.set_exception(StepLinkError(why))
            self._accepted.exception()  # read: `open` reports it, or nobody waits any more
        elif not self._closing:
            self._closing = True
            log.warning("results stream: %s", why)
            self._on_closed(why)

    def close(self) -> None:
        """End the stream without telling `on_closed`."""
        self._closing = True
        if self._transport is not None:
            self._transport.abort()  # nothing of ours is worth waiting for on a dead link
