"""The driver's side of the node daemons: a `Pipeline` over remote shards.

The driver (the coordinator, or `cluster generate --nodes`) loads a shard on each node, keeps
one step stream open to the head and one results stream open from every node, and watches
each node with a heartbeat. A step is one message to the head; the nodes pass it along among
themselves; the tail's result comes back on its results stream. Both streams are the nodes'
plain TCP ones (`cluster.transport.step_link`, `cluster.transport.results_link`) where a node
serves them (no TLS), gRPC otherwise. The TCP ones run over the best of the node's addresses
as the driver measures them and move to the next-best when that path fails, losing nothing
(`cluster.transport.failover`). A node that dies or falls silent fails the requests in flight
with an error that names it, within seconds.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
from collections import defaultdict, deque
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import grpc

from cluster.config import load_model_config
from cluster.decode.engine import GenerationEngine
from cluster.decode.pipeline import is_prompt_chunk
from cluster.decode.warmup import WarmupArgs
from cluster.messages import StepRequest, StepResult
from cluster.model.shard import even_ranges, shard_specs
from cluster.transport import step_records
from cluster.transport.auth import TLSConfig
from cluster.transport.failover import (
    LinkState,
    ResultsStreamLink,
    Route,
    StepStreamLink,
    routes_of,
)
from cluster.transport.hop_choice import choose_hop, split_host_port
from cluster.transport.node_client import (
    RPC_TIMEOUT_S,
    NodeClient,
    NodeRequestError,
    NodeUnavailable,
    holds_shard,
)
from cluster.transport.step_link import StepLinkError
from cluster.transport.wire import results_from_proto, step_batch_bytes, step_batch_to_proto
from proto import cluster_pb2 as pb

log = logging.getLogger(__name__)

Link = TypeVar("Link")


@dataclass(frozen=True, slots=True)
class DriverLink:
    """One of a driver's links to a node: `role` "steps" (its step stream to the head),
    "results" (the node's results back to it) or "control" (its heartbeat and other unary
    calls); `state` None where a stream rides the node's gRPC channel (a node with no step
    port), which stays on the node's given address."""

    role: str
    client: NodeClient
    state: LinkState | None


class RemotePipeline:
    """`cluster.decode.pipeline.Pipeline` over node daemons (head first, tail last).

    `step_ports`: each node's TCP step port (`NodeInfo.step_port`, 0 where it serves none);
    the steps to the head and each node's results take them, and gRPC where a node has none,
    where the driver speaks TLS, or where a port does not answer. `step_records`: the head
    reads plain decode steps as records on that stream (`NodeInfo.step_records`,
    `cluster.transport.step_records`)."""

    def __init__(
        self,
        clients: list[NodeClient],
        *,
        max_context: int,
        heartbeat_s: float = 1.0,
        heartbeat_timeout_s: float = 2.0,
        epoch: int = 0,
        micro_batches: int = 1,
        step_ports: list[int] | None = None,
        step_records: bool = False,
        node_links: list[list[pb.NodeLink]] | None = None,
    ):
        self.clients = clients
        # Each node's addresses (`NodeInfo.links`): the TCP streams fail over among them.
        self.node_links = node_links or [[] for _ in clients]
        self.step_ports = step_ports or [0] * len(clients)
        self.step_records = step_records
        self.epoch = epoch  # LoadShardRequest.epoch of its shards; other epochs are ignored
        self.micro_batches = micro_batches  # the head's (LoadShardRequest.micro_batches)
        self._max_context = max_context
        self.heartbeat_s = heartbeat_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._pending: dict[str, deque[asyncio.Future[StepResult]]] = defaultdict(deque)
        self._sequence = itertools.count()
        self._outbox: asyncio.Queue[StepRequest] = asyncio.Queue()
        self._head_call: grpc.aio.StreamStreamCall | None = None
        self._head_link: StepStreamLink | None = None
        self._results_links: list[ResultsStreamLink | None] = []  # each node's; None: gRPC
        self._tasks: list[asyncio.Task] = []
        self._releases: set[asyncio.Task] = set()
        self.failure: NodeUnavailable | None = None
        self.messages_sent = 0
        self.records_sent = 0  # of messages_sent, those sent as step records
        # Told the ids of prefix snapshots a node no longer holds (cluster.decode.prefix_index).
        self.on_prefix_dropped: Callable[[list[int]], None] | None = None

    @property
    def max_context(self) -> int:
        return self._max_context

    @property
    def stages(self) -> int:
        return len(self.clients)

    @property
    def transports(self) -> dict[str, object]:
        """The streams in use: "tcp" or "grpc" for the steps and for each node's results."""
        return {
            "steps": "tcp" if self._head_link is not None else "grpc",
            "results": ["tcp" if link else "grpc" for link in self._results_links],
        }

    @property
    def link_states(self) -> list[LinkState]:
        """The driver's own TCP streams: to the head, and each node's results."""
        links = [self._head_link, *self._results_links]
        return [link.state for link in links if link is not None]

    def driver_links(self) -> list[DriverLink]:
        """Every link of the driver's to the nodes, for the status: the steps to the head,
        then per node its results and its control calls, in pipeline order."""
        head = self.clients[0]
        links = [DriverLink("steps", head, self._head_link.state if self._head_link else None)]
        for client, results in itertools.zip_longest(self.clients, self._results_links):
            links.append(DriverLink("results", client, results.state if results else None))
            links.append(DriverLink("control", client, client.link))
        return links

    async def start(self) -> None:
        head = self.clients[0]
        self._head_link = await self._open_link(
            head, self.step_ports[0], self.node_links[0], StepStreamLink.open, "coordinator -> "
        )
        if self._head_link is None:
            self._head_call = head.stub.Steps(metadata=head.metadata)
        calls = []
        try:
            for client, port, links in zip(
                self.clients, self.step_ports, self.node_links, strict=True
            ):
                opener = functools.partial(
                    ResultsStreamLink.open,
                    on_batch=functools.partial(self._on_results, client),
                    on_lost=functools.partial(self._results_closed, client),
                )
                link = await self._open_link(client, port, links, opener, "results ")
                self._results_links.append(link)
                if link is None:
                    call = client.stub.Results(pb.ResultsRequest(), metadata=client.metadata)
                    calls.append(call)
                    self._tasks.append(asyncio.create_task(self._listen(client, call)))
                self._tasks.append(asyncio.create_task(self._heartbeat(client)))
            self._tasks.append(asyncio.create_task(self._write_steps()))
            self._tasks.append(asyncio.create_task(self._watch_steps()))
            # A node answers Results once its subscription is in place; until then a result
            # that the tail publishes would be lost (and its request would wait forever). A
            # results link is subscribed once open.
            await asyncio.wait_for(
                asyncio.gather(*(call.wait_for_connection() for call in calls)), RPC_TIMEOUT_S
            )
        except BaseException:
            await self.close()
            raise

    @staticmethod
    async def _open_link(
        client: NodeClient,
        port: int,
        links: list[pb.NodeLink],
        open_link: Callable[..., Awaitable[Link]],
        name: str,
    ) -> Link | None:
        """`open_link(name, routes, node_id, token, tls, port)` to the node's TCP port over
        its addresses as measured from here, best first; None for gRPC."""
        if not port:
            return None
        host, grpc_port = split_host_port(client.address)
        routes: tuple[Route, ...] = (Route(host, grpc_port),)
        if links:
            choice = await choose_hop(
                client.address, links, client.node_id, client.token, client.tls
            )
            routes = routes_of(choice, links)
            client.order_routes(routes)  # its control calls fail over in the same order
        try:
            return await open_link(
                f"{name}{client.describe()}", routes, client.node_id, client.token, client.tls, port
            )
        except StepLinkError as error:  # a firewall, say: gRPC still works
            log.warning("%s; using gRPC for %s", error, client.describe())
            return None

    async def close(self) -> None:
        tasks = [*self._tasks, *self._releases]
        for task in tasks:
            task.cancel()
        if self._head_call is not None:
            self._head_call.cancel()
        for link in self._results_links:
            if link is not None:
                await link.close()
        if self._head_link is not None:
            await self._head_link.close()
        await asyncio.gather(*tasks, return_exceptions=True)
        for client in self.clients:
            await client.close()

    # -- Pipeline ---------------------------------------------------------------------------

    async def submit(self, step: StepRequest) -> StepResult:
        if self.failure is not None:
            raise self.failure
        future = asyncio.get_running_loop().create_future()
        self._pending[step.request_id].append(future)
        # One writer task owns the shared stream: a caller cancelled mid-write (a client that
        # hung up) must not cancel the stream that every request rides on.
        self._outbox.put_nowait(step)
        return await future

    async def release(self, request_id: str) -> None:
        for future in self._pending.pop(request_id, ()):
            future.cancel()
        releasing = asyncio.ensure_future(self._release(request_id))
        if self.failure is None:
            await releasing
        else:  # a silent node would hold the caller's error back until the release's deadline
            self._releases.add(releasing)
            releasing.add_done_callback(self._releases.discard)

    async def release_as_prefix(self, request_id: str, snapshot_id: int, positions: int) -> bool:
        """Release on every node, each keeping the first `positions` positions as the prefix
        snapshot `snapshot_id`; False (and dropped wherever kept) unless every node keeps it."""
        for future in self._pending.pop(request_id, ()):
            future.cancel()
        if self.failure is not None:
            await self.release(request_id)
            return False
        replies = await asyncio.gather(
            *(c.release_as_prefix(request_id, snapshot_id, positions) for c in self.clients),
            return_exceptions=True,
        )
        if all(reply is True for reply in replies):
            return True
        await self.drop_prefixes([snapshot_id])
        return False

    async def drop_prefixes(self, snapshot_ids: Iterable[int]) -> None:
        ids = list(snapshot_ids)
        results = await asyncio.gather(
            *(client.drop_prefix_snapshots(ids) for client in self.clients),
            return_exceptions=True,
        )
        for client, result in zip(self.clients, results, strict=True):
            if isinstance(result, Exception):
                log.debug("dropping prefix snapshots on %s failed: %s", client.describe(), result)

    async def _release(self, request_id: str) -> None:
        results = await asyncio.gather(
            *(client.release(request_id) for client in self.clients), return_exceptions=True
        )
        for client, result in zip(self.clients, results, strict=True):
            if isinstance(result, Exception):
                log.debug("release of %s on %s failed: %s", request_id, client.describe(), result)

    # -- streams and liveness ---------------------------------------------------------------

    async def _write_steps(self) -> None:
        try:
            while True:
                steps = [await self._outbox.get()]
                # The requests that one result batch woke submit their next steps in this turn
                # of the event loop: sent as one message they stay one batch on every node.
                # Sent one by one, the head starts on the first alone and the batch splits
                # into groups that never meet again (8 requests ran as steps of 1 to 4).
                await asyncio.sleep(0)
                while not self._outbox.empty():
                    steps.append(self._outbox.get_nowait())
                for group in self._groups(steps):
                    sequence = next(self._sequence)
                    if self._head_link is None:
                        await self._head_call.write(
                            step_batch_to_proto(group, None, sequence, self.epoch)
                        )
                    elif self.step_records and (
                        records := step_records.encode(group, None, sequence, self.epoch)
                    ):
                        await self._head_link.send(records, records=True)
                        self.records_sent += 1
                    else:
                        await self._head_link.send(
                            step_batch_bytes(group, None, sequence, self.epoch)
                        )
                    self.messages_sent += 1
        except (
            grpc.aio.AioRpcError,
            grpc.aio.UsageError,
            asyncio.InvalidStateError,
            StepLinkError,
            OSError,
        ) as error:
            self._fail_all(
                NodeUnavailable(f"node {self.clients[0].describe()} is unreachable: {error}")
            )

    def _groups(self, steps: list[StepRequest]) -> list[list[StepRequest]]:
        """`steps` (in submission order) as the messages to send: each holds at most one step
        of a request, and its decode steps at most the head's share of the live requests (as
        the head takes them: `node.stage.Stage._take`), so its micro-batches form here
        already; prompt chunks go in messages of their own, uncapped (`is_prompt_chunk`).
        Steps of requests released meanwhile are dropped."""
        share = max(1, -(-len(self._pending) // self.micro_batches))
        groups: list[list[StepRequest]] = []
        open_groups: dict[bool, tuple[list[StepRequest], set[str]]] = {}
        for step in steps:
            if step.request_id not in self._pending:
                continue
            chunk = is_prompt_chunk(step)
            group, ids = open_groups.get(chunk, (None, set()))
            if group is None or step.request_id in ids or (not chunk and len(group) == share):
                group, ids = [], set()
                groups.append(group)
                open_groups[chunk] = (group, ids)
            group.append(step)
            ids.add(step.request_id)
        return groups

    async def _watch_steps(self) -> None:
        """The head answers on the step stream only about messages it could not read; the
        stream ending means the head is gone."""
        if self._head_link is not None:  # a TCP step stream has no answers, only its end
            await self._head_link.ended()
            head = self.clients[0].describe()
            self.fail(NodeUnavailable(f"node {head}: {self._head_link.failure}"))
            return
        try:
            async for event in self._head_call:
                log.warning("head rejected step message %d", event.sequence)
            message = "closed the step stream"
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.CANCELLED:
                return
            message = f"is unreachable: {error.details()}"
        self._fail_all(NodeUnavailable(f"node {self.clients[0].describe()} {message}"))

    async def _listen(self, client: NodeClient, call: grpc.aio.UnaryStreamCall) -> None:
        try:
            async for batch in call:
                self._on_results(client, batch)
        except grpc.aio.AioRpcError as error:
            if error.code() != grpc.StatusCode.CANCELLED:
                self._fail_all(
                    NodeUnavailable(f"node {client.describe()} is unreachable: {error.details()}")
                )

    def _on_results(self, client: NodeClient, batch: pb.ResultBatch) -> None:
        if batch.epoch != self.epoch:
            return  # a late answer about another placement's steps
        results, errors = results_from_proto(batch)
        if batch.prefix_dropped and self.on_prefix_dropped is not None:
            self.on_prefix_dropped(list(batch.prefix_dropped))
        for result in results:
            self._resolve(result.request_id, result=result)
        for request_id, code, message in errors:
            error = NodeRequestError(f"node {client.describe()}: {message}", code)
            if code == grpc.StatusCode.UNAVAILABLE:
                error = NodeUnavailable(message)
            self._resolve(request_id, error=error)

    def _results_closed(self, client: NodeClient, why: str) -> None:
        self.fail(NodeUnavailable(f"node {client.describe()} {why}"))

    async def _heartbeat(self, client: NodeClient) -> None:
        """Fail the pipeline once the node answers on none of its addresses: the client
        moves its calls to the next address that answers when one stops (`NodeClient`)."""
        while True:
            await asyncio.sleep(self.heartbeat_s)
            try:
                await client.info(timeout=self.heartbeat_timeout_s)
            except (NodeUnavailable, grpc.aio.AioRpcError) as error:
                # Which link: the driver's control link to the node, which other nodes' links
                # to it do not share (a partition, or the node is gone); the error names each
                # address tried and why it failed.
                self.fail(
                    NodeUnavailable(
                        f"node {client.describe()} stopped answering on the coordinator's "
                        f"link to {client.link.current.host}: {error}"
                    )
                )
                return

    def _resolve(
        self, request_id: str, *, result: StepResult | None = None, error: Exception | None = None
    ) -> None:
        futures = self._pending.get(request_id)
        if not futures:
            return  # released already, or another driver's request
        if error is not None:
            for future in futures:
                if not future.done():
                    future.set_exception(error)
            del self._pending[request_id]
            return
        future = futures.popleft()
        if not futures:
            del self._pending[request_id]
        if not future.done():
            future.set_result(result)

    def fail(self, error: NodeUnavailable) -> None:
        """Declare the pipeline broken (a request met an unreachable node): every request in
        flight fails with `error`, and so does every later submission."""
        if self.failure is None:
            self._fail_all(error)

    def _fail_all(self, error: NodeUnavailable) -> None:
        log.warning("%s", error)
        self.failure = error
        pending, self._pending = self._pending, defaultdict(deque)
        for futures in pending.values():
            for future in futures:
                if not future.done():
                    future.set_exception(error)


@dataclass(frozen=True, slots=True)
class PipelineSettings:
    """How a driver loads and reaches a pipeline of node daemons; the same for every load.

    `token`: the cluster secret (required to talk to nodes). `ranges`: each node's half-open
    layer range, in pipeline order (None: an even split). `node_model_dir`: the model's path
    on the nodes (None: this machine's path). `dtype`: the weights' dtype on the nodes ("":
    as stored). `cache_budget_bytes` and `prefix_budget_bytes`: the nodes' request-cache and
    prefix-snapshot budgets (None: each node's own; a prefix budget is one for every node or
    one per node, in pipeline order). `model_digest` and `weights_port`: the
    driver's Weights service, from which a node lacking a verified copy of its shard's tensors
    fetches them first. `pinned_addresses`: successors whose given address is streamed to as
    is, without timing the others. `adopt`: keep the shards the nodes already hold when they
    form exactly this pipeline. `micro_batches`: the groups the head runs the live requests
    in (None: one per node; 1: one batch of all that is queued). `links`: use the nodes' TCP
    streams where they serve them (False: gRPC's). `warmup`: the warm-up the driver runs after
    the load, which the nodes build their kernels for while they load (None: none)."""

    token: str = field(repr=False)  # the cluster secret: kept out of logs
    tls: TLSConfig | None = None
    ranges: list[tuple[int, int]] | None = None
    node_model_dir: str | None = None
    dtype: str = ""
    cache_budget_bytes: int | None = None
    prefix_budget_bytes: int | tuple[int, ...] | None = None
    model_digest: str = ""
    weights_port: int = 0
    pinned_addresses: frozenset[str] = frozenset()
    adopt: bool = False
    micro_batches: int | None = None
    links: bool = True
    warmup: WarmupArgs | None = None


def warmup_to_proto(args: WarmupArgs) -> pb.WarmupPlan:
    auto = args.mtp_depth == "auto"
    return pb.WarmupPlan(
        prefill_chunk=args.prefill_chunk,
        max_running=args.max_running,
        max_context=args.max_context,
        mtp_depth=0 if auto else args.mtp_depth,
        mtp_depth_auto=auto,
        has_mtp=args.has_mtp,
    )


@dataclass
class RemoteEngine:
    """A generation engine over a remote pipeline; `close` ends the pipeline's streams."""

    engine: GenerationEngine
    pipeline: RemotePipeline

    async def close(self) -> None:
        await self.pipeline.close()


async def load_pipeline(
    model_dir: str | Path,
    addresses: list[str],
    settings: PipelineSettings,
    *,
    epoch: int = 0,
) -> RemotePipeline:
    """Load the shards on the nodes at `addresses` (head first) and open the streams; the
    pipeline returned serves steps of pipeline epoch `epoch`.

    Each node but the tail gets its successor's addresses, times a round trip to each and
    streams over the fastest, unless the successor's address is pinned. With `adopt`, when
    every node already holds exactly its shard, of one pipeline epoch (a restarted driver),
    no LoadShard is sent and the pipeline runs in that epoch instead; requests a previous
    driver left on the nodes are freed by their idle sweep. Raises ValueError for a missing
    token or ranges that do not cover the model, NodeUnavailable for a node that does not
    answer."""
    s = settings
    if not s.token:
        raise ValueError("a cluster token is needed to talk to nodes (--token or CLUSTER_TOKEN)")
    config = load_model_config(model_dir)
    ranges = s.ranges or even_ranges(config.num_layers, len(addresses))
    if len(ranges) != len(addresses):
        raise ValueError(f"{len(ranges)} layer ranges for {len(addresses)} nodes")
    specs = shard_specs(ranges)
    if specs[-1].end != config.num_layers or specs[0].start != 0:
        raise ValueError(f"layer ranges must cover [0, {config.num_layers})")
    prefix_budgets = s.prefix_budget_bytes
    if not isinstance(prefix_budgets, tuple):
        prefix_budgets = (prefix_budgets,) * len(addresses)
    elif len(prefix_budgets) != len(addresses):
        raise ValueError(f"{len(prefix_budgets)} prefix budgets for {len(addresses)} nodes")
    clients = [NodeClient(address, s.token, s.tls) for address in addresses]
    groups = len(addresses) if s.micro_batches is None else s.micro_batches
    try:
        infos = await asyncio.gather(*(c.info() for c in clients))
        requests = []
        for i, spec in enumerate(specs):
            request = pb.LoadShardRequest(
                model_dir=str(s.node_model_dir or Path(model_dir).resolve()),
                start=spec.start,
                end=spec.end,
                is_head=spec.is_head,
                is_tail=spec.is_tail,
                dtype=s.dtype,
                next_node=addresses[i + 1] if i + 1 < len(addresses) else "",
                model_id=Path(model_dir).name,
                model_digest=s.model_digest,
                weights_port=s.weights_port,
                epoch=epoch,
                micro_batches=groups,
            )
            if i + 1 < len(addresses):
                request.next_node_id = infos[i + 1].node_id
                if addresses[i + 1] not in s.pinned_addresses:
                    request.next_node_links.extend(infos[i + 1].links)
            if s.cache_budget_bytes is not None:
                request.cache_budget_bytes = s.cache_budget_bytes
            if s.warmup is not None:
                request.warmup.CopyFrom(warmup_to_proto(s.warmup))
            if prefix_budgets[i] is not None:
                request.prefix_budget_bytes = prefix_budgets[i]
            requests.append(request)
        held_epochs = {info.epoch for info in infos}
        if s.adopt and len(held_epochs) == 1 and all(map(holds_shard, infos, requests)):
            # The whole pipeline is there, of one placement: serve it in that placement's
            # epoch (a partial adoption would mix epochs, which the nodes refuse).
            epoch = held_epochs.pop()
            log.info("every node already holds its shard (epoch %d): adopted", epoch)
        else:
            await asyncio.gather(*(c.load_shard(r) for c, r in zip(clients, requests, strict=True)))
    except BaseException:
        for client in clients:
            await client.close()
        raise
    pipeline = RemotePipeline(
        clients,
        max_context=config.max_context,
        epoch=epoch,
        micro_batches=groups,
        step_ports=[info.step_port for info in infos] if s.links else None,
        step_records=s.links and infos[0].step_records,
        node_links=[list(info.links) for info in infos],
    )
    await pipeline.start()
    return pipeline


async def open_remote_engine(
    model_dir: str | Path,
    addresses: list[str],
    settings: PipelineSettings,
    *,
    prefill_chunk: int = 512,
) -> RemoteEngine:
    """`load_pipeline` with a generation engine over it (prompts prefilled `prefill_chunk`
    positions at a time)."""
    pipeline = await load_pipeline(model_dir, addresses, settings)
    return RemoteEngine(GenerationEngine(pipeline, prefill_chunk=prefill_chunk), pipeline)
