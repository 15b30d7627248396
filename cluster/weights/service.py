"""The coordinator's Weights service: a node streams exactly the chunks of its shard it lacks.

A synchronous gRPC server in its own threads (the coordinator's event loop never touches weight
bytes): each stream runs in a pool thread that reads one chunk with `os.pread` (no Python-side
buffering, the GIL released) and hands it to gRPC, which sends it before the next is read, so a
stream holds about one chunk in memory and a node's transfer holds one per stream, whatever the
model's size. Each chunk a node asks for is read once for it.

Every check of a token and a request, and every read, is `cluster.weights.source`'s, shared with
the plain TCP stream (`cluster.weights.bulk`); this module carries their answers over gRPC, and
`serve_weights` runs both.

The chunk messages skip the protobuf library on the hot path: `encode_chunk` writes the exact
wire form of `WeightsChunk{data}` and `decode_chunk` returns a view of the payload inside the
received message (the tests check both against protobuf's own codec).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from cluster.transport.auth import TOKEN_HEADER, TLSConfig
from cluster.transport.wire import varint
from cluster.weights.bulk import BulkServer
from cluster.weights.manifest import Manifest
from cluster.weights.source import WeightsRefusal, WeightsSource
from proto import cluster_pb2 as pb

log = logging.getLogger(__name__)

SERVICE = "cluster.v1.Weights"
MANIFEST_METHOD = f"/{SERVICE}/WeightsManifest"
FETCH_METHOD = f"/{SERVICE}/WeightsFetch"
STREAM_THREADS = 32


def weights_grpc_options() -> list[tuple[str, int]]:
    """Channel and server arguments of the weights streams (both ends)."""
    return [
        ("grpc.max_send_message_length", 64 * 2**20),
        ("grpc.max_receive_message_length", 64 * 2**20),
        # Bigger HTTP/2 frames and socket reads: fewer trips through the transport per chunk.
        ("grpc.http2.max_frame_size", 4 * 2**20),
        ("grpc.experimental.tcp_read_chunk_size", 4 * 2**20),
        ("grpc.experimental.tcp_min_read_chunk_size", 4 * 2**20),
        ("grpc.experimental.tcp_max_read_chunk_size", 16 * 2**20),
        ("grpc.default_compression_algorithm", 0),
        ("grpc.enable_retries", 0),
        ("grpc.keepalive_time_ms", 10_000),
        ("grpc.keepalive_timeout_ms", 5_000),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
        ("grpc.http2.max_ping_strikes", 0),
    ]


# ---- the chunk message, without protobuf's copies ----


def encode_chunk(data: bytes) -> bytes:
    """The wire form of `WeightsChunk(data=data)` (field 1, length-delimited)."""
    if not data:
        return b""  # proto3 leaves an empty field out
    return b"".join((b"\x0a", varint(len(data)), data))


def decode_chunk(raw: bytes) -> memoryview:
    """The payload of a serialized `WeightsChunk`, as a view into `raw` (no copy)."""
    view = memoryview(raw)
    if not raw:
        return view
    if raw[0] != 0x0A:
        raise ValueError("not a WeightsChunk message")
    n = shift = 0
    pos = 1
    while True:
        byte = raw[pos]
        n |= (byte & 0x7F) << shift
        pos += 1
        shift += 7
        if not byte & 0x80:
            break
    if pos + n != len(raw):
        raise ValueError("WeightsChunk length does not match the message")
    return view[pos:]


# ---- the service ----


class WeightsService(WeightsSource):
    """Serves one model directory's manifest and chunks to the cluster's nodes, over gRPC and,
    without TLS, over a plain TCP stream as well (`cluster.weights.bulk`)."""

    def __init__(self, model_dir: Path, token: str, manifest: Manifest | None = None):
        super().__init__(model_dir, token, manifest)
        self.bulk_port = 0  # set by `serve_weights` when it runs the bulk stream

    # -- RPCs -------------------------------------------------------------------------------

    def manifest_rpc(
        self, request: pb.WeightsManifestRequest, context: grpc.ServicerContext
    ) -> pb.WeightsManifestReply:
        with _answered(context):
            self.authorize(_token_of(context))
            self.check_digest(request.model_digest)
        if request.omit_manifest:
            return pb.WeightsManifestReply(bulk_port=self.bulk_port)
        return pb.WeightsManifestReply(
            manifest_json=self.manifest.to_json(), bulk_port=self.bulk_port
        )

    def fetch_rpc(
        self, request: pb.WeightsFetchRequest, context: grpc.ServicerContext
    ) -> Iterator[bytes]:
        with _answered(context):
            self.authorize(_token_of(context))
            for piece in self.pieces(request, context.peer()):
                yield piece.read()

    def handler(self) -> grpc.GenericRpcHandler:
        """The `cluster.v1.Weights` service's methods, for a gRPC server to add."""
        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "WeightsManifest": grpc.unary_unary_rpc_method_handler(
                    self.manifest_rpc,
                    request_deserializer=pb.WeightsManifestRequest.FromString,
                    response_serializer=pb.WeightsManifestReply.SerializeToString,
                ),
                "WeightsFetch": grpc.unary_stream_rpc_method_handler(
                    self.fetch_rpc,
                    request_deserializer=pb.WeightsFetchRequest.FromString,
                    response_serializer=encode_chunk,
                ),
            },
        )


def _token_of(context: grpc.ServicerContext) -> str:
    return dict(context.invocation_metadata()).get(TOKEN_HEADER, "")


@contextlib.contextmanager
def _answered(context: grpc.ServicerContext) -> Iterator[None]:
    """A `WeightsRefusal` inside ends the RPC with its status and message."""
    try:
        yield
    except WeightsRefusal as refusal:
        context.abort(refusal.code, str(refusal))


class WeightsServer:
    """The running service: its gRPC server and, without TLS, its bulk stream."""

    def __init__(self, grpc_server: grpc.Server, bulk: BulkServer | None):
        self.grpc_server = grpc_server
        self.bulk = bulk

    def stop(self, grace: float | None = None) -> None:
        if self.bulk is not None:
            self.bulk.close()
        self.grpc_server.stop(grace)


def serve_weights(
    service: WeightsService,
    host: str = "0.0.0.0",
    port: int = 0,
    tls: TLSConfig | None = None,
    *,
    bulk: bool = True,
) -> tuple[WeightsServer, int]:
    """Start the service in its own threads; returns (server, bound gRPC port). Without TLS
    (and unless `bulk` is False) the bulk stream listens too, on a port of its own that the
    manifest RPC names."""
    server = grpc.server(
        ThreadPoolExecutor(STREAM_THREADS, thread_name_prefix="weights"),
        options=[*weights_grpc_options(), ("grpc.so_reuseport", 0)],
        maximum_concurrent_rpcs=STREAM_THREADS,
    )
    server.add_generic_rpc_handlers((service.handler(),))
    address = f"{host}:{port}"
    if tls is not None and tls.key is not None:
        bound = server.add_secure_port(address, tls.server_credentials())
    else:
        bound = server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"cannot listen on {address} for the weights service")
    server.start()
    bulk_server = None
    if bulk and tls is None:
        bulk_server = BulkServer(service, host)
        service.bulk_port = bulk_server.port
    log.info(
        "weights service for %s on port %d (bulk stream: %s)",
        service.manifest.name,
        bound,
        service.bulk_port or "off",
    )
    return WeightsServer(server, bulk_server), bound
