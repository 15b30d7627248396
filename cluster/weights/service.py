"""The coordinator's Weights service: a node streams exactly the chunks of its shard it lacks.

A synchronous gRPC server in its own threads (the coordinator's event loop never touches weight
bytes): each stream runs in a pool thread that reads one chunk with `os.pread` (no Python-side
buffering, the GIL released) and hands it to gRPC, which sends it before the next is read, so a
stream holds about one chunk in memory and a node's transfer holds one per stream, whatever the
model's size. Each chunk a node asks for is read once for it.

What a peer can name is a tensor or small file of the manifest, and only tensors of the shard it
declares: never a path. A file whose size or mtime changed since the manifest was made ends the
stream with FAILED_PRECONDITION (the node then sees a clear error, and its hashes would refuse
the bytes anyway).

The chunk messages skip the protobuf library on the hot path: `encode_chunk` writes the exact
wire form of `WeightsChunk{data}` and `decode_chunk` returns a view of the payload inside the
received message (the tests check both against protobuf's own codec).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hmac
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

from cluster.model.loading import shard_tensor_names
from cluster.model.shard import ShardSpec
from cluster.transport.auth import TOKEN_HEADER, TLSConfig
from cluster.transport.wire import varint
from cluster.weights.manifest import Manifest, ManifestError, manifest_for, snapshot_of
from proto import cluster_pb2 as pb

if TYPE_CHECKING:
    from cluster.weights.bulk import BulkServer

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


# ---- progress, per node ----


@dataclass(slots=True)
class Transfer:
    node_id: str
    total_bytes: int
    sent_bytes: int = 0
    started: float = field(default_factory=time.monotonic)
    updated: float = field(default_factory=time.monotonic)
    streams_open: int = 0
    error: str = ""

    @property
    def fraction(self) -> float:
        return min(1.0, self.sent_bytes / self.total_bytes) if self.total_bytes else 1.0

    @property
    def done(self) -> bool:
        return self.streams_open == 0


class Transfers:
    """What the service has sent to each node (the progress bars read it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_node: dict[str, Transfer] = {}

    def open(self, node_id: str, total_bytes: int) -> Transfer:
        with self._lock:
            transfer = self._by_node.get(node_id)
            # The streams of one transfer open together; a finished record is a new transfer.
            if transfer is None or (
                transfer.done
                and (transfer.total_bytes != total_bytes or time.monotonic() - transfer.updated > 1)
            ):
                transfer = self._by_node[node_id] = Transfer(node_id, total_bytes)
            transfer.streams_open += 1
            return transfer

    def close(self, transfer: Transfer, error: str = "") -> None:
        with self._lock:
            transfer.streams_open -= 1
            transfer.error = error or transfer.error

    def sent(self, transfer: Transfer, nbytes: int) -> None:
        with self._lock:
            transfer.sent_bytes += nbytes
            transfer.updated = time.monotonic()

    def snapshot(self) -> list[Transfer]:
        with self._lock:
            return [dataclasses.replace(t) for t in self._by_node.values()]


# ---- the service ----


class WeightsRefusal(Exception):
    """What the service refuses a peer, with the gRPC status it answers (the bulk stream sends
    the same message)."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, slots=True)
class Piece:
    """One message of a fetch: `length` bytes of the open file `fd` at `offset`, or `data`."""

    fd: int = -1
    offset: int = 0
    length: int = 0
    data: bytes | None = None

    @property
    def size(self) -> int:
        return self.length if self.data is None else len(self.data)

    def read(self) -> bytes:
        if self.data is not None:
            return self.data
        data = os.pread(self.fd, self.length, self.offset)
        if len(data) != self.length:
            raise WeightsRefusal(
                grpc.StatusCode.FAILED_PRECONDITION, "a model file is shorter than it was"
            )
        return data


class WeightsService:
    """Serves one model directory's manifest and chunks to the cluster's nodes, over gRPC and,
    without TLS, over a plain TCP stream as well (`cluster.weights.bulk`)."""

    def __init__(self, model_dir: Path, token: str, manifest: Manifest | None = None):
        if not token:
            raise ValueError("the weights service needs a non-empty cluster token")
        self.model_dir = Path(model_dir)
        self.manifest = manifest or manifest_for(self.model_dir)
        self.snapshot = snapshot_of(self.model_dir)
        self.transfers = Transfers()
        self.bulk_port = 0  # set by `serve_weights` when it runs the bulk stream
        # Test hook: may alter a chunk's bytes on their way out (a flipped byte on the wire).
        self.tamper: Callable[[tuple[str, int], bytes], bytes] | None = None
        self._token = token.encode()
        self._shards: dict[tuple[int, int, bool, bool], frozenset[str]] = {}
        self._lock = threading.Lock()

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

    # -- what both transports share ---------------------------------------------------------

    def authorize(self, token: str) -> None:
        if not hmac.compare_digest(token.encode(), self._token):
            raise WeightsRefusal(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong cluster token")

    def check_digest(self, digest: str) -> None:
        if digest and digest != self.manifest.digest:
            raise WeightsRefusal(
                grpc.StatusCode.NOT_FOUND,
                f"this coordinator serves model {self.manifest.digest} "
                f"({self.manifest.name}), not {digest}",
            )

    def pieces(self, request: pb.WeightsFetchRequest, peer: str) -> Iterator[Piece]:
        """The messages answering `request`, in its order, after every check (each refusal
        a `WeightsRefusal`); counted in `transfers` as they go."""
        self.check_digest(request.model_digest)
        plan = self._plan(request)
        transfer = self.transfers.open(request.node_id or peer, request.total_bytes)
        error = ""
        fds: dict[str, int] = {}
        try:
            for kind, name, offset, length, ref in plan:
                if kind == "chunk":
                    piece = Piece(self._open_checked(fds, name), offset, length)
                    if self.tamper is not None:
                        piece = Piece(data=self.tamper(ref, piece.read()))
                else:
                    piece = Piece(data=(self.model_dir / name).read_bytes())
                self.transfers.sent(transfer, piece.size)
                yield piece
        except Exception as exc:
            error = str(exc)
            raise
        finally:
            for fd in fds.values():
                os.close(fd)
            self.transfers.close(transfer, error)

    # -- helpers ----------------------------------------------------------------------------

    def _allowed(self, spec: ShardSpec) -> frozenset[str]:
        key = (spec.start, spec.end, spec.is_head, spec.is_tail)
        with self._lock:
            if key not in self._shards:
                self._shards[key] = frozenset(shard_tensor_names(self.model_dir, spec))
            return self._shards[key]

    def _plan(
        self, request: pb.WeightsFetchRequest
    ) -> list[tuple[str, str, int, int, tuple[str, int]]]:
        """(kind, file, offset, length, chunk ref) per message, after every check."""
        try:
            spec = ShardSpec(request.start, request.end, request.is_head, request.is_tail)
            allowed = self._allowed(spec)
        except (ValueError, ManifestError) as error:
            raise WeightsRefusal(grpc.StatusCode.INVALID_ARGUMENT, f"bad shard: {error}") from None
        plan = []
        cb = self.manifest.chunk_bytes
        for ref in request.chunks:
            entry = self.manifest.tensors.get(ref.tensor)
            if entry is None:
                raise WeightsRefusal(
                    grpc.StatusCode.NOT_FOUND, f"no tensor {ref.tensor!r} in the model"
                )
            if ref.tensor not in allowed:
                raise WeightsRefusal(
                    grpc.StatusCode.PERMISSION_DENIED,
                    f"tensor {ref.tensor!r} is not part of shard {spec.describe()}",
                )
            if ref.chunk >= len(entry.chunk_hashes):
                raise WeightsRefusal(
                    grpc.StatusCode.OUT_OF_RANGE, f"tensor {ref.tensor!r} has no chunk {ref.chunk}"
                )
            offset, length = entry.chunk_range(ref.chunk, cb)
            plan.append(("chunk", entry.file, offset, length, (ref.tensor, ref.chunk)))
        for name in request.files:
            if name not in self.manifest.small_files:
                raise WeightsRefusal(
                    grpc.StatusCode.PERMISSION_DENIED,
                    f"{name!r} is not a file this service serves (only the manifest's small files)",
                )
            plan.append(("file", name, 0, 0, ("", 0)))
        return plan

    def _open_checked(self, fds: dict[str, int], name: str) -> int:
        """`name`'s descriptor, once its size and mtime are still those of the manifest."""
        fd = fds.get(name)
        if fd is None:
            fd = fds[name] = os.open(self.model_dir / name, os.O_RDONLY)
        st = os.fstat(fd)
        if [st.st_size, st.st_mtime_ns] != self.snapshot.get(name):
            raise WeightsRefusal(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"the coordinator's model directory changed during the transfer ({name} was "
                "modified); restart the coordinator to serve the new model",
            )
        return fd

    def handler(self) -> grpc.GenericRpcHandler:
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
        from cluster.weights.bulk import BulkServer

        bulk_server = BulkServer(service, host)
        service.bulk_port = bulk_server.port
    log.info(
        "weights service for %s on port %d (bulk stream: %s)",
        service.manifest.name,
        bound,
        service.bulk_port or "off",
    )
    return WeightsServer(server, bulk_server), bound
