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
from cluster.placement import NodeCapacity, PlacementError, PlacementPlan, plan_placement
from cluster.transport.auth import TLSConfig
from cluster.transport.node_client import NodeClient, NodeUnavailable, RemotePipeline, load_pipeline
from cluster.transport.wire import step_phases_ms
from coordinator.admission import AdmissionController
from coordinator.api import create_app
from coordinator.api_keys import ApiKeys
from coordinator.discovery import DiscoveredNode, NodeDirectory
from coordinator.metrics import ClusterStats, HopStatus, NodeStatus, RequestCounters
from coordinator.progress import transfer_fraction
from coordinator.replay import ReplayingEngine
from coordinator.weights_host import WeightsHost
from proto import cluster_pb2 as pb

log = logging.getLogger(__name__)

HEARTBEAT_S = 1.0
DOWN_AFTER_S = 3.0
RATE_WINDOW_S = 10.0
REPLAY_WAIT_S = 60.0  # how long a request that lost its pipeline waits for a new placement
REBALANCE_IDLE_S = 2.0  # idle this long, the coordinator may move to a better placement
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "::1", "localhost"})


class MeteredEngine:
    """The engine as the HTTP layer sees it, counting tokens and MTP drafts as they pass."""

    def __init__(self, engine: GenerationEngine | ReplayingEngine):
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
        admission: AdmissionController | None = None,
        replay_wait_s: float = REPLAY_WAIT_S,
    ):
        self.model_dir = model_dir
        self.admission = admission
        self.replay_wait_s = replay_wait_s
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
        self.generation: GenerationEngine | None = None
        self.replaying: ReplayingEngine | None = None
        # Pipeline epochs: each placement's shards and steps carry their own, so that a node
        # that hung and woke up cannot mix an old placement's work into a new one.
        self.epoch = int(time.time() * 1000)
        self._placed = asyncio.Event()  # set (and replaced) at each new placement
        self._restore_error: Exception | None = None  # why the last re-placement failed
        self._no_fit = False  # the last re-placement found no placement that fits
        self._idle_since = time.monotonic()
        self.rebalances_total = 0
        self._placed_among: frozenset[str] = frozenset()  # the nodes that answered then
        self._placed_at = 0.0
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

    def _plan(self, nodes: list[NodeCapacity]) -> PlacementPlan:
        if not nodes:
            raise NodeUnavailable("no node answers yet (give --nodes, or start nodes with mDNS)")
        if self.layers is not None and len(nodes) < len(self.layers):
            raise NodeUnavailable(f"{len(nodes)} node(s) answer, --layers needs {len(self.layers)}")
        nodes = nodes[: len(self.layers)] if self.layers else nodes
        return plan_placement(
            nodes,
            self.footprint,
            context_tokens=self.context_tokens,
            concurrency=self.concurrency,
            layers=self.layers,
            use_all=self.use_all,
        )

    async def _load(self) -> None:
        nodes = await self._capacities()
        plan = self._plan(nodes)
        self._placed_among = frozenset(node.address for node in nodes)
        self._placed_at = time.monotonic()
        self.epoch = max(self.epoch + 1, int(time.time() * 1000))
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
            epoch=self.epoch,
            **(self.weights.load_args() if self.weights is not None else {}),
        )
        old, self.pipeline, self.plan = self.pipeline, pipeline, plan
        self.epoch = pipeline.epoch  # an adopted pipeline keeps the epoch its nodes hold
        if self.generation is None:
            index = PrefixIndex() if self.prefix_cache else None
            self.generation = GenerationEngine(pipeline, prefix_index=index)
            self.replaying = ReplayingEngine(self.generation, self)
            self.engine = MeteredEngine(self.replaying)
        else:
            self.generation.pipeline = pipeline
        self._placed.set()
        self._placed = asyncio.Event()
        if old is not None:
            await old.close()
        log.info("model placed (epoch %d):\n%s", self.epoch, plan.format_table())

    async def _supervise(self) -> None:
        """Re-place and reload the model when a node of the pipeline failed (new requests
        wait in the admission queue meanwhile); when idle, move to a better placement (a
        node came back)."""
        while True:
            await asyncio.sleep(HEARTBEAT_S / 4)
            if self.pipeline is None:
                continue
            if self.pipeline.failure is None:
                await self._rebalance()
                continue
            if self.admission is not None:
                self.admission.pause()
            try:
                await self._load()
                self._restore_error, self._no_fit = None, False
                log.info("pipeline restored")
            except Exception as error:  # keep trying; the dashboard shows what is down
                self._restore_error, self._no_fit = error, isinstance(error, PlacementError)
                if self._no_fit:
                    self._placed.set()  # the waiting requests fail: nothing fits
                    self._placed = asyncio.Event()
                log.info("pipeline not restored yet: %s", error)
                await asyncio.sleep(HEARTBEAT_S)
            finally:
                if self.admission is not None and self.pipeline.failure is None:
                    self.admission.resume()

    async def restored(self, failed: RemotePipeline, error: NodeUnavailable) -> None:
        """`coordinator.replay.Replacement`: wait until a pipeline other than `failed`
        serves (the supervisor places the model again); raise when none will."""
        if failed is self.pipeline:
            failed.fail(error)  # a node of it is unreachable: the whole pipeline goes
        deadline = time.monotonic() + self.replay_wait_s
        while self.pipeline is failed or self.pipeline.failure is not None:
            remaining = deadline - time.monotonic()
            if self._no_fit or remaining <= 0:
                why = self._restore_error or "no node set answered"
                raise NodeUnavailable(
                    f"{error}; the model could not be placed on the nodes that answer: {why}"
                )
            placed = self._placed
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(placed.wait(), remaining)

    def _idle(self) -> bool:
        admission = self.admission
        busy = self.counters.in_flight > 0 or (
            admission is not None and (admission.running > 0 or admission.queued > 0)
        )
        return not busy

    async def _rebalance(self) -> None:
        """Between requests, never under a running one: when the nodes that answer now
        give another placement (a node came back, or woke up), move to it."""
        now = time.monotonic()
        if not self._idle():
            self._idle_since = now
            return
        if now - self._idle_since < REBALANCE_IDLE_S or self.plan is None:
            return
        if now - self._placed_at < DOWN_AFTER_S:
            return  # until every live node has been heard since the placement
        self._idle_since = now  # look again a while later
        answering = self._answering()
        among = frozenset(node.address for node in answering)
        if among == self._placed_among:
            return  # the same nodes as at the last placement: nothing new to place on
        try:
            plan = self._plan(answering)
        except (NodeUnavailable, PlacementError):
            return
        if _layout(plan) != _layout(self.plan):  # worth a look: ask the nodes themselves
            live = await self._capacities()
            among = frozenset(node.address for node in live)
            try:
                plan = self._plan(live)
            except (NodeUnavailable, PlacementError):
                return
        if _layout(plan) == _layout(self.plan):
            self._placed_among = among
            return
        if not self._idle():
            return
        log.info("a better placement is possible; moving to it between requests")
        if self.admission is not None:
            self.admission.pause()
        try:
            await self._load()
            self.rebalances_total += 1
        except Exception as error:
            # Some nodes may hold the new shards already: the old pipeline is not to be trusted.
            log.warning("moving to the new placement failed: %s", error)
            if self.pipeline is not None:
                self.pipeline.fail(NodeUnavailable(f"re-placement failed: {error}"))
        finally:
            if self.admission is not None and self.pipeline.failure is None:
                self.admission.resume()

    def _answering(self) -> list[NodeCapacity]:
        """The nodes heard from since the last placement, lately, as placement sees them."""
        now, nodes = time.monotonic(), []
        for node in self.directory.nodes():
            heard = self._heard.get(node.address)
            fresh = heard is not None and heard.at > self._placed_at
            if fresh and heard.info and now - heard.at < DOWN_AFTER_S:
                info = heard.info
                free = max(info.memory_total_bytes - info.memory_used_bytes, 0)
                nodes.append(NodeCapacity(info.node_id, node.address, free))
        return nodes

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
            hop=hop_status(info.hop) if info.HasField("hop") else None,
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
            mlx_active_bytes=info.mlx_active_bytes,
            mlx_cache_bytes=info.mlx_cache_bytes,
            mlx_peak_bytes=info.mlx_peak_bytes,
            step_phases_ms=step_phases_ms(info),
        )

    def stats(self) -> ClusterStats:
        engine = self.engine
        drafted = engine.drafted if engine else 0
        index = self.generation.prefix_index if self.generation else None
        replaying = self.replaying
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
            replays_total=replaying.replays_total if replaying else 0,
            replays_failed=replaying.replays_failed if replaying else 0,
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
    admission = AdmissionController(
        max_running=max_running, max_queued=max_queued, queue_timeout_s=60.0
    )
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
        admission=admission,
    )
    tokenizer = load_tokenizer(model_dir)
    await coordinator.start()
    app = create_app(
        coordinator.engine,
        tokenizer,
        coordinator,
        model_id=model_dir.name,
        admission=admission,
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


def _layout(plan: PlacementPlan) -> list[tuple[str, int, int]]:
    return [(stage.address, stage.start, stage.end) for stage in plan.stages]


def hop_status(hop: pb.HopLink) -> HopStatus:
    """A node's report of its hop as the status shows it; an address that did not answer
    has None for its round trip, not 0 ms."""
    tried = tuple((t.address, t.rtt_ms if t.answered else None) for t in hop.tried)
    return HopStatus(hop.address, hop.kind, hop.rtt_ms, hop.measured, tried)
