"""What the weights service's two transports share: one model directory's chunks as a peer may
ask for them.

`WeightsSource` checks a peer's token and request and yields the messages that answer it; the
gRPC service (`cluster.weights.service`) and the plain TCP stream (`cluster.weights.bulk`) only
carry them. What a peer can name is a tensor or small file of the manifest, and only tensors of
the shard it declares: never a path. A file whose size or mtime changed since the manifest was
made ends the stream with FAILED_PRECONDITION (the node then sees a clear error, and its hashes
would refuse the bytes anyway). Every refusal is a `WeightsRefusal` with the gRPC status it
answers, and each transport sends its message.
"""

from __future__ import annotations

import dataclasses
import hmac
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from cluster.model.loading import shard_tensor_names
from cluster.model.shard import ShardSpec
from cluster.weights.manifest import Manifest, ManifestError, manifest_for, snapshot_of
from proto import cluster_pb2 as pb

# ---- progress, per node ----


@dataclass(slots=True)
class Transfer:
    """What one node's fetch has been sent so far, over all of its streams."""

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


# ---- what a peer is answered ----


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


class WeightsSource:
    """One model directory's manifest, chunks and small files, served to peers that hold the
    cluster token. Safe to use from many threads at once (one per stream)."""

    def __init__(self, model_dir: Path, token: str, manifest: Manifest | None = None):
        if not token:
            raise ValueError("the weights service needs a non-empty cluster token")
        self.model_dir = Path(model_dir)
        self.manifest = manifest or manifest_for(self.model_dir)
        self.snapshot = snapshot_of(self.model_dir)
        self.transfers = Transfers()
        # Test hook: may alter a chunk's bytes on their way out (a flipped byte on the wire).
        self.tamper: Callable[[tuple[str, int], bytes], bytes] | None = None
        self._token = token.encode()
        self._shards: dict[tuple[int, int, bool, bool], frozenset[str]] = {}
        self._lock = threading.Lock()

    def authorize(self, token: str) -> None:
        """Return if `token` is the cluster token (compared in constant time), else refuse."""
        if not hmac.compare_digest(token.encode(), self._token):
            raise WeightsRefusal(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong cluster token")

    def check_digest(self, digest: str) -> None:
        """Refuse a request for another model; an empty `digest` asks for whichever is served."""
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
