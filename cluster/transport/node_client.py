"""Unary calls from a driver to one node daemon, and the errors a node's failure raises.

`NodeClient` speaks the node's Info, LoadShard, Release and Rollback RPCs with the cluster
token and a deadline. Its calls run over the node's address it was given until that address
stops answering; then over the first of the node's other addresses (`NodeInfo.links`, at the
same port, in the order a driver measured them) that answers a LinkPing, and back to the given
address once that answers again. Only when no address answers does a call raise
`NodeUnavailable`, naming each address and why it failed. The pipeline over several nodes'
streams is `cluster.decode.remote_pipeline`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable
from typing import Any

import grpc

from cluster.messages import RequestError
from cluster.transport import failover
from cluster.transport.auth import TLSConfig, open_channel, token_metadata
from cluster.transport.failover import LinkState, Route, answers
from cluster.transport.hop_choice import split_host_port
from cluster.transport.links import KINDS
from proto import cluster_pb2 as pb
from proto import cluster_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

RPC_TIMEOUT_S = 5.0
LOAD_TIMEOUT_S = 900.0
# A load that may fetch the shard's weights first (tens of GB over a slow link); a dead peer
# still surfaces within seconds through the channels' keepalive.
FETCHING_LOAD_TIMEOUT_S = 12 * 3600.0
# What says an address is gone, rather than the node refusing the call.
UNREACHABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


class NodeUnavailable(ConnectionError):
    """A node that cannot be reached or stopped answering (the message names it)."""


class NodeRequestError(RequestError):
    """A node's refusal of one request; `code` is the gRPC status the node gave it."""

    def __init__(self, message: str, code: grpc.StatusCode):
        super().__init__(message)
        self.code = code


class NodeClient:
    """Unary calls to one node, each with the cluster token and a deadline, over the first of
    the node's addresses that answers (`link`: where they run now and how they moved).

    `channel` and `stub` stay on the address given: the driver's gRPC streams ride on them,
    and the unary calls too until that address fails. A call that is safe to repeat (Info,
    Release, DropPrefixSnapshots) is sent again over the address the client moved to; one
    that is not (LoadShard, Rollback: the node may have acted on it before its answer was
    lost) raises NodeUnavailable, and only later calls take the new address."""

    def __init__(self, address: str, token: str, tls: TLSConfig | None = None):
        self.address = address
        self.token = token
        self.tls = tls
        self.metadata = token_metadata(token)
        self.channel = open_channel(address, tls)
        self.stub = pb_grpc.NodeStub(self.channel)
        self.node_id = address  # until Info says otherwise
        host, port = split_host_port(address)
        given = Route(host, port)
        self.link = LinkState(f"control link to {address}", (given,), given)
        self._stub = self.stub  # the current address's
        self._channel = self.channel
        self._moving = asyncio.Lock()
        self._measured = False  # the other addresses' order came from a measurement
        self._failback: asyncio.Task | None = None
        self._failback_tried = 0.0
        # Channels of addresses left: each closes once its calls end (or with the client).
        self._retired: dict[grpc.aio.Channel, asyncio.Task] = {}
        self._closed = False

    def describe(self) -> str:
        return self.address if self.node_id == self.address else f"{self.node_id} ({self.address})"

    def use_links(self, links: Iterable[pb.NodeLink]) -> None:
        """Know the node's other addresses (`NodeInfo.links`): after the given one, the
        fastest kind of link first; loopback ones never (from here they may be another
        machine's). Kept as they are once a measurement ordered them (`order_routes`)."""
        host, port = split_host_port(self.address)
        others: dict[str, Route] = {}
        given = Route(host, port)
        for link in links:
            if link.address == host:
                given = Route(host, port, link.kind, link.interface)
            elif link.kind != "loopback" and link.address not in others:
                others[link.address] = Route(link.address, port, link.kind, link.interface)
        if self._measured and {r.host for r in self.link.routes[1:]} == set(others):
            return
        rank = {kind: i for i, kind in enumerate(KINDS)}
        ordered = sorted(others.values(), key=lambda route: rank.get(route.kind, len(KINDS)))
        self._measured = False
        self._set_routes((given, *ordered))

    def order_routes(self, measured: Iterable[Route]) -> None:
        """Try the node's other addresses in the order a measurement ranked them (best
        first; `failover.routes_of`), after the given one, which stays where calls go first:
        it is the node's name in the cluster, and where the gRPC streams run."""
        host, port = split_host_port(self.address)
        given = next((r for r in self.link.routes if r.host == host), Route(host, port))
        others = []
        for route in measured:
            if route.host == host:
                given = Route(host, port, route.kind, route.interface, route.rtt_ms)
            else:
                others.append(Route(route.host, port, route.kind, route.interface, route.rtt_ms))
        self._measured = True
        self._set_routes((given, *others))

    def _set_routes(self, routes: tuple[Route, ...]) -> None:
        current = self.link.current.address
        self.link.routes = routes
        self.link.current = next((r for r in routes if r.address == current), routes[0])

    async def info(self, timeout: float = RPC_TIMEOUT_S) -> pb.NodeInfo:
        info = await self._call("Info", pb.InfoRequest(), timeout)
        if info.node_id != self.node_id:
            self.node_id = info.node_id
            self.link.name = f"control link to {self.describe()}"
        self.use_links(info.links)
        return info

    async def load_shard(self, request: pb.LoadShardRequest) -> pb.NodeInfo:
        timeout = FETCHING_LOAD_TIMEOUT_S if request.model_digest else LOAD_TIMEOUT_S
        return await self._call("LoadShard", request, timeout, resend=False)

    async def release(self, request_id: str) -> bool:
        reply = await self._call("Release", pb.ReleaseRequest(request_id=request_id))
        return reply.released

    async def release_as_prefix(self, request_id: str, snapshot_id: int, positions: int) -> bool:
        """Release, keeping the first `positions` positions as a prefix snapshot; whether the
        node keeps it."""
        request = pb.ReleaseRequest(
            request_id=request_id, prefix_save=snapshot_id, prefix_positions=positions
        )
        reply = await self._call("Release", request)
        return reply.prefix_saved

    async def drop_prefix_snapshots(self, snapshot_ids: list[int]) -> int:
        request = pb.PrefixSnapshotDropRequest(snapshot_ids=snapshot_ids)
        return (await self._call("DropPrefixSnapshots", request)).dropped

    async def rollback(self, request_id: str, drop: int) -> int:
        request = pb.RollbackRequest(request_id=request_id, drop=drop)
        reply = await self._call("Rollback", request, resend=False)
        return reply.position

    async def _call(
        self, rpc: str, request: Any, timeout: float = RPC_TIMEOUT_S, *, resend: bool = True
    ) -> Any:
        """`rpc` over the current address; where that is gone, over the next that answers
        (sent again only when `resend`). NodeUnavailable when no address answers."""
        route = self.link.current
        try:
            return await self._send(rpc, request, timeout)
        except grpc.aio.AioRpcError as error:
            if error.code() not in UNREACHABLE or self._closed:
                raise
            failure = f"{_named(route)}: {error.details() or error.code().name}"
        moved = await self._move_from(route, failure)
        if not resend:
            raise NodeUnavailable(
                f"node {self.describe()} did not answer {rpc} over {failure}; not sent again "
                f"(the node may have acted on it); later calls go over {_named(moved)}"
            )
        try:
            return await self._send(rpc, request, timeout)
        except grpc.aio.AioRpcError as error:
            if error.code() not in UNREACHABLE or self._closed:
                raise
            why = f"{_named(moved)}: {error.details() or error.code().name}"
            raise NodeUnavailable(
                f"node {self.describe()} is unreachable: {failure}; {why}"
            ) from None

    async def _send(self, rpc: str, request: Any, timeout: float) -> Any:
        reply = await getattr(self._stub, rpc)(request, timeout=timeout, metadata=self.metadata)
        self._answered()
        return reply

    async def _move_from(self, failed: Route, failure: str) -> Route:
        """The address calls go over now that `failed` did not answer (`failure`: how): the
        current one where another call moved already, else the first of the others that
        answers a LinkPing; NodeUnavailable, naming each address, where none does."""
        async with self._moving:
            if self.link.current.address != failed.address:
                return self.link.current
            others = [route for route in self.link.routes if route.address != failed.address]
            if not others:  # the only address known
                self.link.failed = f"node {self.describe()} is unreachable: {failure}"
                raise NodeUnavailable(self.link.failed)
            node_id = "" if self.node_id == self.address else self.node_id
            answered = await asyncio.gather(
                *(answers(route, node_id, self.token, self.tls) for route in others)
            )
            for route, ok in zip(others, answered, strict=True):
                if ok:
                    self._switch(route, failure)
                    return route
            silent = "; ".join(
                f"{_named(route)}: no answer to a LinkPing in {failover.PING_TIMEOUT_S:.1f} s"
                for route in others
            )
            self.link.failed = f"no address of node {self.describe()} answers: {failure}; {silent}"
            raise NodeUnavailable(self.link.failed)

    def _switch(self, route: Route, reason: str = "", *, back: bool = False) -> None:
        """Send later calls over `route`, on a channel of its own: one left over from an
        earlier turn there may still hold a connection that the lost path left stuck."""
        link, previous = self.link, self.link.current
        old = self._channel
        self._channel = open_channel(route.address, self.tls, own_connection=True)
        self._stub = pb_grpc.NodeStub(self._channel)
        link.current, link.moved_at, link.failed = route, time.time(), ""
        if old is not self.channel:  # the given address's channel carries the streams
            # Closed once the calls on it end (a late one may still succeed there).
            closing = asyncio.ensure_future(old.close(grace=FETCHING_LOAD_TIMEOUT_S))
            self._retired[old] = closing
            closing.add_done_callback(lambda _: self._retired.pop(old, None))
        if back:
            link.failbacks += 1
            log.warning("%s: back to %s", link.name, _named(route))
        else:
            link.failovers += 1
            link.last_reason = reason
            log.warning(
                "%s: moved from %s to %s (%s)",
                link.name,
                _named(previous),
                _named(route),
                reason,
            )

    def _answered(self) -> None:
        """After a call that was answered: while calls run off the given address, look now
        and then, in the background, whether it answers again."""
        self.link.failed = ""
        if not self.link.degraded or self._closed:
            return
        if self._failback is not None and not self._failback.done():
            return
        now = time.monotonic()
        if now - self._failback_tried < failover.FAILBACK_EVERY_S:
            return
        self._failback_tried = now
        self._failback = asyncio.ensure_future(self._fail_back())

    async def _fail_back(self) -> None:
        best = self.link.routes[0]
        node_id = "" if self.node_id == self.address else self.node_id
        try:
            if not await answers(best, node_id, self.token, self.tls):
                return
        except Exception:  # a failback that fails leaves the calls where they run
            log.exception("%s: pinging %s", self.link.name, _named(best))
            return
        async with self._moving:
            if self.link.degraded and not self._closed:
                self._switch(best, back=True)

    async def close(self) -> None:
        self._closed = True
        if self._failback is not None:
            self._failback.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._failback
        for channel, closing in list(self._retired.items()):
            closing.cancel()
            await channel.close()
        if self._channel is not self.channel:
            await self._channel.close()
        await self.channel.close()


def _named(route: Route) -> str:
    """An address as errors and logs name it: host:port, and the link under it where known."""
    how = ", ".join(filter(None, (route.kind, route.interface)))
    return f"{route.address} ({how})" if how else route.address


def holds_shard(info: pb.NodeInfo, request: pb.LoadShardRequest) -> bool:
    """Whether the node already serves exactly what `request` would load (a restarted
    driver adopts it instead of reloading its weights)."""
    if not info.HasField("shard"):
        return False
    shard = info.shard
    return (
        (shard.model_id, shard.model_dir, shard.start, shard.end, shard.dtype)
        == (request.model_id, request.model_dir, request.start, request.end, request.dtype)
        and (shard.is_head, shard.is_tail) == (request.is_head, request.is_tail)
        and (shard.next_node, shard.next_node_id) == (request.next_node, request.next_node_id)
        and shard.next_node_pinned == (not request.next_node_links)
        and not request.HasField("cache_budget_bytes")
        and (
            not request.HasField("prefix_budget_bytes")
            or info.prefix_budget_bytes == request.prefix_budget_bytes
        )
    )
