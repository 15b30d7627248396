"""The node daemon: `cluster node --host H --port P --token SECRET`.

A gRPC (asyncio) service around one shard: Info for health, LoadShard to take a layer range,
Steps for the activation stream, Results for the drivers, Release and Rollback for a request's
state. All MLX work runs on one worker thread; the event loop only moves messages.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import os
import platform
import socket
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import mlx.core as mx
from mlx.utils import tree_flatten

from cluster import __version__
from cluster.config import ModelDirError
from cluster.decode import late_input
from cluster.decode.kernel_builds import (
    KernelBuildReport,
    KernelPlan,
    build_kernels,
    compiles_kernels,
)
from cluster.decode.runner import ShardRunner
from cluster.decode.warmup import WarmupArgs
from cluster.decode.worker import MLXWorker
from cluster.messages import RequestError
from cluster.model.footprint import ModelFootprint
from cluster.model.loading import load_shard
from cluster.model.shard import ShardSpec
from cluster.transport.auth import TLSConfig, TokenInterceptor
from cluster.transport.failover import routes_of
from cluster.transport.hop_choice import HopChoice, choose_hop
from cluster.transport.links import local_links
from cluster.transport.step_link import StepListener
from cluster.transport.wire import grpc_server_options
from cluster.weights.store import WeightsStore, default_cache_dir
from node.hardware import this_machine
from node.keep_awake import KeepAwake
from node.shard_weights import ShardWeights, ShardWeightsError
from node.stage import Inbound, Stage, Subscribers, Successor, status_of
from proto import cluster_pb2 as pb
from proto import cluster_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

IDLE_SWEEP_SECONDS = 5.0
MIN_MLX_CACHE_BYTES = 32 * 2**20


def _no_reply(event: pb.StepEvent) -> None:
    """The TCP step stream is one-way (errors reach the driver over Results)."""


def warmup_from_proto(m: pb.WarmupPlan) -> WarmupArgs:
    return WarmupArgs(
        prefill_chunk=m.prefill_chunk,
        max_running=m.max_running,
        max_context=m.max_context,
        mtp_depth="auto" if m.mtp_depth_auto else m.mtp_depth,
        has_mtp=m.has_mtp,
    )


def memory_left_by(model_dir: str | Path, spec: ShardSpec) -> int | None:
    """The node's memory (`total_memory_bytes`) less what `spec`'s weights take, from the
    checkpoint's headers; None where they cannot be read."""
    try:
        footprint = ModelFootprint.from_dir(model_dir)
    except (OSError, ValueError):
        return None
    layers = sum(footprint.layer_weight_bytes[spec.start : spec.end])
    weights = layers + footprint.extra_bytes(is_head=spec.is_head, is_tail=spec.is_tail)
    return total_memory_bytes() - weights


def mlx_cache_limit(runner: ShardRunner, weights_bytes: int) -> int:
    """How many bytes of freed buffers MLX may keep for reuse on this node.

    MLX keeps freed buffers up to its memory limit by default, so a node's footprint only
    grows towards the machine's whole memory. The cap is half of what the node's memory
    (`--memory-gb`, else the machine's) has left beyond its weights, its request caches' budget
    and its prefix snapshots' budget: the node stays within its memory, and the buffers of a
    whole batch step stay cached. Not smaller: a batch rewrites every request's recurrent
    states each step, and a cap below that working set frees and allocates them again on every
    step, which on CUDA synchronizes the device."""
    reserved = (runner.cache_budget_bytes or 0) + runner.snapshots.budget_bytes
    headroom = total_memory_bytes() - weights_bytes - reserved
    return max(headroom // 2, MIN_MLX_CACHE_BYTES)


def mlx_memory_limit() -> int | None:
    """MLX's memory limit for this node where it shares its device (`--memory-share` below
    1, or `--memory-gb`): its share. Past the limit MLX's allocator frees its cached buffers
    before it allocates, so the node's own cache does not grow into its neighbours' share
    (whether the device's allocator hands that memory on at once is its own affair). None:
    MLX's default (the whole device)."""
    if MEMORY_SHARE >= 1 and MEMORY_CAP_BYTES is None:
        return None
    return total_memory_bytes()


def device_name() -> str:
    device = mx.default_device()
    if device.type == mx.gpu and mx.metal.is_available():
        return f"{platform.machine()} Metal GPU"
    if device.type == mx.gpu:
        return "CUDA GPU"
    return f"{platform.machine()} CPU"


MEMORY_CAP_BYTES: int | None = None  # NodeSettings.memory_cap_bytes of the node running here
MEMORY_SHARE = 1.0  # NodeSettings.memory_share of the node running here


@functools.cache
def discrete_gpu_memory_bytes() -> int | None:
    """The memory of the GPU that MLX runs on where it has its own (CUDA), else None: an
    Apple-silicon GPU shares the machine's memory, and the CPU backend uses the machine's."""
    device = mx.default_device()
    if device.type != mx.gpu or mx.metal.is_available():
        return None
    info = mx.device_info()
    size = info.get("total_memory", info.get("memory_size", 0))
    return int(size) if isinstance(size, int) and size > 0 else None


def total_memory_bytes() -> int:
    """The memory that bounds this node's weights and caches: its `--memory-share` of the
    machine's, at most `--memory-gb`. On a discrete GPU the GPU's own, not the host's, which
    may be larger (a host of 256 GB with a 141 GB GPU would plan caches and MLX's buffer
    cache that the GPU cannot hold)."""
    total = discrete_gpu_memory_bytes()
    if total is None:
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):
            total = 0
    total = int(total * MEMORY_SHARE)
    return min(total, MEMORY_CAP_BYTES) if MEMORY_CAP_BYTES is not None else total


def process_memory_bytes() -> int:
    """The memory this process holds of `total_memory_bytes`: on a discrete GPU, MLX's
    buffers there (in use and cached); elsewhere the resident memory (Linux /proc; else
    MLX's own active memory)."""
    if discrete_gpu_memory_bytes() is not None:
        return mx.get_active_memory() + mx.get_cache_memory()
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return mx.get_active_memory()


@dataclass(frozen=True, slots=True)
class NodeSettings:
    """A node daemon's configuration, built once from `cluster node`'s options.

    It listens on `host`:`port` (0: any free port) and takes requests that carry `token`;
    with `tls`, it serves and dials TLS only. `node_id`: its name in the coordinator (None:
    one made of the host name and port). `cache_budget_bytes` and `prefix_budget_bytes`: its
    request caches' and prefix snapshots' memory unless a LoadShard names others (None:
    unlimited, and the runner's default). A request idle for `idle_timeout_s` has its caches
    freed. `advertise`: announce the node over mDNS. `memory_cap_bytes`: report at most this
    much memory to the planner (None: the machine's). `memory_share`: the share of the
    machine's memory it plans within (nodes sharing one machine). `spin_s`: how long its MLX
    thread stays awake for the next step (`MLXWorker`; None: the backend's default).
    `build_ahead`: whether it builds its next step before the step's message comes
    (`cluster.decode.late_input.late_input_for`)."""

    token: str = field(repr=False)  # the cluster secret: kept out of logs
    host: str = "0.0.0.0"
    port: int = 50151
    node_id: str | None = None
    tls: TLSConfig | None = None
    cache_budget_bytes: int | None = None
    prefix_budget_bytes: int | None = None
    idle_timeout_s: float = 600.0
    advertise: bool = False
    memory_cap_bytes: int | None = None
    memory_share: float = 1.0
    spin_s: float | None = None
    build_ahead: str = "auto"


def default_node_id(port: int) -> str:
    """A node's name when it was given none: the host's name, the port, and a random tail
    that tells apart the nodes of one host and port started one after the other."""
    return f"{socket.gethostname()}-{port}-{uuid.uuid4().hex[:4]}"


class NodeService(pb_grpc.NodeServicer):
    def __init__(self, settings: NodeSettings, weights_store: WeightsStore | None = None):
        """The gRPC service of the node `settings` describes, fetching weights into
        `weights_store` (None: the default cache)."""
        self.settings = settings
        self.token = settings.token
        self.tls = settings.tls  # also used to dial the next node
        self.node_id = settings.node_id or default_node_id(settings.port)
        self.worker = MLXWorker(settings.spin_s)
        # The doorbell of the steps built ahead (cluster.decode.late_input), one for every
        # shard this node loads.
        self.doorbell = late_input.late_input_for(settings.build_ahead)
        self.subscribers = Subscribers()
        self.stage: Stage | None = None
        self.shard_request: pb.LoadShardRequest | None = None
        self.links = [link.to_proto() for link in local_links()]
        self.hop: HopChoice | None = None  # the link to the successor
        self.shard_loads = 0
        self.kernel_builds: KernelBuildReport | None = None  # of the last load
        self.weights_bytes = 0
        self.started = time.monotonic()
        self.step_port = 0  # the step stream's TCP port (`cluster.transport.step_link`); 0: none
        self._load_lock = asyncio.Lock()
        # Holds the Mac awake while a shard is loaded (node.keep_awake).
        self.keep_awake = KeepAwake()
        self.weights = ShardWeights(
            weights_store or WeightsStore(default_cache_dir()),
            token=self.token,
            node_id=self.node_id,
            tls=self.tls,
        )
        self._sweeper = asyncio.create_task(self._sweep_idle())

    async def close(self) -> None:
        self._sweeper.cancel()
        if self.stage:
            await self.stage.close()
        self.worker.close()
        self.keep_awake.release("the node stopped")

    # -- RPCs -------------------------------------------------------------------------------

    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.NodeInfo:
        return self._info()

    async def LoadShard(
        self, request: pb.LoadShardRequest, context: grpc.aio.ServicerContext
    ) -> pb.NodeInfo:
        async with self._load_lock:
            if self.stage:
                await self.stage.close()
                self.stage = None
                self.keep_awake.release()
                # The old shard's weights can sit in reference cycles (a stage and its task,
                # a layer and its compiled steps): free them before loading the next shard, so
                # that a node never holds two shards' weights at once.
                gc.collect()
            try:
                spec = ShardSpec(request.start, request.end, request.is_head, request.is_tail)
                dtype = getattr(mx, request.dtype) if request.dtype else None
                model_dir = await self.weights.model_dir(request, context.peer())
                builds = None
                if request.HasField("warmup"):
                    plan = KernelPlan(
                        str(model_dir), request.dtype, warmup_from_proto(request.warmup),
                        (spec.start, spec.end),
                    )  # fmt: skip
                    # The checkpoint's headers are read only where a build may run.
                    free = memory_left_by(model_dir, spec) if compiles_kernels() else None
                    builds = asyncio.create_task(build_kernels(plan, free_bytes=free))
                try:
                    shard = await self.worker.run(
                        load_shard, model_dir, spec, dtype=dtype, for_decoding=True
                    )
                except BaseException:
                    if builds is not None:
                        builds.cancel()
                    raise
                if builds is not None:  # the warm-up that follows reads what they built
                    self.kernel_builds = await builds
                    if self.kernel_builds.applies:
                        log.info("%s", self.kernel_builds.line())
            except ShardWeightsError as error:
                await context.abort(error.code, f"cannot load shard: {error}")
            except (ModelDirError, ValueError, OSError, AttributeError) as error:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"cannot load shard: {error}")
            budget = (
                request.cache_budget_bytes
                if request.HasField("cache_budget_bytes")
                else self.settings.cache_budget_bytes
            )
            prefix_budget = (
                request.prefix_budget_bytes
                if request.HasField("prefix_budget_bytes")
                else self.settings.prefix_budget_bytes
            )
            runner = ShardRunner(
                shard, cache_budget_bytes=budget, prefix_budget_bytes=prefix_budget
            )
            self.weights_bytes = sum(v.nbytes for _, v in tree_flatten(shard.parameters()))
            self.hop = None
            if request.next_node:
                self.hop = await choose_hop(
                    request.next_node,
                    list(request.next_node_links),
                    request.next_node_id,
                    self.token,
                    self.tls,
                )
            successor = None
            if self.hop is not None:
                routes = routes_of(self.hop, list(request.next_node_links))
                successor = Successor(
                    self.hop.address, self.token, self.tls, routes, request.next_node_id
                )
            self.stage = Stage(
                runner,
                self.worker,
                self.subscribers,
                successor=successor,
                epoch=request.epoch,
                micro_batches=request.micro_batches,
                doorbell=self.doorbell,
            )
            self.shard_request = request
            self.shard_loads += 1
            self.keep_awake.hold()
            mx.set_cache_limit(mlx_cache_limit(runner, self.weights_bytes))
            if (limit := mlx_memory_limit()) is not None:
                mx.set_memory_limit(limit)
            log.info("loaded %s of %s", spec.describe(), request.model_dir)
            return self._info()

    async def Steps(
        self, request_iterator: AsyncIterator[pb.StepBatch], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.StepEvent]:
        await self._require_stage(context)
        replies: asyncio.Queue[pb.StepEvent | None] = asyncio.Queue()

        async def read() -> None:
            try:
                async for message in request_iterator:
                    # The stage of the moment, not the one the stream began with: a stream
                    # left open from an old placement must not keep that stage (and its
                    # caches) alive, and its messages meet the new stage's epoch check.
                    if self.stage is not None:
                        self.stage.accept(message, replies.put_nowait)
            finally:
                replies.put_nowait(None)

        reader = asyncio.create_task(read())
        try:
            while (event := await replies.get()) is not None:
                yield event
        finally:
            reader.cancel()

    def accept_linked_step(self, message: Inbound) -> None:
        """A step from the predecessor's TCP step stream (`cluster.transport.step_link`): as
        `Steps` takes one, to the stage of the moment. The sender reads no replies: without a
        stage, the step's requests fail on the driver's Results stream, as `Steps` would
        refuse it."""
        if self.stage is not None:
            self.stage.accept(message, _no_reply)
            return
        rids = [entry.request_id for entry in message.entries]
        self.subscribers.fail(
            rids, grpc.StatusCode.FAILED_PRECONDITION, "no shard loaded", message.epoch
        )

    async def Results(
        self, request: pb.ResultsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ResultBatch]:
        queue = self.subscribers.add()
        try:
            # Headers now tell the subscriber it is registered: nothing published later is lost.
            await context.send_initial_metadata(())
            while True:
                yield await queue.get()
        finally:
            self.subscribers.remove(queue)

    async def Release(
        self, request: pb.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReleaseReply:
        stage = await self._require_stage(context)
        runner, rid = stage.runner, request.request_id
        held = rid in runner.requests
        saved = False
        if held and request.prefix_save:
            saved, dropped = await self.worker.run(
                runner.release_as_prefix, rid, request.prefix_save, request.prefix_positions
            )
            if dropped:
                self.subscribers.publish(pb.ResultBatch(prefix_dropped=dropped))
        else:
            held = await self.worker.run(runner.release, rid)
        if not held:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown request id {rid!r}")
        return pb.ReleaseReply(released=held, prefix_saved=saved)

    async def DropPrefixSnapshots(
        self, request: pb.PrefixSnapshotDropRequest, context: grpc.aio.ServicerContext
    ) -> pb.PrefixSnapshotDropReply:
        stage = await self._require_stage(context)
        ids = list(request.snapshot_ids)
        dropped = await self.worker.run(stage.runner.snapshots.drop, ids)
        return pb.PrefixSnapshotDropReply(dropped=len(dropped))

    async def LinkPing(
        self, request: pb.LinkPingRequest, context: grpc.aio.ServicerContext
    ) -> pb.LinkPingReply:
        return pb.LinkPingReply(node_id=self.node_id, payload=request.payload)

    async def Rollback(
        self, request: pb.RollbackRequest, context: grpc.aio.ServicerContext
    ) -> pb.RollbackReply:
        stage = await self._require_stage(context)
        try:
            position = await self.worker.run(
                stage.runner.rollback, request.request_id, request.drop
            )
        except RequestError as error:
            await context.abort(status_of(error), str(error))
        return pb.RollbackReply(applied=True, position=position)

    # -- helpers ----------------------------------------------------------------------------

    async def _require_stage(self, context: grpc.aio.ServicerContext) -> Stage:
        if self.stage is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "no shard loaded")
        return self.stage

    def _info(self) -> pb.NodeInfo:
        hardware = this_machine()
        info = pb.NodeInfo(
            node_id=self.node_id,
            version=__version__,
            device=device_name(),
            memory_total_bytes=total_memory_bytes(),
            memory_used_bytes=process_memory_bytes(),
            mlx_active_bytes=mx.get_active_memory(),
            mlx_cache_bytes=mx.get_cache_memory(),
            mlx_peak_bytes=mx.get_peak_memory(),
            weights_bytes=self.weights_bytes,
            uptime_s=time.monotonic() - self.started,
            chip=hardware.chip,
            os=hardware.os,
            cpu_count=hardware.cpu_count,
            step_port=self.step_port,
            step_records=self.step_port != 0,
        )
        self.weights.fill_info(info)
        info.links.extend(self.links)
        info.shard_loads = self.shard_loads
        info.keeps_awake = self.keep_awake.holding
        info.keep_awake_note = self.keep_awake.reason
        if self.kernel_builds is not None and self.kernel_builds.applies:
            info.kernel_builds = self.kernel_builds.line()
        if self.hop is not None and self.stage is not None:
            info.hop.CopyFrom(self.hop.to_proto())
            self._fill_hop_link(info.hop)
        if self.stage is not None and self.shard_request is not None:
            r, runner, stats = self.shard_request, self.stage.runner, self.stage.stats
            info.shard.CopyFrom(
                pb.ShardSpec(
                    model_id=r.model_id,
                    model_dir=r.model_dir,
                    start=r.start,
                    end=r.end,
                    is_head=r.is_head,
                    is_tail=r.is_tail,
                    dtype=r.dtype,
                    next_node=r.next_node,
                    next_node_pinned=not r.next_node_links,
                    next_node_id=r.next_node_id,
                )
            )
            info.epoch = r.epoch
            info.mlx_cache_limit_bytes = mlx_cache_limit(runner, self.weights_bytes)
            info.cache_bytes = runner.cache_bytes
            info.cache_budget_bytes = runner.cache_budget_bytes or 0
            info.active_requests = len(runner.requests)
            info.steps_total = stats.messages_in
            info.step_latency_ms = stats.mean_latency_ms
            info.step_phases.CopyFrom(stats.mean_phases())
            info.steps_ahead_used = runner.steps_ahead_used
            info.steps_ahead_undone = runner.steps_ahead_undone
            info.positions_computed = runner.positions_computed
            info.prefix_snapshots = len(runner.snapshots)
            info.prefix_snapshot_bytes = runner.snapshots.nbytes
            info.prefix_budget_bytes = runner.snapshots.budget_bytes
            info.prefix_resumes = runner.snapshots.resumes
            info.busy_seconds_total = stats.busy_s_total
            info.batches_total = stats.batches_total
            if self.stage.hop_probe is not None:
                info.next_hop_rtt_ms = self.stage.hop_probe.mean_rtt_ms
            if runner.tail is not None:  # the depth the tail chose per step (Tail.depth_steps)
                info.mtp_steps_decided = runner.tail.depth_steps
                info.mtp_steps_plain = runner.tail.depth_plain_steps
                info.mtp_drafts_chosen = runner.tail.depth_drafts
        return info

    def _fill_hop_link(self, hop: pb.HopLink) -> None:
        """Where the hop's stream runs now, and how it moved (`cluster.transport.failover`)."""
        downstream = self.stage.downstream
        state = downstream.link_state if downstream is not None else None
        if state is None:
            return
        current, best = state.current, state.routes[0]
        hop.address, hop.kind, hop.interface = current.address, current.kind, current.interface
        hop.rtt_ms = current.rtt_ms or 0.0
        hop.failovers, hop.failbacks = state.failovers, state.failbacks
        hop.last_failover = state.last_reason
        hop.degraded, hop.best_address = state.degraded, best.address

    async def _sweep_idle(self) -> None:
        while True:
            await asyncio.sleep(IDLE_SWEEP_SECONDS)
            if self.stage is not None:
                evicted = await self.worker.run(
                    self.stage.runner.evict_idle, self.settings.idle_timeout_s
                )
                if evicted:
                    log.info("freed %d idle request(s)", len(evicted))


async def serve(
    settings: NodeSettings,
    *,
    weights_store: WeightsStore | None = None,
    ready: asyncio.Event | None = None,
) -> None:
    """Run a node until cancelled; `ready` is set once it listens. Raises OSError when it
    cannot listen on `settings.host`:`settings.port`."""
    global MEMORY_CAP_BYTES, MEMORY_SHARE
    MEMORY_CAP_BYTES, MEMORY_SHARE = settings.memory_cap_bytes, settings.memory_share
    host, port, token, tls = settings.host, settings.port, settings.token, settings.tls
    service = NodeService(settings, weights_store)
    node_id = service.node_id
    server = grpc.aio.server(interceptors=[TokenInterceptor(token)], options=grpc_server_options())
    pb_grpc.add_NodeServicer_to_server(service, server)
    address = f"{host}:{port}"
    if tls is None:
        bound = server.add_insecure_port(address)
    else:
        bound = server.add_secure_port(address, tls.server_credentials())
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port}")
    await server.start()
    # Steps and results stream over TCP (encrypted under TLS, as the gRPC port is).
    step_listener = StepListener(
        token,
        service.accept_linked_step,
        service.subscribers.add_link,
        service.subscribers.resume_link,
        tls_context=tls.server_context() if tls is not None else None,
    )
    service.step_port = await step_listener.start(host)
    advertiser = None
    if settings.advertise:
        from cluster.transport.advertise import NodeAdvertiser

        # A node bound to one address announces that address only (on its interface);
        # bound to all, it announces every address the machine has.
        specific = (
            {} if host in ("0.0.0.0", "::", "") else {"addresses": [host], "interfaces": [host]}
        )
        advertiser = NodeAdvertiser(
            node_id=node_id,
            port=bound,
            memory_bytes=total_memory_bytes(),
            device=device_name(),
            version=__version__,
            **specific,
        )
        await advertiser.start()
    log.info("node %s listening on %s:%d", node_id, host, bound)
    print(f"node {node_id} listening on {host}:{bound}", flush=True)
    if ready is not None:
        ready.set()
    try:
        await server.wait_for_termination()
    finally:
        if advertiser is not None:
            await advertiser.stop()
        await step_listener.close()
        await server.stop(grace=1.0)
        await service.close()
