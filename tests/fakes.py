"""Test doubles for the coordinator's HTTP layer: an engine, a cluster view, a served app.

`FakeEngine` honours the `GenerationEngine` contract (stop tokens end with "stop" and are not
emitted, max_tokens ends with "length", too long a prompt is a `RequestError`, closing the
stream early cancels) with deterministic output and delays the test controls, and records
how each stream ended so that a test can check the API closed it.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import cache
from pathlib import Path
from typing import Any

from aiohttp import web

from cluster.decode.engine import GenerationChunk, GenerationRequest
from cluster.messages import RequestError
from cluster.model.shard import ShardSpec
from coordinator.admission import AdmissionController
from coordinator.api import Monitoring, ServedModel, create_app
from coordinator.api_keys import ApiKeys
from coordinator.metrics import ClusterStats, CoordinatorLinkStatus, NodeStatus, RequestCounters

MODEL_DIR = Path(__file__).resolve().parents[1] / "cluster" / "assets" / "qwen3_5-tiny-mtp"
MODEL_ID = "qwen3_5-tiny-mtp"
EOS = 2  # <|im_end|>


@cache
def tokenizer() -> Any:
    """The bundled model's real tokenizer (mlx-lm's TokenizerWrapper), loaded once."""
    from mlx_lm.utils import load_tokenizer

    return load_tokenizer(MODEL_DIR)


@dataclass(slots=True)
class FakeEngine:
    """Emits `reply(request)` in chunks of `chunk_size` tokens, `delay_s` apart.

    `fail` raises inside the stream after `fail_after` chunks, as a dead node would.
    `closed_early` / `completed` hold request ids by how their stream ended.
    """

    reply: Callable[[GenerationRequest], Sequence[int]]
    max_context: int = 512
    chunk_size: int = 1
    delay_s: float = 0.0
    fail: Exception | None = None
    fail_after: int = 0
    requests: list[GenerationRequest] = field(default_factory=list)
    completed: list[str] = field(default_factory=list)
    closed_early: list[str] = field(default_factory=list)
    active: int = 0

    @classmethod
    def saying(cls, text: str, **kwargs: Any) -> FakeEngine:
        """An engine whose every reply is `text` followed by the end-of-turn token."""
        ids = (*tokenizer().encode(text), EOS)
        return cls(reply=lambda _request: ids, **kwargs)

    async def stream(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        if len(request.prompt) + request.max_tokens > self.max_context:
            raise RequestError(f"prompt + max_tokens exceeds the context of {self.max_context}")
        self.requests.append(request)
        self.active += 1
        done = False
        try:
            for index, (tokens, finish) in enumerate(self._chunks(request)):
                if self.fail is not None and index >= self.fail_after:
                    raise self.fail
                await asyncio.sleep(self.delay_s)
                done = finish is not None  # a consumer may close us right after the last yield
                yield GenerationChunk(tokens, finish, drafted=index, accepted=index // 2)
        finally:
            self.active -= 1
            (self.completed if done else self.closed_early).append(request.request_id)

    def _chunks(self, request: GenerationRequest) -> Iterator[tuple[tuple[int, ...], str | None]]:
        out: list[int] = []
        finish = "length"
        for token in self.reply(request):
            if token in request.stop_tokens:
                finish = "stop"
                break
            out.append(token)
            if len(out) == request.max_tokens:
                break
        for start in range(0, len(out), self.chunk_size):
            end = start + self.chunk_size
            yield tuple(out[start:end]), finish if end >= len(out) else None
        if not out:
            yield (), finish


def node(index: int, *, up: bool = True, layers: int = 8, nodes: int = 3) -> NodeStatus:
    per = layers // nodes + 1
    start, end = min(index * per, layers), min((index + 1) * per, layers)
    return NodeStatus(
        node_id=f"mac-{index}",
        address=f"10.0.0.{index + 10}:50051",
        shard=ShardSpec(start, end, index == 0, index == nodes - 1) if start < end else None,
        up=up,
        last_heartbeat_s=0.4 + index,
        memory_used_bytes=(12 + 9 * index) * 2**30,
        memory_total_bytes=64 * 2**30,
        step_latency_ms=3.5 + index,
        device=f"Apple M{index + 2} Max",
        step_phases_ms=step_phases(index),
    )


def step_phases(index: int) -> dict[str, float]:
    """A node's step phases (ms) that add up to its `step_latency_ms` (handoff through encode)."""
    return {"queued": 0.05, "handoff": 0.2, "decode": 0.1, "layers": 3.1 + index, "encode": 0.1,
            "send": 0.04}  # fmt: skip


@dataclass(slots=True)
class FakeClusterView:
    """A `ClusterView` over a list of nodes the test edits, and the API's own counters."""

    nodes: list[NodeStatus] = field(default_factory=lambda: [node(i) for i in range(3)])
    counters: RequestCounters = field(default_factory=RequestCounters)
    tokens_per_s: float = 42.5
    acceptance_rate: float = 0.73

    def node_statuses(self) -> list[NodeStatus]:
        return list(self.nodes)

    def coordinator_links(self) -> list[CoordinatorLinkStatus]:
        return []

    def stats(self) -> ClusterStats:
        return ClusterStats(
            tokens_per_s=self.tokens_per_s,
            acceptance_rate=self.acceptance_rate,
            requests_in_flight=self.counters.in_flight,
            requests_total=self.counters.requests_total,
            errors_total=self.counters.errors_total,
            model_id=MODEL_ID,
            interleave_chunk_tokens=16,
            interleave_chunk_changes=3,
        )

    def set_up(self, node_id: str, up: bool) -> None:
        self.nodes = [replace(n, up=up) if n.node_id == node_id else n for n in self.nodes]


class ServedApp:
    """The app on 127.0.0.1 in a thread of its own, so sync clients (openai, http.client,
    a browser) can talk to it while the test thread blocks."""

    def __init__(self, app: web.Application, *, handler_cancellation: bool = True) -> None:
        self._app = app
        self._handler_cancellation = handler_cancellation
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self._thread.start()
        self.call(self._start())

    def stop(self) -> None:
        if self._runner is not None:
            self.call(self._runner.cleanup())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def call(self, coro: Any, timeout: float = 30) -> Any:
        """Run a coroutine on the server's loop and wait for its result."""
        future: Future[Any] = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return future.result(timeout)

    async def _start(self) -> None:
        self._runner = web.AppRunner(
            self._app, handler_cancellation=self._handler_cancellation, access_log=None
        )
        await self._runner.setup()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        await web.SockSite(self._runner, sock).start()


@dataclass(slots=True)
class Served:
    engine: FakeEngine
    view: FakeClusterView
    admission: AdmissionController
    app: ServedApp

    @property
    def url(self) -> str:
        return self.app.url


@contextmanager
def serve(
    engine: FakeEngine,
    *,
    view: FakeClusterView | None = None,
    max_running: int = 4,
    max_queued: int = 8,
    queue_timeout_s: float = 10.0,
    handler_cancellation: bool = True,
    api_keys: ApiKeys | None = None,
) -> Iterator[Served]:
    """The coordinator app around `engine`, served until the block ends."""
    view = view or FakeClusterView()
    admission = AdmissionController(max_running, max_queued, queue_timeout_s)
    app = create_app(
        engine,
        tokenizer(),
        view,
        served=ServedModel(MODEL_ID),
        admission=admission,
        api_keys=api_keys,
        monitoring=Monitoring(view.counters),
    )
    served = ServedApp(app, handler_cancellation=handler_cancellation)
    served.start()
    try:
        yield Served(engine, view, admission, served)
    finally:
        served.stop()


class ServicerContext:
    """What a node's RPC handler reads of gRPC's context, for calling one directly: a
    loopback peer; an abort fails the test with its details."""

    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"

    async def abort(self, code: object, details: str) -> None:
        raise AssertionError(f"aborted: {details}")


def wait_until(predicate: Callable[[], bool], timeout_s: float = 10.0, what: str = "") -> None:
    """Poll `predicate` until it holds, failing after `timeout_s`: no fixed sleeps in tests."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or predicate}")
        time.sleep(0.01)
