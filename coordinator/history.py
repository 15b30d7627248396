"""The dashboard's recent past: a fixed-size ring of samples the coordinator takes every few
seconds, so that a page opened late still draws the last 15 minutes.

Each sample covers the interval since the previous one:

  tokens_per_s   tokens the engine emitted to requests / the interval
  ttft_ms        p50 and p99 of the time to first token of the requests that finished in it,
                 counted from the request's arrival (its wait for an admission slot included:
                 that is what the client waits)
  tpot_ms        p50 and p99 of their time per output token after the first
  acceptance     accepted / drafted MTP tokens in it
  per node       step_ms = compute time / batches, busy_share = compute time / the interval,
                 from the nodes' cumulative counters (`busy_seconds_total`, `batches_total`),
                 as `cluster bench` reads them (cluster.bench.nodes)

A figure with nothing behind it (no request finished, nothing drafted, no batch computed, a
node's first sample) is None, never 0: the page leaves a gap rather than a false dip.
Percentiles interpolate linearly between ranks (numpy's default, as the bench reports them).

The cost is per interval, not per token: the HTTP layer bumps three integers per chunk and
appends one pair per finished request (`RequestRecorder`); the sampler reads those and the
nodes' last heartbeats. Memory is bounded: `capacity` samples, and at most `MAX_PENDING`
finished requests between two samples (beyond that the oldest are dropped).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cluster.decode.engine import GenerationChunk, GenerationRequest

if TYPE_CHECKING:
    from coordinator.metrics import ClusterView
    from coordinator.text_stream import Engine

INTERVAL_S = 2.0
CAPACITY = 450  # 15 minutes at INTERVAL_S
MAX_PENDING = 10_000  # finished requests kept between two samples


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) of non-empty `values`, interpolating between ranks."""
    if not values:
        raise ValueError("no values")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


class TimedEngine:
    """One request's view of the engine (the `text_stream.Engine` contract), noting when its
    first and last tokens came and adding its tokens and drafts to the recorder's totals."""

    def __init__(self, engine: Engine, recorder: RequestRecorder, started: float) -> None:
        self._engine = engine
        self._recorder = recorder
        self.started = started  # monotonic time the request arrived
        self.first_at: float | None = None
        self.last_at = 0.0
        self.tokens = 0

    @property
    def max_context(self) -> int:
        return self._engine.max_context

    async def stream(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        drafted = accepted = 0
        recorder = self._recorder
        # Closed with this stream: closing it early must reach the engine's (the cancel).
        async with contextlib.aclosing(self._engine.stream(request)) as chunks:
            async for chunk in chunks:
                if chunk.tokens:
                    now = recorder.clock()
                    if self.first_at is None:
                        self.first_at = now
                    self.last_at = now
                    self.tokens += len(chunk.tokens)
                    recorder.tokens_total += len(chunk.tokens)
                recorder.drafted_total += chunk.drafted - drafted
                recorder.accepted_total += chunk.accepted - accepted
                drafted, accepted = chunk.drafted, chunk.accepted
                yield chunk


class RequestRecorder:
    """What the HTTP layer reports as requests run: cumulative tokens and MTP drafts, and
    each finished request's latencies until the sampler takes them. Plain ints and a deque,
    no locks: everything happens on the coordinator's event loop."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.tokens_total = 0
        self.drafted_total = 0
        self.accepted_total = 0
        self._finished: deque[tuple[float, float | None]] = deque(maxlen=MAX_PENDING)

    def timed(self, engine: Engine, started: float | None = None) -> TimedEngine:
        """The engine for one request that arrived at `started` (monotonic; default now)."""
        return TimedEngine(engine, self, self.clock() if started is None else started)

    def finished(self, timed: TimedEngine) -> None:
        """A request ended: its TTFT, and its TPOT when it had more than one token. A request
        that ended before its first token (refused, failed, cancelled) has no latency."""
        if timed.first_at is None:
            return
        tpot = None
        if timed.tokens > 1:
            tpot = (timed.last_at - timed.first_at) / (timed.tokens - 1)
        self._finished.append((timed.first_at - timed.started, tpot))

    def record(self, ttft_s: float, tpot_s: float | None) -> None:
        """A finished request's latencies, measured elsewhere."""
        self._finished.append((ttft_s, tpot_s))

    def take_finished(self) -> list[tuple[float, float | None]]:
        """The (ttft_s, tpot_s or None) of the requests finished since the last call."""
        taken = list(self._finished)
        self._finished.clear()
        return taken


@dataclass(frozen=True, slots=True)
class NodeSample:
    node_id: str
    step_ms: float | None  # compute time per batch; None: no batch in the interval
    busy_share: float | None  # compute time / interval, in [0, 1]; None: first heard


@dataclass(frozen=True, slots=True)
class Sample:
    t: float  # wall-clock time (Unix seconds) at the end of the interval
    interval_s: float
    tokens_per_s: float
    requests: int  # requests that finished in the interval with at least one token
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    tpot_p50_ms: float | None
    tpot_p99_ms: float | None
    acceptance: float | None  # accepted / drafted; None: nothing drafted
    nodes: tuple[NodeSample, ...]


@dataclass(frozen=True, slots=True)
class _Counts:
    tokens: int
    drafted: int
    accepted: int


class History:
    """The ring of samples over `view` (the nodes) and `recorder` (the requests).

    `sample()` takes one (the unit tests call it directly, with their own clocks); `run()`
    takes one every `interval_s` until cancelled, as a task of the coordinator. `clock` is
    monotonic (the intervals), `wall` dates the samples for the page.
    """

    def __init__(
        self,
        view: ClusterView,
        recorder: RequestRecorder | None = None,
        *,
        interval_s: float = INTERVAL_S,
        capacity: int = CAPACITY,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
    ) -> None:
        if interval_s <= 0 or capacity < 1:
            raise ValueError("the interval must be positive and the capacity at least 1")
        self.view = view
        self.recorder = recorder or RequestRecorder(clock)
        self.interval_s = interval_s
        self.capacity = capacity
        self.samples: deque[Sample] = deque(maxlen=capacity)
        self._clock = clock
        self._wall = wall
        self._sleep = sleep  # what `run()` waits with between samples
        self._at = clock()
        self._counts = self._read_counts()
        self._nodes: dict[str, tuple[float, int]] = {}  # node id -> (busy_s, batches) last seen

    def _read_counts(self) -> _Counts:
        recorder = self.recorder
        return _Counts(recorder.tokens_total, recorder.drafted_total, recorder.accepted_total)

    def sample(self) -> Sample:
        """Close the interval since the last sample (or since the start) and keep it."""
        now = self._clock()
        interval = max(now - self._at, 1e-9)
        counts = self._read_counts()
        last = self._counts
        drafted = counts.drafted - last.drafted
        accepted = counts.accepted - last.accepted
        finished = self.recorder.take_finished()
        ttfts = [ttft * 1000 for ttft, _ in finished]
        tpots = [tpot * 1000 for _, tpot in finished if tpot is not None]
        sample = Sample(
            t=self._wall(),
            interval_s=interval,
            tokens_per_s=(counts.tokens - last.tokens) / interval,
            requests=len(finished),
            ttft_p50_ms=percentile(ttfts, 50) if ttfts else None,
            ttft_p99_ms=percentile(ttfts, 99) if ttfts else None,
            tpot_p50_ms=percentile(tpots, 50) if tpots else None,
            tpot_p99_ms=percentile(tpots, 99) if tpots else None,
            acceptance=accepted / drafted if drafted > 0 else None,
            nodes=self._node_samples(interval),
        )
        self._at, self._counts = now, counts
        self.samples.append(sample)
        return sample

    def _node_samples(self, interval: float) -> tuple[NodeSample, ...]:
        """The pipeline's nodes (standby ones left out), from their counters' deltas. A
        counter that went back (the node restarted) counts from 0, as Prometheus' rate does."""
        out = []
        seen: dict[str, tuple[float, int]] = {}
        for node in self.view.node_statuses():
            if node.shard is None:
                continue
            now = (node.busy_seconds_total, node.batches_total)
            seen[node.node_id] = now
            then = self._nodes.get(node.node_id)
            if then is None:
                out.append(NodeSample(node.node_id, None, None))
                continue
            busy, batches = now[0] - then[0], now[1] - then[1]
            if busy < 0 or batches < 0:  # restarted: its counters began again at 0
                busy, batches = now
            step_ms = busy / batches * 1000 if batches > 0 else None
            out.append(NodeSample(node.node_id, step_ms, min(max(busy / interval, 0.0), 1.0)))
        self._nodes = seen
        return tuple(out)

    async def run(self) -> None:
        """Take a sample every `interval_s` until cancelled."""
        self._at, self._counts = self._clock(), self._read_counts()
        while True:
            await self._sleep(self.interval_s)
            self.sample()

    def as_json(self) -> dict[str, Any]:
        """The `/api/history` document: one array per series, aligned with `t` (oldest
        first); a node's series are aligned too, None where the node was not in the
        pipeline."""
        samples = list(self.samples)
        order: dict[str, None] = {}  # the latest pipeline order, then nodes seen before
        for sample in reversed(samples):
            for node in sample.nodes:
                order.setdefault(node.node_id)
        nodes = {node_id: {"step_ms": [], "busy_share": []} for node_id in order}
        for sample in samples:
            present = {node.node_id: node for node in sample.nodes}
            for node_id, series in nodes.items():
                node = present.get(node_id)
                series["step_ms"].append(node.step_ms if node else None)
                series["busy_share"].append(node.busy_share if node else None)
        return {
            "interval_s": self.interval_s,
            "capacity": self.capacity,
            "t": [s.t for s in samples],
            "tokens_per_s": [s.tokens_per_s for s in samples],
            "requests": [s.requests for s in samples],
            "ttft_ms": {
                "p50": [s.ttft_p50_ms for s in samples],
                "p99": [s.ttft_p99_ms for s in samples],
            },
            "tpot_ms": {
                "p50": [s.tpot_p50_ms for s in samples],
                "p99": [s.tpot_p99_ms for s in samples],
            },
            "acceptance": [s.acceptance for s in samples],
            "nodes": [{"node_id": node_id, **series} for node_id, series in nodes.items()],
        }
