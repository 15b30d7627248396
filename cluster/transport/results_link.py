"""A driver's results stream from one node over plain TCP, beside gRPC's Results stream.

Every token of a pipeline comes back to the driver from the tail, so this leg is paid once per
token, like a hop. The gRPC Results stream costs what a gRPC step stream costs
(`cluster.transport.step_link` says why); this one is the node's step port in its other
direction (the hello, then length-prefixed `ResultBatch` frames), and each batch reaches
`on_batch` in the event loop's own callback as its bytes arrive, with no task switch.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable

from cluster.transport.step_link import (
    ACCEPTED,
    FRAME,
    RESULTS_MAGIC,
    FrameError,
    FrameReader,
    StepLinkError,
)
from proto import cluster_pb2 as pb

log = logging.getLogger(__name__)


class ResultsLink(asyncio.Protocol):
    """One node's results, each batch to `on_batch`; `on_closed` is told, once, why the
    stream ended under us (the node stopped, or sent what is not a ResultBatch), never when
    `close` ends it."""

    def __init__(
        self,
        token: bytes,
        on_batch: Callable[[pb.ResultBatch], None],
        on_closed: Callable[[str], None],
    ):
        self._token = token
        self._on_batch = on_batch
        self._on_closed = on_closed
        self._reader = FrameReader(pb.ResultBatch, "result batch")
        self._transport: asyncio.Transport | None = None
        self._accepted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._closing = False

    @classmethod
    async def open(
        cls,
        host: str,
        port: int,
        token: str,
        on_batch: Callable[[pb.ResultBatch], None],
        on_closed: Callable[[str], None],
        timeout_s: float = 10.0,
    ) -> ResultsLink:
        """Connect and subscribe: once this returns, nothing the node publishes is lost."""
        address = f"{host}:{port}"
        loop = asyncio.get_running_loop()
        link = None
        try:
            async with asyncio.timeout(timeout_s):
                _, link = await loop.create_connection(
                    lambda: cls(token.encode(), on_batch, on_closed), host, port
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
        transport.write(RESULTS_MAGIC + FRAME.pack(len(self._token)) + self._token)

    def data_received(self, data: bytes) -> None:
        if not self._accepted.done():
            if data[:1] != ACCEPTED:
                self._end("refused the results stream (a wrong cluster token?)")
                return
            data = data[1:]
            self._accepted.set_result(None)
        try:
            self._reader.each(data, self._on_batch)
        except FrameError as error:
            self._end(f"sent {error}")

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
            self._transport.close()
