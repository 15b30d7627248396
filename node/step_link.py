"""The step stream from a node to its successor over plain TCP, beside gRPC.

A decode step crosses every hop, so a hop's cost is paid once per node per token. Over a
grpc.aio stream a hop took 1.8x a bare grpc.aio echo (BENCHMARKS.md, "Hop, the measured
cause"): the step's codec runs inside gRPC's message path, cold, and gRPC's own per-message
Python work comes on top. The same serialized `StepBatch` (`wire.step_batch_bytes`) sent as a
length-prefixed frame on an asyncio TCP stream costs about what the echo costs. The control
plane (LoadShard, Info, Results, Release) stays on gRPC, and so does everything under TLS: the
successor advertises this port in its `NodeInfo.step_port` only when it serves without TLS.

The stream is one-way, as the gRPC one is used:

    sender:   MAGIC, u32 token length, token         (once; a wrong token closes the stream)
    listener: ACCEPTED                               (once)
    sender:   per step: u32 length, a serialized StepBatch

A malformed frame closes the stream (the sender sees it broken and opens a new one); results
and errors reach the coordinator over its Results stream, as always.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import socket
import struct
from collections.abc import Callable

from google.protobuf.message import DecodeError

from proto import cluster_pb2 as pb

log = logging.getLogger(__name__)

MAGIC = b"CSL1"
FRAME = struct.Struct("<I")
MAX_TOKEN_BYTES = 4096
MAX_FRAME_BYTES = 1 << 30  # a prefill chunk's hidden states, with room to spare
HELLO_TIMEOUT_S = 10.0
ACCEPTED = b"\x01"  # the listener's one answer, after a good hello


class StepLinkError(ConnectionError):
    """The link to the successor could not be opened or broke."""


def _no_delay(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class StepListener:
    """Accepts step streams from predecessors and hands each message to `accept`."""

    def __init__(self, token: str, accept: Callable[[pb.StepBatch], None]):
        self._token = token.encode()
        self._accept = accept
        self._server: asyncio.Server | None = None
        self._streams: dict[asyncio.StreamWriter, asyncio.Task] = {}
        self.port = 0

    async def start(self, host: str, port: int = 0) -> int:
        self._server = await asyncio.start_server(self._serve, host, port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            streams = list(self._streams.items())
            for writer, _ in streams:  # their reads end and the streams finish by themselves
                writer.close()
            if streams:  # (a stream task cancelled instead logs an error on Python 3.11)
                await asyncio.wait([task for _, task in streams], timeout=5)
            await self._server.wait_closed()
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._streams[writer] = asyncio.current_task()
        peer = writer.get_extra_info("peername")
        try:
            if not await self._hello(reader):
                log.warning("refused a step stream from %s: bad hello or token", peer)
                return
            _no_delay(writer)
            writer.write(ACCEPTED)
            while True:
                try:
                    header = await reader.readexactly(FRAME.size)
                except asyncio.IncompleteReadError:
                    return  # the sender closed its stream
                (size,) = FRAME.unpack(header)
                if size > MAX_FRAME_BYTES:
                    log.warning("step stream from %s sent a %d-byte frame; closing it", peer, size)
                    return
                try:
                    message = pb.StepBatch.FromString(await reader.readexactly(size))
                except DecodeError as error:
                    log.warning("step stream from %s sent a malformed step (%s)", peer, error)
                    return
                self._accept(message)
        except (asyncio.IncompleteReadError, OSError) as error:
            log.info("step stream from %s ended: %s", peer, error)
        finally:
            self._streams.pop(writer, None)
            writer.close()

    async def _hello(self, reader: asyncio.StreamReader) -> bool:
        try:
            async with asyncio.timeout(HELLO_TIMEOUT_S):
                if await reader.readexactly(len(MAGIC)) != MAGIC:
                    return False
                (size,) = FRAME.unpack(await reader.readexactly(FRAME.size))
                if size > MAX_TOKEN_BYTES:
                    return False
                token = await reader.readexactly(size)
        except (TimeoutError, asyncio.IncompleteReadError):
            return False
        return hmac.compare_digest(token, self._token)


class StepSender:
    """One step stream to a successor's `StepListener`."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, address: str):
        self.address = address
        self._writer = writer
        # The successor never writes after its hello answer: a read that ends is the stream
        # closed under us (the successor stopped, or refused a frame).
        self._closed = asyncio.ensure_future(reader.read())

    @classmethod
    async def open(cls, host: str, port: int, token: str, timeout_s: float = 10.0) -> StepSender:
        address = f"{host}:{port}"
        secret = token.encode()
        try:
            async with asyncio.timeout(timeout_s):
                reader, writer = await asyncio.open_connection(host, port)
                _no_delay(writer)
                writer.write(MAGIC + FRAME.pack(len(secret)) + secret)
                answer = await reader.read(len(ACCEPTED))
        except (OSError, TimeoutError) as error:
            raise StepLinkError(f"cannot open a step stream to {address}: {error}") from None
        if answer != ACCEPTED:
            writer.close()
            raise StepLinkError(f"{address} refused the step stream (a wrong cluster token?)")
        return cls(reader, writer, address)

    @property
    def broken(self) -> bool:
        return self._closed.done() or self._writer.is_closing()

    async def send(self, payload: bytes) -> None:
        """Queue one serialized StepBatch and wait while the socket's buffer is full."""
        if self.broken:
            raise StepLinkError(f"the step stream to {self.address} was closed")
        if len(payload) > MAX_FRAME_BYTES:
            raise StepLinkError(f"a step of {len(payload)} bytes exceeds {MAX_FRAME_BYTES}")
        self._writer.writelines((FRAME.pack(len(payload)), payload))
        await self._writer.drain()

    async def close(self) -> None:
        self._closed.cancel()
        self._writer.close()
        with contextlib.suppress(OSError):
            await self._writer.wait_closed()
