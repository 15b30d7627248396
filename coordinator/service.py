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

from aiohttp import web
from mlx_lm.tokenizer_utils import load as load_tokenizer

from cluster.config import load_model_config
from cluster.decode.engine import (
    DEFAULT_PREFILL_CHUNK,
    GenerationChunk,
    GenerationEngine,
    GenerationRequest,
)
from cluster.decode.prefix_index import PrefixIndex
from cluster.decode.remote_pipeline import (
    DriverLink,
    PipelineSettings,
    RemotePipeline,
    load_pipeline,
)
from cluster.decode.warmup import (
    WarmupArgs,
    WarmupHook,
    WarmupProgress,
    measure_chunks,
    run_warmup,
)
from cluster.model.footprint import ModelFootprint, model_max_context
from cluster.model.loading import NO_MTP_HEAD
from cluster.model.shard import ShardSpec
from cluster.placement import (
    NodeCapacity,
    PlacementError,
    PlacementPlan,
    plan_longest_context,
    plan_placement,
)
from cluster.transport.node_client import NodeClient, NodeUnavailable
from cluster.transport.wire import step_phases_ms
from coordinator.admission import AdmissionController
from coordinator.api import Monitoring, ServedModel, create_app
from coordinator.api_keys import ApiKeys
from coordinator.discovery import DiscoveredNode, NodeDirectory
from coordinator.history import History
from coordinator.metrics import (
    ClusterStats,
    CoordinatorLinkStatus,
    HopStatus,
    NodeStatus,
    RequestCounters,
)
from coordinator.progress import transfer_fraction
from coordinator.replay import ReplayingEngine
from coordinator.settings import (
    LOOPBACK_HOSTS,
    CoordinatorSettings,
    check_endpoint,
    check_max_context,
)
from coordinator.weights_host import WeightsHost
from proto import cluster_pb2 as pb

log = logging.getLogger(__name__)

HEARTBEAT_S = 1.0
DOWN_AFTER_S = 3.0
RATE_WINDOW_S = 10.0
REBALANCE_IDLE_S = 2.0  # idle this long, the coordinator may move to a better placement


class MeteredEngine:
    """The engine as the HTTP layer sees it, counting tokens and MTP drafts as they pass.
    Its `max_context` is the longest request served (`--max-context`, what the nodes' memory
    was planned for), which the HTTP layer checks before a request takes a slot."""

    def __init__(self, engine: GenerationEngine | ReplayingEngine, *, max_context: int):
        self.engine = engine
        self.served_context = max_context
        self.events: deque[tuple[float, int]] = deque()  # (time, tokens emitted)
        self.drafted = 0
        self.accepted = 0

    @property
    def max_context(self) -> int:
        return min(self.served_context, self.engine.max_context)

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
class _LastReply:
    info: pb.NodeInfo | None = None
    at: float = 0.0  # monotonic time of the last answer
    asked: float = 0.0  # when it was asked for: `info` shows the node at or after this time
    rtt_ms: float = 0.0  # how long that answer took


class Coordinator:
    """Places the model on the nodes that answer, drives its pipeline, and places it again
    when a node of it fails or when, between requests, a better placement appears."""

    def __init__(
        self,
        settings: CoordinatorSettings,
        directory: NodeDirectory,
        *,
        admission: AdmissionController | None = None,
    ):
        self.settings = settings
        self.model_dir = settings.model_dir
        self.directory = directory
        self.admission = admission
        self.footprint = ModelFootprint.from_dir(settings.model_dir)
        if settings.max_context is not None:
            check_max_context(settings.max_context, settings.model_dir)
        # The longest request served: the settings', else fixed by the first placement (the
        # model's own context, or the longest that fits) and kept by every later one, so that
        # what was admitted once is never refused by a re-placement.
        self.max_context: int | None = settings.max_context
        # Whether the checkpoint holds the MTP head the config declares: mlx-lm's conversions
        # drop the `mtp.*` tensors, and the tail then loads without it (cluster.model.loading).
        # Without it every request is served without drafts, whatever it asks for.
        self.has_mtp_head = self.footprint.has_mtp and self.footprint.mtp_layers > 0
        self.counters = RequestCounters()
        # The dashboard's last 15 minutes: sampled by a task of ours from start() to close().
        self.history = History(self)
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
        self._heard: dict[str, _LastReply] = {}
        self._probes: dict[str, NodeClient] = {}
        self._tasks: list[asyncio.Task] = []
        # The warm-up (cluster.decode.warmup): "warming" until the first one ran (at once
        # "ready" when turned off), and again during each new placement's.
        warm = settings.warmup
        self.warmup = WarmupProgress("warming" if warm else "ready", skipped=not warm)
        self._warming = asyncio.Lock()  # held while one runs: no re-placement meanwhile
        self.weights: WeightsHost | None = None
        if settings.serve_weights:
            port = settings.weights_port
            self.weights = WeightsHost(settings.model_dir, settings.token, settings.tls, port=port)

    # -- bring-up ---------------------------------------------------------------------------

    async def start(self, *, wait_for_nodes_s: float = 30.0) -> None:
        if self.weights is not None:
            await self.weights.start()
            self._tasks.append(asyncio.create_task(self.weights.show_progress()))
        await self.directory.start()
        self._tasks.append(asyncio.create_task(self._poll_nodes()))
        self._tasks.append(asyncio.create_task(self.history.run()))
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
        layers = self.settings.layers
        if layers is not None and len(nodes) < len(layers):
            raise NodeUnavailable(f"{len(nodes)} node(s) answer, --layers needs {len(layers)}")
        nodes = nodes[: len(layers)] if layers else nodes
        kwargs = {
            "concurrency": self.settings.max_running,
            "layers": layers,
            "use_all": self.settings.use_all,
            "prefix_cache": self.settings.prefix_cache,
        }
        if self.max_context is None:
            model_context = model_max_context(self.model_dir)
            plan = plan_longest_context(nodes, self.footprint, max_context=model_context, **kwargs)
            if plan.context_tokens < model_context:
                log.warning(
                    "the model's context of %d tokens does not fit the nodes at --max-running "
                    "%d; serving requests of at most %d tokens (--max-context to choose)",
                    model_context,
                    self.settings.max_running,
                    plan.context_tokens,
                )
            return plan
        return plan_placement(nodes, self.footprint, context_tokens=self.max_context, **kwargs)

    async def _load(self) -> None:
        nodes = await self._capacities()
        plan = self._plan(nodes)
        self._placed_among = frozenset(node.address for node in nodes)
        self._placed_at = time.monotonic()
        self.epoch = max(self.epoch + 1, int(time.time() * 1000))
        addresses = [stage.address for stage in plan.stages]
        pipeline = await load_pipeline(
            self.model_dir, addresses, self._pipeline_settings(plan), epoch=self.epoch
        )
        # Heard again before the plan is shown: the status then shows the shards and hops
        # just loaded, never what the nodes said before (no hop yet, or a replaced one).
        placed = [n for n in self.directory.nodes() if n.address in addresses]
        await asyncio.gather(*(self._probe(n) for n in placed))
        old, self.pipeline, self.plan = self.pipeline, pipeline, plan
        self.max_context = plan.context_tokens
        self.epoch = pipeline.epoch  # an adopted pipeline keeps the epoch its nodes hold
        if self.generation is None:
            index = PrefixIndex() if self.settings.prefix_cache else None
            self.generation = GenerationEngine(pipeline, prefix_index=index)
            self.replaying = ReplayingEngine(self.generation, self)
            self.engine = MeteredEngine(self.replaying, max_context=plan.context_tokens)
        else:
            self.generation.pipeline = pipeline
        self._placed.set()
        self._placed = asyncio.Event()
        if old is not None:
            await old.close()
        log.info("model placed (epoch %d):\n%s", self.epoch, plan.format_table())

    def _pipeline_settings(self, plan: PlacementPlan) -> PipelineSettings:
        settings = self.settings
        fetch = self.weights.load_args() if self.weights is not None else {}
        # Each node's conversation cache gets the budget the plan reserved on it: what its own
        # layers' snapshots take, so no node holds more than its memory was planned for. Every
        # node holds snapshots of the same positions, each sized by its own layers, so the
        # nodes fill their budgets at the pace of one another; an eviction anywhere drops the
        # prefix everywhere.
        snapshots = tuple(stage.snapshot_bytes for stage in plan.stages)
        return PipelineSettings(
            token=settings.token,
            tls=settings.tls,
            ranges=[(stage.shard.start, stage.shard.end) for stage in plan.stages],
            prefix_budget_bytes=snapshots if plan.prefix_cache else None,
            node_model_dir=settings.node_model_dir,
            pinned_addresses=settings.pinned_addresses,
            adopt=settings.adopt_shards,  # keep shards that nodes already hold (no reload)
            warmup=self._warmup_args() if settings.warmup else None,
            **fetch,
        )

    def _warmup_args(self) -> WarmupArgs:
        """What every warm-up of this coordinator runs (each placement measures its chunks
        afresh, from the default one)."""
        return WarmupArgs(
            prefill_chunk=DEFAULT_PREFILL_CHUNK,
            max_running=self.settings.max_running,
            max_context=self.max_context or 0,
            mtp_depth=self.settings.mtp_depth,
            has_mtp=self.has_mtp_head,
        )

    async def warm_up(self, hook: WarmupHook | None = None) -> None:
        """Run every shape the nodes will serve through the pipeline of the moment
        (cluster.decode.warmup), new requests waiting in the admission queue meanwhile;
        `self.warmup` says how far it is. When the pipeline fails meanwhile, the warm-up
        stops and stays "warming": the re-placement that follows warms its new shards. Any
        other failure is logged, and the cluster serves cold."""
        if not self.settings.warmup:
            self.warmup.skip()
            return
        async with self._warming:
            pipeline, generation = self.pipeline, self.generation
            assert pipeline is not None and generation is not None
            args = self._warmup_args()
            chunk = args.prefill_chunk
            steps = args.plan(pipeline.max_context)
            say = _say if self.settings.announce else log.info
            if self.admission is not None:
                self.admission.pause()
            vocab_size = load_model_config(self.model_dir).text.vocab_size

            async def measure() -> None:
                choice = await measure_chunks(pipeline, chunk, vocab_size)
                generation.prefill_chunk = choice.prefill_chunk
                generation.interleave_chunk = choice.interleave_chunk
                generation.pacer.fallback_gap_s = choice.decode_step_s
                say(choice.line())

            try:
                await run_warmup(
                    pipeline,
                    steps,
                    prefill_chunk=chunk,
                    vocab_size=vocab_size,
                    progress=self.warmup,
                    hook=hook,
                    say=say,
                    last=("timing prefill chunks", measure),
                )
            except Exception as error:
                if pipeline.failure is not None or pipeline is not self.pipeline:
                    log.info("warm-up cut short (%s); the new placement warms up again", error)
                    return
                log.warning("warm-up failed, serving cold: %s", error)
                self.warmup.finish(error=str(error) or type(error).__name__)
            finally:
                if self.admission is not None and self.pipeline.failure is None:
                    self.admission.resume()

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
                await self.warm_up()  # new shards are cold
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
        deadline = time.monotonic() + self.settings.replay_wait_s
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
        return not busy and not self._warming.locked()

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
            await self.warm_up()  # new shards are cold
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
            client = NodeClient(node.address, self.settings.token, self.settings.tls)
            self._probes[node.address] = client
        heard = self._heard.setdefault(node.address, _LastReply())
        try:
            asked = time.monotonic()
            heard.info = await client.info(timeout=DOWN_AFTER_S - HEARTBEAT_S)
            heard.at, heard.asked = time.monotonic(), asked
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
            statuses.append(self._status(stage.address, now, stage.shard))
        for node in self.directory.nodes():  # standby nodes: found, not in the pipeline
            if node.address not in placed:
                statuses.append(self._status(node.address, now, None))
        return statuses

    def _status(self, address: str, now: float, shard: ShardSpec | None) -> NodeStatus:
        heard = self._heard.get(address, _LastReply())
        info = heard.info or pb.NodeInfo(node_id=address)
        up = heard.at > 0 and now - heard.at < DOWN_AFTER_S
        return NodeStatus(
            node_id=info.node_id,
            address=address,
            shard=shard,
            up=up,
            last_heartbeat_s=now - heard.asked if heard.at else float("inf"),
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
            mtp_steps_decided=info.mtp_steps_decided,
            mtp_steps_plain=info.mtp_steps_plain,
            mtp_drafts_chosen=info.mtp_drafts_chosen,
            prefix_snapshots=info.prefix_snapshots,
            prefix_snapshot_bytes=info.prefix_snapshot_bytes,
            prefix_budget_bytes=info.prefix_budget_bytes,
            request_cache_bytes=info.cache_bytes,
            running_requests=info.active_requests,
            mlx_active_bytes=info.mlx_active_bytes,
            mlx_cache_bytes=info.mlx_cache_bytes,
            mlx_peak_bytes=info.mlx_peak_bytes,
            step_phases_ms=step_phases_ms(info),
            keeps_awake=info.keeps_awake,
            keep_awake_note=info.keep_awake_note,
            kernel_builds=info.kernel_builds,
        )

    def coordinator_links(self) -> list[CoordinatorLinkStatus]:
        """The current pipeline's links from and to this coordinator, head first."""
        return coordinator_link_statuses(self.pipeline)

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
            prefix_cache_misses=dict(index.stats.misses) if index else {},
            replays_total=replaying.replays_total if replaying else 0,
            replays_failed=replaying.replays_failed if replaying else 0,
            interleave_chunk_tokens=self.generation.interleave_chunk if self.generation else 0,
            interleave_chunk_changes=self.generation.pacer.changes if self.generation else 0,
        )


async def run_coordinator(
    settings: CoordinatorSettings,
    *,
    started: asyncio.Event | None = None,
    warmup_hook: WarmupHook | None = None,
) -> None:
    """Serve the OpenAI-compatible API and the dashboard until cancelled; `started` is set
    once the model is placed, the HTTP port listens and the warm-up is over (the endpoint is
    printed then, not before). While the nodes warm up, /health answers 503 "warming";
    `warmup_hook` is called before each warm-up step (`cluster.decode.warmup.WarmupHook`)."""
    api_keys = settings.api_keys or ApiKeys()
    # Refused before anything starts (OpenEndpointError), unless `allow_open` says it is meant.
    check_endpoint(settings.host, api_keys.enabled, settings.allow_open)
    if not api_keys.enabled and settings.host not in LOOPBACK_HOSTS:
        log.warning(
            "serving on %s without an API key: anyone who reaches it may use it", settings.host
        )
    directory = NodeDirectory(list(settings.nodes), browse=settings.browse)
    admission = AdmissionController(
        max_running=settings.max_running, max_queued=settings.max_queued, queue_timeout_s=60.0
    )
    coordinator = Coordinator(settings, directory, admission=admission)
    if not coordinator.has_mtp_head:
        if settings.announce:
            print(f"{settings.model_dir.name}: {NO_MTP_HEAD}", flush=True)
        else:
            log.warning("%s: %s", settings.model_dir.name, NO_MTP_HEAD)
    tokenizer = load_tokenizer(settings.model_dir)
    await coordinator.start()
    app = create_app(
        coordinator.engine,
        tokenizer,
        coordinator,
        served=ServedModel(settings.model_dir.name, settings.mtp_depth, coordinator.has_mtp_head),
        admission=admission,
        api_keys=api_keys,
        monitoring=Monitoring(coordinator.counters, coordinator.warmup, coordinator.history),
    )
    # A client that hangs up cancels its handler at once, and with it the request on every
    # node (RemotePipeline writes the shared step stream from its own task, so a cancelled
    # request never cuts the stream that the others ride on).
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, settings.host, settings.port)
    await site.start()
    try:
        await coordinator.warm_up(warmup_hook)
        await coordinator.warmup.ready()  # (one cut short by a lost node: the next one's end)
        if settings.announce:  # the port bound: `--port 0` takes any free one
            url = f"http://{settings.host}:{runner.addresses[0][1]}"
            print(f"OpenAI endpoint: {url}/v1   dashboard: {url}/", flush=True)
        if started is not None:
            started.set()
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
        await coordinator.close()


def _say(line: str) -> None:
    print(line, flush=True)


def _layout(plan: PlacementPlan) -> list[tuple[str, int, int]]:
    return [(stage.address, stage.shard.start, stage.shard.end) for stage in plan.stages]


def hop_status(hop: pb.HopLink) -> HopStatus:
    """A node's report of its hop as the status shows it; an address that did not answer
    has None for its round trip, not 0 ms."""
    tried = tuple((t.address, t.rtt_ms if t.answered else None) for t in hop.tried)
    return HopStatus(
        hop.address,
        hop.kind,
        hop.rtt_ms,
        hop.measured,
        tried,
        failovers=hop.failovers,
        failbacks=hop.failbacks,
        last_failover=hop.last_failover,
        degraded=hop.degraded,
        best_address=hop.best_address,
    )


def coordinator_link_statuses(pipeline: RemotePipeline | None) -> list[CoordinatorLinkStatus]:
    """`pipeline`'s links from and to its driver as the status shows them: the step stream
    to the head, then each node's results stream and control calls."""
    if pipeline is None:
        return []
    return [coordinator_link_status(link) for link in pipeline.driver_links()]


def coordinator_link_status(link: DriverLink) -> CoordinatorLinkStatus:
    """One driver link as the status shows it; a stream on the node's gRPC channel (no
    failover state) at the node's given address."""
    client, state = link.client, link.state
    transport = "tcp" if state is not None and link.role != "control" else "grpc"
    if state is None:
        return CoordinatorLinkStatus(
            link.role, client.node_id, client.address, transport, client.address
        )
    current, best = state.current, state.routes[0]
    return CoordinatorLinkStatus(
        link.role,
        client.node_id,
        client.address,
        transport,
        current.address,
        kind=current.kind,
        interface=current.interface,
        best_address=best.address,
        degraded=state.degraded,
        failovers=state.failovers,
        failbacks=state.failbacks,
        last_failover=state.last_reason,
        failed=state.failed,
    )
