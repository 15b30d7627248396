"""The one thread that does a process's MLX work, with asyncio around it."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


class MLXWorker:
    """All MLX calls of a process go through here: one thread, so arrays, streams and caches
    are only ever touched from one place, while the event loop keeps serving the network."""

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlx")

    async def run(self, fn: Callable[..., T], *args: object, **kwargs: object) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))

    def call(self, fn: Callable[..., T], *args: object, **kwargs: object) -> T:
        """Run on the worker from synchronous code, waiting for the result."""
        return self._executor.submit(fn, *args, **kwargs).result()

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
