"""Bounded admission: how many requests may run, how many may wait, and for how long.

A pipeline has a fixed number of requests it can keep in flight before every extra one only
adds latency to all the others, so the coordinator admits at most `max_running` at once.
Up to `max_queued` more wait in arrival order; beyond that a client is told at once to come
back later (429 with Retry-After) rather than piling up sockets, and a client that waited
`queue_timeout_s` without a slot gets a 503 instead of an unbounded wait.

While the coordinator places the model again (a node was lost), admission is paused: running
requests keep their slots (they are replayed), new ones wait in the same bounded queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import deque
from collections.abc import AsyncIterator

from coordinator.openai_schema import ApiError

_SERVICE_TIME_SMOOTHING = 0.2  # weight of the newest request in the service-time average


class OverCapacity(ApiError):
    """Refused for lack of capacity (429 queue full, 503 waited too long), not for a fault:
    counted apart from errors, since a busy cluster is not a broken one."""


class AdmissionController:
    """FIFO admission with a bounded queue; use as `async with admission.slot(): ...`.

    A finishing request hands its slot straight to the oldest waiter, so a newcomer can never
    overtake the queue. All state is touched from the event loop only.
    """

    def __init__(self, max_running: int, max_queued: int, queue_timeout_s: float) -> None:
        if max_running < 1 or max_queued < 0 or queue_timeout_s <= 0:
            raise ValueError("need max_running >= 1, max_queued >= 0 and queue_timeout_s > 0")
        self.max_running = max_running
        self.max_queued = max_queued
        self.queue_timeout_s = queue_timeout_s
        self._running = 0
        self._paused = False
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._mean_service_s = 1.0

    @property
    def running(self) -> int:
        return self._running

    @property
    def queued(self) -> int:
        return sum(1 for waiter in self._waiters if not waiter.done())

    @property
    def paused(self) -> bool:
        return self._paused

    def pause(self) -> None:
        """Grant no slot until `resume`: arrivals queue (bounded as ever), slots that free up
        stay free."""
        self._paused = True

    def resume(self) -> None:
        """Grant the free slots to the oldest waiters."""
        self._paused = False
        while self._running < self.max_running and self._grant():
            self._running += 1

    def _grant(self) -> bool:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return True
        return False

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Hold a running slot for the body; `OverCapacity`: 429 (queue full), 503 (timeout)."""
        await self._acquire()
        started = time.monotonic()
        try:
            yield
        finally:
            self._record_service_time(time.monotonic() - started)
            self._release()

    async def _acquire(self) -> None:
        if self._running < self.max_running and not self.queued and not self._paused:
            self._running += 1
            return
        if self.queued >= self.max_queued:
            raise OverCapacity(
                429,
                f"The server is at capacity ({self.max_running} running, {self.max_queued} "
                "queued); retry later",
                type="rate_limit_exceeded",
                code="rate_limit_exceeded",
                headers={"Retry-After": str(self.retry_after_s())},
            )
        await self._wait_in_queue()

    async def _wait_in_queue(self) -> None:
        """Wait for a handed-over slot; on cancellation, pass on a slot that arrived meanwhile."""
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout(self.queue_timeout_s):
                await waiter
        except TimeoutError:
            if waiter.done() and not waiter.cancelled():
                return  # the slot arrived as the clock ran out: keep it
            self._discard(waiter)
            raise OverCapacity(
                503,
                f"No capacity freed up within {self.queue_timeout_s:g} s; retry later",
                type="server_error",
                code="queue_timeout",
                headers={"Retry-After": str(self.retry_after_s())},
            ) from None
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                self._release()  # granted just as we were cancelled: give it to the next
            else:
                self._discard(waiter)
            raise

    def _release(self) -> None:
        if not self._paused and self._grant():
            return  # the slot moves over to the oldest waiter; the running count stays
        self._running -= 1

    def _discard(self, waiter: asyncio.Future[None]) -> None:
        with contextlib.suppress(ValueError):
            self._waiters.remove(waiter)
        waiter.cancel()

    def _record_service_time(self, seconds: float) -> None:
        alpha = _SERVICE_TIME_SMOOTHING
        self._mean_service_s = (1 - alpha) * self._mean_service_s + alpha * seconds

    def retry_after_s(self) -> int:
        """Seconds until the queue has likely drained by one place: a hint, clamped to [1, 60]."""
        waves = (self.queued + 1) / self.max_running
        return min(60, max(1, math.ceil(waves * self._mean_service_s)))
