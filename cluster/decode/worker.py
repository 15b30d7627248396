"""The one thread that does a process's MLX work, with asyncio around it."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import functools
import hashlib
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

import mlx.core as mx

T = TypeVar("T")

# How long the MLX thread of a GPU process stays awake after a job, waiting for the next one
# (`MLXWorker`). A node of a pipeline waits about (n-1)/n of every token for the other nodes;
# 50 ms covers that wait at a real model's step and stops spinning soon after decoding ends.
GPU_SPIN_S = 0.05

_SPIN_BUFFER = bytes(8192)


def busy_without_gil() -> None:
    """About 10-20 µs of work with the GIL released: CPython hashes 2 KiB or more without
    holding it, so the event loop runs freely while this thread keeps its core."""
    hashlib.blake2b(_SPIN_BUFFER)


def default_spin_s() -> float:
    """`GPU_SPIN_S` where the device computes (a GPU); 0 on the CPU backend, whose own compute
    needs the cores a spinning thread would take."""
    return GPU_SPIN_S if mx.default_device().type == mx.DeviceType.gpu else 0.0


class MLXWorker:
    """All MLX calls of an owner go through here: one thread, so arrays, streams and caches are
    only ever touched from one place, while the event loop keeps serving the network.

    After each job the thread stays awake for `spin_s` seconds (by default `default_spin_s`)
    before it sleeps on its queue. A node of a pipeline waits for the other nodes before every
    step, and a step that follows a wait asleep builds its graph markedly slower than one back
    to back (the host's wake-up, not the GPU), so kept awake, nodes side by side step faster.
    The busy wait releases
    the GIL (`busy_without_gil`), so the event loop that hands the next job over never waits
    for it.

    The thread is a daemon that is never joined. MLX keeps a stream per thread (thread-local),
    and a thread that ends while the process exits can abort the process in MLX's stream
    teardown (seen with MLX 0.32, about one exit in ten); a parked daemon thread never ends.
    """

    def __init__(self, spin_s: float | None = None) -> None:
        if spin_s is not None and spin_s < 0:
            raise ValueError(f"spin_s must be >= 0, not {spin_s}")
        self.spin_s = default_spin_s() if spin_s is None else spin_s
        self._jobs: queue.SimpleQueue[tuple[Callable[[], object], Future]] = queue.SimpleQueue()
        self._closed = False
        # Called before each job is queued, on the submitting thread: a node's stage releases
        # its doorbell there (cluster.decode.late_input), since a step launched behind it may
        # hold this thread until it is rung.
        self.before_submit: Callable[[], None] | None = None
        threading.Thread(target=self._serve, name="mlx", daemon=True).start()
        atexit.register(self._drain)

    def _next_job(self) -> tuple[Callable[[], object], Future]:
        if self.spin_s > 0 and self._jobs.empty():
            deadline = time.perf_counter() + self.spin_s
            while self._jobs.empty() and time.perf_counter() < deadline:
                busy_without_gil()
        return self._jobs.get()

    def _serve(self) -> None:
        while True:
            fn, future = self._next_job()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as error:  # handed to the caller, who re-raises it
                future.set_exception(error)

    def submit(self, fn: Callable[..., T], *args: object, **kwargs: object) -> Future[T]:
        if self._closed:
            raise RuntimeError("the MLX worker is closed")
        if self.before_submit is not None:
            self.before_submit()
        future: Future[T] = Future()
        self._jobs.put((functools.partial(fn, *args, **kwargs), future))
        return future

    async def run(self, fn: Callable[..., T], *args: object, **kwargs: object) -> T:
        return await asyncio.wrap_future(self.submit(fn, *args, **kwargs))

    def call(self, fn: Callable[..., T], *args: object, **kwargs: object) -> T:
        """Run on the worker from synchronous code, waiting for the result."""
        return self.submit(fn, *args, **kwargs).result()

    def _drain(self) -> None:
        """At exit, let the thread finish what it runs (freeing arrays included) and park.
        It must not spin then: a daemon thread that takes the GIL back while the interpreter
        finalizes is ended there, which is the teardown the class docstring avoids."""
        self.spin_s = 0.0
        with contextlib.suppress(Exception):
            self._closed = False
            self.call(lambda: None)
            self._closed = True

    def close(self) -> None:
        """Refuse new work; the thread stays parked (see the class docstring)."""
        self._closed = True
