"""The node daemon: `cluster node --host H --port P --token SECRET`.

A gRPC (asyncio) service around one shard: Info for health, LoadShard to take a layer range,
Steps for the activation stream, Results for the drivers, Release and Rollback for a request's
state. All MLX work runs on one worker thread; the event loop only moves messages.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import platform
import socket
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import click
import grpc
import mlx.core as mx
from mlx.utils import tree_flatten

from cluster import __version__
from cluster.config import ModelDirError
from cluster.decode import doorbell
from cluster.decode.runner import ShardRunner
from cluster.decode.worker import GPU_SPIN_S, MLXWorker
from cluster.messages import RequestError
from cluster.model.loading import load_shard
from cluster.model.shard import ShardSpec
from cluster.transport.auth import TLSConfig, TokenInterceptor
from cluster.transport.hop_choice import HopChoice, choose_hop
from cluster.transport.links import local_links
from cluster.transport.step_link import StepListener
from cluster.transport.wire import grpc_server_options
from cluster.weights.store import WeightsStore, default_cache_dir
from node.hardware import this_machine
from node.shard_weights import ShardWeights, ShardWeightsError
from node.stage import Inbound, Stage, Subscribers, status_of
from proto import cluster_pb2 as pb
from proto import cluster_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

IDLE_SWEEP_SECONDS = 5.0
MIN_MLX_CACHE_BYTES = 32 * 2**20


def _no_reply(event: pb.StepEvent) -> None:
    """The TCP step stream is one-way (errors reach the driver over Results)."""


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


def device_name() -> str:
    device = mx.default_device()
    if device.type == mx.gpu and mx.metal.is_available():
        return f"{platform.machine()} Metal GPU"
    if device.type == mx.gpu:
        return "CUDA GPU"
    return f"{platform.machine()} CPU"


MEMORY_CAP_BYTES: int | None = None  # `cluster node --memory-gb`


def total_memory_bytes() -> int:
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        total = 0
    return min(total, MEMORY_CAP_BYTES) if MEMORY_CAP_BYTES is not None else total


def process_memory_bytes() -> int:
    """Resident memory of this process (Linux /proc; elsewhere MLX's own active memory)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return mx.get_active_memory()


class NodeService(pb_grpc.NodeServicer):
    def __init__(
        self,
        *,
        token: str,
        node_id: str,
        cache_budget_bytes: int | None = None,
        idle_timeout_s: float = 600.0,
        tls: TLSConfig | None = None,
        weights_store: WeightsStore | None = None,
        prefix_budget_bytes: int | None = None,
        spin_s: float | None = None,
        build_ahead: str = "auto",
    ):
        self.token = token
        self.prefix_budget_bytes = prefix_budget_bytes
        self.tls = tls  # also used to dial the next node
        self.node_id = node_id
        self.cache_budget_bytes = cache_budget_bytes
        self.idle_timeout_s = idle_timeout_s
        self.worker = MLXWorker(spin_s)
        # The doorbell of the steps built ahead (cluster.decode.doorbell), one for every
        # shard this node loads.
        self.doorbell = doorbell.for_setting(build_ahead)
        self.subscribers = Subscribers()
        self.stage: Stage | None = None
        self.shard_request: pb.LoadShardRequest | None = None
        self.links = [link.to_proto() for link in local_links()]
        self.hop: HopChoice | None = None  # the link to the successor
        self.shard_loads = 0
        self.weights_bytes = 0
        self.started = time.monotonic()
        self.step_port = (
            0  # the step stream's TCP port (`cluster.transport.step_link`); 0: gRPC only
        )
        self._load_lock = asyncio.Lock()
        self.weights = ShardWeights(
            weights_store or WeightsStore(default_cache_dir()),
            token=token,
            node_id=node_id,
            tls=tls,
        )
        self._sweeper = asyncio.create_task(self._sweep_idle())

    async def close(self) -> None:
        self._sweeper.cancel()
        if self.stage:
            await self.stage.close()
        self.worker.close()

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
                # The old shard's weights can sit in reference cycles (a stage and its task,
                # a layer and its compiled steps): free them before loading the next shard, so
                # that a node never holds two shards' weights at once.
                gc.collect()
            try:
                spec = ShardSpec(request.start, request.end, request.is_head, request.is_tail)
                dtype = getattr(mx, request.dtype) if request.dtype else None
                model_dir = await self.weights.model_dir(request, context.peer())
                shard = await self.worker.run(
                    load_shard, model_dir, spec, dtype=dtype, for_decoding=True
                )
            except ShardWeightsError as error:
                await context.abort(error.code, f"cannot load shard: {error}")
            except (ModelDirError, ValueError, OSError, AttributeError) as error:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"cannot load shard: {error}")
            budget = (
                request.cache_budget_bytes
                if request.HasField("cache_budget_bytes")
                else self.cache_budget_bytes
            )
            prefix_budget = (
                request.prefix_budget_bytes
                if request.HasField("prefix_budget_bytes")
                else self.prefix_budget_bytes
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
            self.stage = Stage(
                runner,
                self.worker,
                self.subscribers,
                next_node=self.hop.address if self.hop else None,
                token=self.token,
                tls=self.tls,
                epoch=request.epoch,
                micro_batches=request.micro_batches,
                doorbell=self.doorbell,
            )
            self.shard_request = request
            self.shard_loads += 1
            mx.set_cache_limit(mlx_cache_limit(runner, self.weights_bytes))
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
        """A step from the predecessor's TCP step stream (`cluster.transport.step_link`): as `Steps` takes
        one, to the stage of the moment. The sender reads no replies: without a stage, the
        step's requests fail on the driver's Results stream, as `Steps` would refuse it."""
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
        if self.hop is not None and self.stage is not None:
            info.hop.CopyFrom(self.hop.to_proto())
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
        return info

    async def _sweep_idle(self) -> None:
        while True:
            await asyncio.sleep(IDLE_SWEEP_SECONDS)
            if self.stage is not None:
                evicted = await self.worker.run(self.stage.runner.evict_idle, self.idle_timeout_s)
                if evicted:
                    log.info("freed %d idle request(s)", len(evicted))


async def serve(
    host: str,
    port: int,
    token: str,
    *,
    node_id: str | None = None,
    cache_budget_bytes: int | None = None,
    idle_timeout_s: float = 600.0,
    advertise: bool = False,
    ready: asyncio.Event | None = None,
    tls: TLSConfig | None = None,
    weights_store: WeightsStore | None = None,
    prefix_budget_bytes: int | None = None,
    spin_s: float | None = None,
    build_ahead: str = "auto",
) -> None:
    """Run a node until cancelled. `spin_s`: how long its MLX thread stays awake for the next
    step (`MLXWorker`; None: the backend's default); `build_ahead`: whether it builds its next
    step before the step's message comes (`cluster.decode.doorbell.for_setting`)."""
    node_id = node_id or f"{socket.gethostname()}-{port}-{uuid.uuid4().hex[:4]}"
    service = NodeService(
        token=token,
        node_id=node_id,
        cache_budget_bytes=cache_budget_bytes,
        idle_timeout_s=idle_timeout_s,
        tls=tls,
        weights_store=weights_store,
        prefix_budget_bytes=prefix_budget_bytes,
        spin_s=spin_s,
        build_ahead=build_ahead,
    )
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
    step_listener = None
    if tls is None:  # under TLS every step stays on the encrypted gRPC stream
        step_listener = StepListener(
            token, service.accept_linked_step, service.subscribers.add_link
        )
        service.step_port = await step_listener.start(host)
    advertiser = None
    if advertise:
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
        if step_listener is not None:
            await step_listener.close()
        await server.stop(grace=1.0)
        await service.close()


@click.command("node")
@click.option("--host", default="0.0.0.0", show_default=True, help="Address to listen on.")
@click.option("--port", type=int, default=50151, show_default=True)
@click.option("--token", envvar="CLUSTER_TOKEN", default=None, help="Cluster secret.")
@click.option(
    "--token-file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Read the cluster secret from this file (mode 0600): kept off the command line.",
)
@click.option("--node-id", default=None, help="Name shown in the coordinator.")
@click.option(
    "--memory-gb",
    type=float,
    default=None,
    help="Report at most this much memory to the planner [default: the machine's].",
)
@click.option(
    "--cache-budget-gb",
    type=float,
    default=None,
    help="Memory for request caches on this node (default: unlimited).",
)
@click.option(
    "--prefix-cache-gb",
    type=float,
    default=None,
    help="Memory for conversation (prefix) snapshots on this node [default: 1].",
)
@click.option(
    "--idle-timeout",
    type=float,
    default=600.0,
    show_default=True,
    help="Seconds after which an idle request's caches are freed.",
)
@click.option(
    "--advertise/--no-advertise",
    default=True,
    show_default=True,
    help="Announce this node over mDNS (zeroconf).",
)
@click.option(
    "--tls-cert",
    envvar="CLUSTER_TLS_CERT",
    type=click.Path(exists=True),
    default=None,
    help="Cluster certificate (PEM): serve and dial nodes over TLS.",
)
@click.option(
    "--tls-key",
    envvar="CLUSTER_TLS_KEY",
    type=click.Path(exists=True),
    default=None,
    help="The certificate's private key (PEM).",
)
@click.option(
    "--cache-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Where fetched weights are cached [default: ~/.cache/cluster/models].",
)
@click.option(
    "--cache-cap-gb",
    type=float,
    default=None,
    help="Disk cap of the weights cache; least recently used models are evicted.",
)
@click.option(
    "--spin-ms",
    type=float,
    default=None,
    help="How long the MLX thread stays awake after a step for the next one, in ms "
    f"[default: {GPU_SPIN_S * 1e3:.0f} on a GPU, 0 on the CPU backend].",
)
@click.option(
    "--build-ahead",
    type=click.Choice(doorbell.BUILD_AHEAD_SETTINGS),
    default="auto",
    show_default=True,
    help="Build (on CUDA, launch) the next decode step before its message arrives: auto is "
    "on with MLX CUDA only; on also builds ahead on the CPU and Metal.",
)
def node_command(
    host: str,
    port: int,
    token: str | None,
    token_file: Path | None,
    node_id: str | None,
    memory_gb: float | None,
    cache_budget_gb: float | None,
    prefix_cache_gb: float | None,
    idle_timeout: float,
    advertise: bool,
    tls_cert: str | None,
    tls_key: str | None,
    cache_dir: Path | None,
    cache_cap_gb: float | None,
    spin_ms: float | None,
    build_ahead: str,
) -> None:
    """Run a node daemon that serves one shard of a model."""
    if token_file is not None:
        from cluster.secret import read_secret

        try:
            token = read_secret(token_file)
        except OSError as error:
            raise click.BadParameter(str(error), param_hint="--token-file") from error
    if not token:
        raise click.UsageError("give the cluster secret: --token-file, --token or CLUSTER_TOKEN")
    if memory_gb is not None and memory_gb <= 0:
        raise click.BadParameter("--memory-gb must be positive")
    if memory_gb is not None:
        global MEMORY_CAP_BYTES
        MEMORY_CAP_BYTES = int(memory_gb * 2**30)
    budget = int(cache_budget_gb * 2**30) if cache_budget_gb is not None else None
    if prefix_cache_gb is not None and prefix_cache_gb < 0:
        raise click.BadParameter("--prefix-cache-gb must be >= 0")
    prefix_budget = int(prefix_cache_gb * 2**30) if prefix_cache_gb is not None else None
    if cache_cap_gb is not None and cache_cap_gb <= 0:
        raise click.BadParameter("--cache-cap-gb must be positive")
    if spin_ms is not None and spin_ms < 0:
        raise click.BadParameter("--spin-ms must be >= 0")
    store = WeightsStore(
        cache_dir or default_cache_dir(),
        int(cache_cap_gb * 2**30) if cache_cap_gb is not None else None,
    )
    try:
        tls = TLSConfig.from_files(tls_cert, tls_key)
        if tls is not None:
            tls.server_credentials()  # fail now if the key is missing
        asyncio.run(
            serve(
                host,
                port,
                token,
                node_id=node_id,
                cache_budget_bytes=budget,
                idle_timeout_s=idle_timeout,
                advertise=advertise,
                tls=tls,
                weights_store=store,
                prefix_budget_bytes=prefix_budget,
                spin_s=spin_ms / 1e3 if spin_ms is not None else None,
                build_ahead=build_ahead,
            )
        )
    except KeyboardInterrupt:
        pass
    except (OSError, ValueError) as error:
        raise click.ClickException(str(error)) from error
