"""Where a node's LoadShard finds its weights: the path it was given, or its cache, filled
from the coordinator's Weights service when the request names the model by content."""

from __future__ import annotations

import asyncio
import logging
import threading
from pathlib import Path

import grpc

from cluster.model.shard import ShardSpec
from cluster.transport.auth import TLSConfig
from cluster.weights.fetch import FetchProgress, WeightsEndpoint, WeightsFetchError, ensure_shard
from cluster.weights.manifest import ManifestError
from cluster.weights.store import CacheFullError, WeightsStore
from proto import cluster_pb2 as pb

log = logging.getLogger(__name__)


class ShardWeightsError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


def peer_host(peer: str) -> str:
    """The host part of a gRPC peer string ("ipv4:10.0.0.2:5123", "ipv6:[::1]:5123")."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv6":
        return rest.rsplit(":", 1)[0]  # keeps the brackets, as host:port wants
    if kind == "ipv4":
        return rest.rsplit(":", 1)[0]
    raise ShardWeightsError(
        grpc.StatusCode.INVALID_ARGUMENT,
        f"cannot tell the weights service's host from peer {peer!r}; give weights_address",
    )


class ShardWeights:
    """The node's weights cache and its current transfer."""

    def __init__(self, store: WeightsStore, *, token: str, node_id: str, tls: TLSConfig | None):
        self.store = store
        self.token = token
        self.node_id = node_id
        self.tls = tls
        self.progress: FetchProgress | None = None
        # A LoadShard cancelled mid-transfer (its caller gave up) leaves its thread fetching;
        # the next one waits for it rather than fetching the same chunks beside it.
        self._fetching = threading.Lock()
        self.cached = store.models()  # for Info; listed again after each transfer

    async def model_dir(self, request: pb.LoadShardRequest, peer: str) -> Path:
        """The directory to load the shard from (after any transfer it takes)."""
        given = Path(request.model_dir) if request.model_dir else None
        if not request.model_digest:
            if given is None:
                raise ShardWeightsError(
                    grpc.StatusCode.INVALID_ARGUMENT, "LoadShard names neither a path nor a model"
                )
            return given
        source = request.weights_address or (
            f"{peer_host(peer)}:{request.weights_port}" if request.weights_port else None
        )
        spec = ShardSpec(request.start, request.end, request.is_head, request.is_tail)
        progress = FetchProgress()

        def fetch(**kwargs) -> Path:
            with self._fetching:
                self.progress = progress
                try:
                    return ensure_shard(**kwargs)
                finally:
                    self.cached = self.store.models()

        try:
            return await asyncio.to_thread(
                fetch,
                digest=request.model_digest,
                spec=spec,
                store=self.store,
                source=WeightsEndpoint(source, self.token, self.node_id, self.tls),
                local_dir=given,
                progress=progress,
            )
        except CacheFullError as error:
            raise ShardWeightsError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(error)) from None
        except (WeightsFetchError, ManifestError) as error:
            raise ShardWeightsError(grpc.StatusCode.FAILED_PRECONDITION, str(error)) from None

    def fill_info(self, info: pb.NodeInfo) -> None:
        if self.progress is not None:
            info.weights_fetched_bytes = self.progress.verified_bytes
            info.weights_fetch_total_bytes = self.progress.total_bytes
            info.weights_received_bytes = self.progress.received_bytes
        info.cached_models.extend(
            pb.WeightsCachedModel(
                digest=m.digest,
                name=m.name,
                disk_bytes=m.disk_bytes,
                model_bytes=m.model_bytes,
                present_bytes=m.present_bytes,
                last_used=m.last_used,
            )
            for m in self.cached
        )
