"""The one thread that does a process's MLX work, with asyncio around it."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import functools
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

T = TypeVar("T")


class MLXWorker:
    """All MLX calls of an owner go through here: one thread, so arrays, streams and caches are
    only ever touched from one place, while the event loop keeps serving the network.

    The thread is a daemon that is never joined. MLX keeps a stream per thread (thread-local),
    and a thread that ends while the process exits can abort the process in MLX's stream
    teardown (seen with MLX 0.32, about one exit in ten); a parked daemon thread never ends.
    """

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], object], Future]] = queue.SimpleQueue()
        self._closed = False
        threading.Thread(target=self._serve, name="mlx", daemon=True).start()
        atexit.register(self._drain)

    def _serve(self) -> None:
        while True:
            fn, future = self._jobs.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as error:  # handed to the caller, who re-raises it
                future.set_exception(error)

    def submit(self, fn: Callable[..., T], *args: object, **kwargs: object) -> Future[T]:
        if self._closed:
            raise RuntimeError("the MLX worker is closed")
        future: Future[T] = Future()
        self._jobs.put((functools.partial(fn, *args, **kwargs), future))
        return future

    async def run(self, fn: Callable[..., T], *args: object, **kwargs: object) -> T:
        return await asyncio.wrap_future(self.submit(fn, *args, **kwargs))

    def call(self, fn: Callable[..., T], *args: object, **kwargs: object) -> T:
        """Run on the worker from synchronous code, waiting for the result."""
        return self.submit(fn, *args, **kwargs).result()

    def _drain(self) -> None:
        """At exit, let the thread finish what it runs (freeing arrays included) and park."""
        with contextlib.suppress(Exception):
            self._closed = False
            self.call(lambda: None)
            self._closed = True

    def close(self) -> None:
        """Refuse new work; the thread stays parked (see the class docstring)."""
        self._closed = True
