"""Unary calls from a driver to one node daemon, and the errors a node's failure raises.

`NodeClient` speaks the node's Info, LoadShard, Release and Rollback RPCs with the cluster
token and a deadline; a node that cannot be reached raises `NodeUnavailable`, naming it. The
pipeline over several nodes' streams is `cluster.decode.remote_pipeline`.
"""

from __future__ import annotations

import grpc

from cluster.messages import RequestError
from cluster.transport.auth import TLSConfig, open_channel, token_metadata
from proto import cluster_pb2 as pb
from proto import cluster_pb2_grpc as pb_grpc

RPC_TIMEOUT_S = 5.0
LOAD_TIMEOUT_S = 900.0
# A load that may fetch the shard's weights first (tens of GB over a slow link); a dead peer
# still surfaces within seconds through the channels' keepalive.
FETCHING_LOAD_TIMEOUT_S = 12 * 3600.0


class NodeUnavailable(ConnectionError):
    """A node that cannot be reached or stopped answering (the message names it)."""


class NodeRequestError(RequestError):
    """A node's refusal of one request; `code` is the gRPC status the node gave it."""

    def __init__(self, message: str, code: grpc.StatusCode):
        super().__init__(message)
        self.code = code


class NodeClient:
    """Unary calls to one node, each with the cluster token and a deadline."""

    def __init__(self, address: str, token: str, tls: TLSConfig | None = None):
        self.address = address
        self.token = token
        self.tls = tls
        self.metadata = token_metadata(token)
        self.channel = open_channel(address, tls)
        self.stub = pb_grpc.NodeStub(self.channel)
        self.node_id = address  # until Info says otherwise

    def describe(self) -> str:
        return self.address if self.node_id == self.address else f"{self.node_id} ({self.address})"

    async def info(self, timeout: float = RPC_TIMEOUT_S) -> pb.NodeInfo:
        info = await self._call(self.stub.Info, pb.InfoRequest(), timeout)
        self.node_id = info.node_id
        return info

    async def load_shard(self, request: pb.LoadShardRequest) -> pb.NodeInfo:
        timeout = FETCHING_LOAD_TIMEOUT_S if request.model_digest else LOAD_TIMEOUT_S
        return await self._call(self.stub.LoadShard, request, timeout)

    async def release(self, request_id: str) -> bool:
        reply = await self._call(self.stub.Release, pb.ReleaseRequest(request_id=request_id))
        return reply.released

    async def release_as_prefix(self, request_id: str, snapshot_id: int, positions: int) -> bool:
        """Release, keeping the first `positions` positions as a prefix snapshot; whether the
        node keeps it."""
        request = pb.ReleaseRequest(
            request_id=request_id, prefix_save=snapshot_id, prefix_positions=positions
        )
        reply = await self._call(self.stub.Release, request)
        return reply.prefix_saved

    async def drop_prefix_snapshots(self, snapshot_ids: list[int]) -> int:
        request = pb.PrefixSnapshotDropRequest(snapshot_ids=snapshot_ids)
        return (await self._call(self.stub.DropPrefixSnapshots, request)).dropped

    async def rollback(self, request_id: str, drop: int) -> int:
        reply = await self._call(
            self.stub.Rollback, pb.RollbackRequest(request_id=request_id, drop=drop)
        )
        return reply.position

    async def _call(self, method, request, timeout: float = RPC_TIMEOUT_S):
        try:
            return await method(request, timeout=timeout, metadata=self.metadata)
        except grpc.aio.AioRpcError as error:
            if error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise NodeUnavailable(
                    f"node {self.describe()} is unreachable: {error.details()}"
                ) from None
            raise

    async def close(self) -> None:
        await self.channel.close()


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
