"""A node's side of a transfer: fetch exactly the chunks of its shard it lacks, verified.

`ensure_shard` returns a model directory holding a verified copy of the shard's tensors: the
directory the coordinator named when it is on this machine and is the same model (by content),
or else the node's cache, after fetching what is missing there. Every chunk is hashed as it
arrives (in a pool beside the receiving thread; BLAKE3 and pwrite release the GIL) and written
only if it matches the manifest; a chunk that does not is asked for again (a few rounds), and a
shard is returned only when every one of its chunks is verified, so nothing unverified is ever
loaded.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from cluster.model.loading import shard_tensor_names
from cluster.model.shard import ShardSpec
from cluster.transport.auth import TLSConfig, token_metadata
from cluster.weights import bulk
from cluster.weights.manifest import Manifest, ManifestError, manifest_for
from cluster.weights.service import (
    FETCH_METHOD,
    MANIFEST_METHOD,
    decode_chunk,
    weights_grpc_options,
)
from cluster.weights.store import CachedModel, ChunkRef, WeightsStore
from proto import cluster_pb2 as pb

log = logging.getLogger(__name__)

# Parallel streams per transfer: each takes about a core (receive, hash, write); on a 2-core
# machine a second stream only competes with the sending side for the same cores.
STREAMS = max(1, min(4, (os.cpu_count() or 2) // 2))
AHEAD = 2  # chunks per stream received but not yet verified and written
ROUNDS = 3  # a chunk failing its hash this many times in a row fails the load
MANIFEST_TIMEOUT_S = 60.0
# A stream's deadline: generous for its bytes (a dead peer is caught sooner by keepalive).
STREAM_DEADLINE_BASE_S = 600.0
STREAM_DEADLINE_MIN_RATE = 2 * 2**20  # bytes/s
CRASH_AFTER_ENV = "CLUSTER_TEST_WEIGHTS_CRASH_AFTER_BYTES"  # test hook: die mid-transfer


class WeightsFetchError(RuntimeError):
    """A transfer that could not complete (names the chunk or the peer's error)."""


@dataclass(slots=True)
class FetchProgress:
    """What a transfer has verified so far (read by the node's Info)."""

    total_bytes: int = 0
    verified_bytes: int = 0  # fetched and verified in this transfer
    received_bytes: int = 0  # every message byte received, overhead included
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, verified: int, received: int) -> None:
        with self.lock:
            self.verified_bytes += verified
            self.received_bytes += received


def local_copy_matches(model_dir: Path, digest: str) -> bool:
    """True when `model_dir` exists here and holds the model named `digest`."""
    if not (model_dir / "config.json").is_file():
        return False
    try:
        return manifest_for(model_dir).digest == digest
    except (ManifestError, OSError) as error:
        log.info("%s is not usable as the model: %s", model_dir, error)
        return False


class ShardFetcher:
    """Fetches one shard of one model from a Weights service into a store."""

    def __init__(
        self,
        address: str,
        token: str,
        *,
        node_id: str,
        tls: TLSConfig | None = None,
        streams: int = STREAMS,
        progress: FetchProgress | None = None,
        bulk_stream: bool = True,
    ):
        self.address = address
        self.token = token
        self.metadata = token_metadata(token)
        self.node_id = node_id
        # The service's plain TCP stream (`cluster.weights.bulk`) where it has one: asked for
        # once, on the first fetch; never under TLS (the bytes then stay encrypted).
        self._ask_bulk_port = bulk_stream and tls is None
        self._bulk_address: tuple[str, int] | None = None
        self._bulk_lock = threading.Lock()
        self.streams = streams
        self.progress = progress or FetchProgress()
        # One connection per stream: each has its own transport, so the streams' receiving,
        # hashing and writing spread over cores instead of queueing on one socket.
        self.channels = [_open_channel(address, tls) for _ in range(max(1, streams))]
        self._manifest_call = self.channels[0].unary_unary(
            MANIFEST_METHOD,
            request_serializer=pb.WeightsManifestRequest.SerializeToString,
            response_deserializer=pb.WeightsManifestReply.FromString,
        )
        self._fetch_calls = [
            channel.unary_stream(
                FETCH_METHOD,
                request_serializer=pb.WeightsFetchRequest.SerializeToString,
                response_deserializer=decode_chunk,
            )
            for channel in self.channels
        ]
        self._crash_after = int(os.environ.get(CRASH_AFTER_ENV, "0") or 0)

    @property
    def bulk_address(self) -> tuple[str, int] | None:
        """Where this fetcher's streams go over plain TCP (None: gRPC, or not asked yet)."""
        return self._bulk_address

    def close(self) -> None:
        for channel in self.channels:
            channel.close()

    def manifest(self, digest: str) -> Manifest:
        try:
            reply = self._manifest_call(
                pb.WeightsManifestRequest(model_digest=digest),
                timeout=MANIFEST_TIMEOUT_S,
                metadata=self.metadata,
            )
        except grpc.RpcError as error:
            raise WeightsFetchError(
                f"cannot get the manifest from {self.address}: {error.details()}"
            ) from None
        self._note_bulk_port(reply.bulk_port)
        return Manifest.from_json(reply.manifest_json, expect_digest=digest)

    def _note_bulk_port(self, port: int) -> None:
        if self._ask_bulk_port and port:
            host = self.address.rpartition(":")[0].strip("[]")
            self._bulk_address = (host, port)
        self._ask_bulk_port = False

    def _bulk_target(self, digest: str) -> tuple[str, int] | None:
        """Where the bulk stream listens, asking the service the first time (None: gRPC)."""
        with self._bulk_lock:
            if self._ask_bulk_port:
                try:
                    reply = self._manifest_call(
                        pb.WeightsManifestRequest(model_digest=digest, omit_manifest=True),
                        timeout=MANIFEST_TIMEOUT_S,
                        metadata=self.metadata,
                    )
                    self._note_bulk_port(reply.bulk_port)
                except grpc.RpcError:
                    self._ask_bulk_port = False  # the gRPC fetch will name the error
            return self._bulk_address

    def fetch_shard(self, store: WeightsStore, manifest: Manifest, spec: ShardSpec) -> Path:
        """Make `store` hold a verified copy of the shard; return its model directory."""
        cached = store.model(manifest)
        try:
            missing_files = cached.missing_small_files()
            if missing_files:
                self._fetch_files(cached, spec, missing_files)
            tensors = sorted(shard_tensor_names(cached.path, spec))
            missing = cached.missing_chunks(tensors)  # a verified read of what is there
            if missing:
                need = sum(_chunk_len(manifest, ref) for ref in missing)
                store.make_room(need, keep=manifest.digest)
                self.progress.total_bytes = need
                log.info(
                    "fetching %d chunk(s), %.1f MiB of %s from %s",
                    len(missing),
                    need / 2**20,
                    spec.describe(),
                    self.address,
                )
            for _ in range(ROUNDS):
                if not missing:
                    cached.touch()
                    return cached.path
                missing = self._fetch_chunks(cached, spec, missing)
            raise WeightsFetchError(
                f"{len(missing)} chunk(s) of {spec.describe()} kept failing verification after "
                f"{ROUNDS} tries (first: {missing[0][0]} #{missing[0][1]}); the coordinator's "
                "copy differs from its manifest?"
            )
        finally:
            cached.close()

    # -- streams ----------------------------------------------------------------------------

    def _request(self, manifest_digest: str, spec: ShardSpec, total: int) -> pb.WeightsFetchRequest:
        return pb.WeightsFetchRequest(
            model_digest=manifest_digest,
            node_id=self.node_id,
            start=spec.start,
            end=spec.end,
            is_head=spec.is_head,
            is_tail=spec.is_tail,
            total_bytes=total,
        )

    def _fetch_files(self, cached: CachedModel, spec: ShardSpec, names: list[str]) -> None:
        request = self._request(cached.manifest.digest, spec, 0)
        request.files.extend(names)
        for name, data in zip(names, self._stream(0, request), strict=True):
            cached.write_small_file(name, data)
            self.progress.add(0, len(data.obj))

    def _fetch_chunks(
        self, cached: CachedModel, spec: ShardSpec, missing: list[ChunkRef]
    ) -> list[ChunkRef]:
        """One round over `missing`; returns the chunks still missing (failed their hash).

        Each stream's thread only receives; hashing and writing run in a pool (BLAKE3 and
        pwrite release the GIL), at most AHEAD chunks behind per stream, so receiving the next
        chunk overlaps verifying the last one and memory stays a few chunks per stream."""
        parts = _split(missing, cached.manifest, self.streams)
        failed: list[ChunkRef] = []
        # Each stream has at most AHEAD chunks waiting, one being verified, one arriving.
        buffers = bulk.ReceiveBuffers(cached.manifest.chunk_bytes, len(parts) * (AHEAD + 2))

        def verify_and_write(ref: ChunkRef, data: memoryview) -> None:
            # A gRPC message's bytes, protocol included; a bulk stream's chunk is all it sent.
            received = len(data.obj) if isinstance(data.obj, bytes) else len(data)
            try:
                if not cached.chunk_hash_ok(ref, data):
                    log.warning("chunk %s #%d failed its hash; it will be fetched again", *ref)
                    failed.append(ref)
                    self.progress.add(0, received)
                    return
                cached.write_chunk(ref, data)
            finally:
                buffers.give(data)
            self.progress.add(len(data), received)
            self._maybe_crash()

        def run(stream: int, part: list[ChunkRef], workers: ThreadPoolExecutor) -> None:
            request = self._request(cached.manifest.digest, spec, self.progress.total_bytes)
            request.chunks.extend(pb.WeightsChunkRef(tensor=t, chunk=i) for t, i in part)
            pending: deque[Future] = deque()
            received = 0
            try:
                nbytes = sum(_chunk_len(cached.manifest, ref) for ref in part)
                pieces = self._stream(stream, request, nbytes, buffers)
                for ref, data in zip(part, pieces, strict=False):
                    pending.append(workers.submit(verify_and_write, ref, data))
                    received += 1
                    while len(pending) > AHEAD:
                        pending.popleft().result()
            finally:
                for future in pending:
                    future.result()
            failed.extend(part[received:])  # a stream that ended early

        with (
            ThreadPoolExecutor(len(parts), thread_name_prefix="fetch") as streams,
            ThreadPoolExecutor(len(parts) * AHEAD, thread_name_prefix="verify") as workers,
        ):
            futures = [streams.submit(run, i, part, workers) for i, part in enumerate(parts)]
            for future in futures:
                future.result()
        return failed

    def _stream(
        self,
        stream: int,
        request: pb.WeightsFetchRequest,
        nbytes: int = 0,
        buffers: bulk.ReceiveBuffers | None = None,
    ):
        bulk_address = self._bulk_target(request.model_digest)
        if bulk_address is not None:
            host, port = bulk_address
            try:
                yield from bulk.fetch_pieces(bulk_address, self.token, request, buffers)
                return
            except bulk.BulkUnreachable as error:  # before any answer: gRPC from now on
                log.warning("%s; fetching over the weights service's gRPC stream", error)
                self._bulk_address = None
            except (bulk.BulkRefused, OSError) as error:
                raise WeightsFetchError(
                    f"weights transfer from {host}:{port} failed: {error}"
                ) from None
        try:
            call = self._fetch_calls[stream]
            timeout = STREAM_DEADLINE_BASE_S + nbytes / STREAM_DEADLINE_MIN_RATE
            yield from call(request, timeout=timeout, metadata=self.metadata)
        except grpc.RpcError as error:
            raise WeightsFetchError(
                f"weights transfer from {self.address} failed: {error.details()}"
            ) from None

    def _maybe_crash(self) -> None:
        if self._crash_after and self.progress.verified_bytes >= self._crash_after:
            log.error("test hook: dying mid-transfer after %d bytes", self.progress.verified_bytes)
            os._exit(137)


def _open_channel(address: str, tls: TLSConfig | None) -> grpc.Channel:
    options = [*weights_grpc_options(), ("grpc.use_local_subchannel_pool", 1)]
    if tls is None:
        return grpc.insecure_channel(address, options=options)
    credentials = grpc.ssl_channel_credentials(root_certificates=tls.cert)
    return grpc.secure_channel(address, credentials, options=options)


def _chunk_len(manifest: Manifest, ref: ChunkRef) -> int:
    return manifest.tensors[ref[0]].chunk_range(ref[1], manifest.chunk_bytes)[1]


def _split(refs: list[ChunkRef], manifest: Manifest, parts: int) -> list[list[ChunkRef]]:
    """Up to `parts` lists of about equal bytes, each in file order (largest first greedy)."""
    bins: list[tuple[int, list[ChunkRef]]] = [(0, []) for _ in range(max(1, parts))]
    for ref in sorted(refs, key=lambda r: -_chunk_len(manifest, r)):
        i = min(range(len(bins)), key=lambda k: bins[k][0])
        bins[i] = (bins[i][0] + _chunk_len(manifest, ref), [*bins[i][1], ref])
    order = {ref: n for n, ref in enumerate(refs)}
    return [sorted(b, key=order.__getitem__) for _, b in bins if b]


@dataclass(frozen=True, slots=True)
class WeightsEndpoint:
    """Where a node fetches weights from: the Weights service at `address` (None: none
    named), asked with the cluster `token` (and `tls` when the cluster uses TLS) on behalf
    of the node `node_id`."""

    address: str | None
    token: str
    node_id: str
    tls: TLSConfig | None = None


def ensure_shard(
    *,
    digest: str,
    spec: ShardSpec,
    store: WeightsStore,
    source: WeightsEndpoint,
    local_dir: Path | None = None,
    progress: FetchProgress | None = None,
    on_manifest: Callable[[Manifest], None] | None = None,
) -> Path:
    """A directory with a verified copy of the shard: `local_dir` if it is the same model,
    else the cache (fetching only what it lacks from `source`). Raises WeightsFetchError
    when the model is in neither and `source` names no service."""
    if local_dir is not None and local_copy_matches(local_dir, digest):
        return local_dir
    manifest = store.cached_manifest(digest)
    address = source.address
    if address is None:
        if manifest is None:
            raise WeightsFetchError(
                f"model {digest} is neither at {local_dir} nor in the cache {store.root}, "
                "and no weights service was named"
            )
        address = "unreachable:0"  # only used if something is missing: fails with that name
    fetcher = ShardFetcher(
        address, source.token, node_id=source.node_id, tls=source.tls, progress=progress
    )
    try:
        if manifest is None:
            manifest = fetcher.manifest(digest)
        if on_manifest is not None:
            on_manifest(manifest)
        return fetcher.fetch_shard(store, manifest, spec)
    finally:
        fetcher.close()
