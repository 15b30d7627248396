"""The coordinator: finds nodes, places the model, drives the pipeline, serves HTTP.

It owns one `RemotePipeline` at a time. Placement runs once per load (never per token); if a
node of the pipeline dies, requests in flight fail naming it, and the coordinator re-places
the model on the nodes that answer and loads it again, so the service comes back by itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web
from mlx_lm.tokenizer_utils import load as load_tokenizer

from cluster.decode.engine import GenerationChunk, GenerationEngine, GenerationRequest
from cluster.decode.prefix_index import PrefixIndex
from cluster.messages import MtpDepth
from cluster.model.footprint import ModelFootprint
from cluster.placement import NodeCapacity, PlacementPlan, plan_placement
from coordinator.admission import AdmissionController
from coordinator.api import create_app
from coordinator.api_keys import ApiKeys
from coordinator.discovery import DiscoveredNode, NodeDirectory
from coordinator.metrics import ClusterStats, HopStatus, NodeStatus, RequestCounters
from coordinator.progress import transfer_fraction
from coordinator.weights_host import WeightsHost
from node.auth import TLSConfig
from node.client import NodeClient, NodeUnavailable, RemotePipeline, load_pipeline
from proto import cluster_pb2 as pb

log = logging.getLogger(__name__)

HEARTBEAT_S = 1.0
DOWN_AFTER_S = 3.0
RATE_WINDOW_S = 10.0
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "::1", "localhost"})


class MeteredEngine:
    """The engine as the HTTP layer sees it, counting tokens and MTP drafts as they pass."""

    def __init__(self, engine: GenerationEngine):
        self.engine = engine
        self.events: deque[tuple[float, int]] = deque()  # (time, tokens emitted)
        self.drafted = 0
        self.accepted = 0

    @property
    def max_context(self) -> int:
        return self.engine.max_context

    async def stream(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        drafted = accepted = 0
        # Closed with this stream, not later by the garbage collector: the release (and the
        # conversation cache's snapshot) is done before the HTTP response ends.
        async with contextlib.aclosing(self.engine.stream(request)) as chunks:
            async for chunk in chunks:
                self.events.append((time.monotonic(), len(chunk.tokens)))
                self.drafted += chunk.drafted - drafted
                self.accepted += chunk.accepted - accepted
                drafted, accepted = chunk.drafted, chunk.accepted
                yield chunk

    def tokens_per_s(self) -> float:
        horizon = time.monotonic() - RATE_WINDOW_S
        while self.events and self.events[0][0] < horizon:
            self.events.popleft()
        return sum(n for _, n in self.events) / RATE_WINDOW_S


@dataclass(slots=True)
class _Heard:
    info: pb.NodeInfo | None = None
    at: float = 0.0  # monotonic time of the last answer
    rtt_ms: float = 0.0  # how long that answer took


class Coordinator:
    def __init__(
        self,
        model_dir: Path,
        directory: NodeDirectory,
        *,
        token: str,
        layers: list[tuple[int, int]] | None = None,
        use_all: bool = False,
        context_tokens: int = 32768,
        concurrency: int = 8,
        node_model_dir: str | None = None,
        tls: TLSConfig | None = None,
        serve_weights: bool = True,
        weights_port: int = 0,
        prefix_cache: bool = True,
        pinned_addresses: frozenset[str] = frozenset(),
        adopt_shards: bool = False,
    ):
        self.model_dir = model_dir
        self.adopt_shards = adopt_shards  # keep shards that nodes already hold (no reload)
        # Nodes whose address was given (a cluster file's `address`): their upstream streams
        # to exactly it, without measuring the others.
        self.pinned_addresses = pinned_addresses
        self.prefix_cache = prefix_cache
        self.tls = tls
        self.directory = directory
        self.token = token
        self.layers = layers
        self.use_all = use_all
        self.context_tokens = context_tokens
        self.concurrency = concurrency
        self.node_model_dir = node_model_dir
        self.footprint = ModelFootprint.from_dir(model_dir)
        self.counters = RequestCounters()
        self.plan: PlacementPlan | None = None
        self.pipeline: RemotePipeline | None = None
        self.engine: MeteredEngine | None = None
        self._heard: dict[str, _Heard] = {}
        self._probes: dict[str, NodeClient] = {}
        self._tasks: list[asyncio.Task] = []
        self.weights = (
            WeightsHost(model_dir, token, tls, port=weights_port) if serve_weights else None
        )

    # -- bring-up ---------------------------------------------------------------------------

    async def start(self, *, wait_for_nodes_s: float = 30.0) -> None:
        if self.weights is not None:
            await self.weights.start()
            self._tasks.append(asyncio.create_task(self.weights.show_progress()))
        await self.directory.start()
        self._tasks.append(asyncio.create_task(self._poll_nodes()))
        deadline = time.monotonic() + wait_for_nodes_s
        while True:
            try:
                await self._load()
                break
            except (NodeUnavailable, ConnectionError, ValueError) as error:
                if time.monotonic() > deadline:
                    raise
                log.info("waiting for nodes: %s", error)
                await asyncio.sleep(1.0)
        self._tasks.append(asyncio.create_task(self._supervise()))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.pipeline is not None:
            await self.pipeline.close()
        for probe in self._probes.values():
            await probe.close()
        await self.directory.stop()
        if self.weights is not None:
            self.weights.stop()

    async def _capacities(self) -> list[NodeCapacity]:
        capacities = []
        for node in self.directory.nodes():
            info = await self._probe(node)
            if info is not None:
                free = max(info.memory_total_bytes - info.memory_used_bytes, 0)
                capacities.append(NodeCapacity(info.node_id, node.address, free))
        return capacities

    async def _load(self) -> None:
        nodes = await self._capacities()
        if not nodes:
            raise NodeUnavailable("no node answers yet (give --nodes, or start nodes with mDNS)")
        if self.layers is not None and len(nodes) < len(self.layers):
            raise NodeUnavailable(f"{len(nodes)} node(s) answer, --layers needs {len(self.layers)}")
        nodes = nodes[: len(self.layers)] if self.layers else nodes
        plan = plan_placement(
            nodes,
            self.footprint,
            context_tokens=self.context_tokens,
            concurrency=self.concurrency,
            layers=self.layers,
            use_all=self.use_all,
        )
        addresses = [stage.address for stage in plan.stages]
        ranges = [(stage.start, stage.end) for stage in plan.stages]
        pipeline = await load_pipeline(
            self.model_dir,
            addresses,
            token=self.token,
            ranges=ranges,
            node_model_dir=self.node_model_dir,
            tls=self.tls,
            pinned_addresses=self.pinned_addresses,
            adopt=self.adopt_shards,
            **(self.weights.load_args() if self.weights is not None else {}),
        )
        old, self.pipeline, self.plan = self.pipeline, pipeline, plan
        if self.engine is None:
            index = PrefixIndex() if self.prefix_cache else None
            self.engine = MeteredEngine(GenerationEngine(pipeline, prefix_index=index))
        else:
            self.engine.engine.pipeline = pipeline
        if old is not None:
            await old.close()
        log.info("model placed:\n%s", plan.format_table())

    async def _supervise(self) -> None:
        """Re-place and reload the model when a node of the pipeline failed."""
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            if self.pipeline is None or self.pipeline.failure is None:
                continue
            try:
                await self._load()
                log.info("pipeline restored")
            except Exception as error:  # keep trying; the dashboard shows what is down
                log.debug("pipeline not restored yet: %s", error)

    # -- the live view ----------------------------------------------------------------------

    async def _probe(self, node: DiscoveredNode) -> pb.NodeInfo | None:
        client = self._probes.get(node.address)
        if client is None:
            client = self._probes[node.address] = NodeClient(node.address, self.token, self.tls)
        heard = self._heard.setdefault(node.address, _Heard())
        try:
            asked = time.monotonic()
            heard.info = await client.info(timeout=DOWN_AFTER_S - HEARTBEAT_S)
            heard.at = time.monotonic()
            heard.rtt_ms = (heard.at - asked) * 1000
        except Exception as error:  # any failure means: not up now
            log.debug("node %s: %s", node.address, error)
            return None
        return heard.info

    async def _poll_nodes(self) -> None:
        while True:
            await asyncio.gather(*(self._probe(n) for n in self.directory.nodes()))
            await asyncio.sleep(HEARTBEAT_S)

    def node_statuses(self) -> list[NodeStatus]:
        now = time.monotonic()
        statuses, placed = [], set()
        stages = self.plan.stages if self.plan else []
        for stage in stages:
            placed.add(stage.address)
            statuses.append(
                self._status(
                    stage.address, now, stage.start, stage.end, stage.is_head, stage.is_tail
                )
            )
        for node in self.directory.nodes():  # standby nodes: found, not in the pipeline
            if node.address not in placed:
                statuses.append(self._status(node.address, now, 0, 0, False, False))
        return statuses

    def _status(
        self, address: str, now: float, start: int, end: int, is_head: bool, is_tail: bool
    ) -> NodeStatus:
        heard = self._heard.get(address, _Heard())
        info = heard.info or pb.NodeInfo(node_id=address)
        up = heard.at > 0 and now - heard.at < DOWN_AFTER_S
        return NodeStatus(
            node_id=info.node_id,
            address=address,
            start=start,
            end=end,
            is_head=is_head,
            is_tail=is_tail,
            up=up,
            last_heartbeat_s=now - heard.at if heard.at else float("inf"),
            memory_used_bytes=info.memory_used_bytes,
            memory_total_bytes=info.memory_total_bytes,
            step_latency_ms=info.step_latency_ms,
            device=info.device,
            weights_fraction=transfer_fraction(info),
            hop=HopStatus(info.hop.address, info.hop.kind, info.hop.rtt_ms, info.hop.measured)
            if info.HasField("hop")
            else None,
            steps_total=info.steps_total,
            batches_total=info.batches_total,
            busy_seconds_total=info.busy_seconds_total,
            rtt_ms=heard.rtt_ms,
            next_hop_rtt_ms=info.next_hop_rtt_ms,
            chip=info.chip,
            os=info.os,
            cpu_count=info.cpu_count,
            prefix_snapshots=info.prefix_snapshots,
            prefix_snapshot_bytes=info.prefix_snapshot_bytes,
            prefix_budget_bytes=info.prefix_budget_bytes,
        )

    def stats(self) -> ClusterStats:
        engine = self.engine
        drafted = engine.drafted if engine else 0
        index = engine.engine.prefix_index if engine else None
        return ClusterStats(
            tokens_per_s=engine.tokens_per_s() if engine else 0.0,
            acceptance_rate=(engine.accepted / drafted) if drafted else 0.0,
            requests_in_flight=self.counters.in_flight,
            requests_total=self.counters.requests_total,
            errors_total=self.counters.errors_total,
            model_id=self.model_dir.name,
            prefix_cache_hits=index.stats.hits if index else 0,
            prefix_cache_saved_tokens=index.stats.cached_tokens if index else 0,
            prefix_cache_entries=len(index) if index else 0,
        )


async def run_coordinator(
    model_dir: Path,
    *,
    nodes: list[str],
    token: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    browse: bool = True,
    layers: list[tuple[int, int]] | None = None,
    use_all: bool = False,
    max_running: int = 8,
    max_queued: int = 64,
    announce: bool = True,
    started: asyncio.Event | None = None,
    tls: TLSConfig | None = None,
    api_keys: ApiKeys | None = None,
    mtp_depth: MtpDepth = 1,
    weights_port: int = 0,
    prefix_cache: bool = True,
    pinned_addresses: frozenset[str] = frozenset(),
    adopt_shards: bool = False,
) -> None:
    """Serve the OpenAI-compatible API and the dashboard until cancelled."""
    api_keys = api_keys or ApiKeys()
    if not api_keys.enabled and host not in LOOPBACK_HOSTS:
        log.warning("serving on %s without an API key: anyone who reaches it may use it", host)
    directory = NodeDirectory(nodes, browse=browse)
    coordinator = Coordinator(
        model_dir,
        directory,
        token=token,
        layers=layers,
        use_all=use_all,
        concurrency=max_running,
        tls=tls,
        weights_port=weights_port,
        prefix_cache=prefix_cache,
        pinned_addresses=pinned_addresses,
        adopt_shards=adopt_shards,
    )
    tokenizer = load_tokenizer(model_dir)
    await coordinator.start()
    app = create_app(
        coordinator.engine,
        tokenizer,
        coordinator,
        model_id=model_dir.name,
        admission=AdmissionController(
            max_running=max_running, max_queued=max_queued, queue_timeout_s=60.0
        ),
        counters=coordinator.counters,
        api_keys=api_keys,
        mtp_depth=mtp_depth,
    )
    # A client that hangs up cancels its handler at once, and with it the request on every
    # node (RemotePipeline writes the shared step stream from its own task, so a cancelled
    # request never cuts the stream that the others ride on).
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    if announce:
        url = f"http://{host}:{port}"
        print(f"OpenAI endpoint: {url}/v1   dashboard: {url}/", flush=True)
    if started is not None:
        started.set()
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
        await coordinator.close()
