"""The round trip from a node to its successor, measured by the node itself.

While a shard with a successor is loaded, the node pings it (`LinkPing`, with a payload the
size of a decode step's activations at a small model's width) every `PROBE_INTERVAL_S` on a
channel of its own and keeps the last few round trips; `cluster bench` reads their mean from
the node's Info to show which link is slow.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque

import grpc

from cluster.transport.auth import TLSConfig, open_channel, token_metadata
from proto import cluster_pb2 as pb
from proto import cluster_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

PROBE_INTERVAL_S = 1.0
PROBE_TIMEOUT_S = 2.0
KEEP = 10
PAYLOAD = bytes(4096)


class HopProbe:
    """Pings `address` in the background until closed."""

    def __init__(self, address: str, token: str, tls: TLSConfig | None = None) -> None:
        self._channel = open_channel(address, tls)
        self._stub = pb_grpc.NodeStub(self._channel)
        self._metadata = token_metadata(token)
        self._rtts_ms: deque[float] = deque(maxlen=KEEP)
        self._task = asyncio.create_task(self._run())

    @property
    def mean_rtt_ms(self) -> float:
        """0 until a ping has come back."""
        return sum(self._rtts_ms) / len(self._rtts_ms) if self._rtts_ms else 0.0

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        await self._channel.close()

    async def _run(self) -> None:
        while True:
            started = time.perf_counter()
            try:
                await self._stub.LinkPing(
                    pb.LinkPingRequest(payload=PAYLOAD),
                    timeout=PROBE_TIMEOUT_S,
                    metadata=self._metadata,
                )
                self._rtts_ms.append((time.perf_counter() - started) * 1000)
            except grpc.aio.AioRpcError as error:
                log.debug("ping to the successor failed: %s", error.details())
            await asyncio.sleep(PROBE_INTERVAL_S)
