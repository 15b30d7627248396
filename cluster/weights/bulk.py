"""The weights service's fetch over a plain TCP stream: the chunks sent from the page cache.

A Python gRPC stream copies each byte several times across the two processes: that, not the
network, bounds a transfer at a fraction of a local file copy's speed. Here the coordinator hands
each chunk to the kernel with `sendfile` (no copy in user space) and the node receives it with
one `recv_into` into the buffer that it then hashes and writes. The request and
every check are the gRPC fetch's (`WeightsSource.pieces`): the same `WeightsFetchRequest`, the
same refusals, the same progress; the node asks for the port by the manifest RPC and falls back
to gRPC where there is none. A TLS cluster has none: its weights go over the encrypted service.

The stream, in both directions little-endian:

    node:        MAGIC, u32 token length, token, u32 request length, WeightsFetchRequest
    coordinator: per answered chunk or file: u64 length, its bytes
                 on a refusal, at any point: u64 REFUSED, u32 length, the message (UTF-8)

The node knows how many messages its request asks for; the coordinator closes after the last.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import socket
import socketserver
import struct
import threading
from collections.abc import Iterator

from google.protobuf.message import DecodeError

from cluster.weights.source import WeightsRefusal, WeightsSource
from proto import cluster_pb2 as pb

log = logging.getLogger(__name__)

MAGIC = b"CWB1"
REFUSED = 2**64 - 1  # a length no message has
LENGTH = struct.Struct("<Q")
SMALL_LENGTH = struct.Struct("<I")
MAX_TOKEN_BYTES = 4096
MAX_REQUEST_BYTES = 64 * 2**20  # as the gRPC service's largest message
CONNECT_TIMEOUT_S = 10.0
IDLE_TIMEOUT_S = 60.0  # a peer silent this long is gone (either side)


class BulkRefused(RuntimeError):
    """The coordinator refused the fetch (its message says why), or a peer broke the protocol."""


class BulkUnreachable(ConnectionError):
    """No connection to the bulk port (a firewall, say): the gRPC stream still may work."""


# ---- the coordinator's side ----


class BulkServer:
    """Serves `source`'s fetches beside the gRPC service, one thread per node stream, from
    construction until `close`."""

    def __init__(self, source: WeightsSource, host: str = "0.0.0.0", port: int = 0):
        server_class = _ServerV6 if ":" in host else _Server
        self._server = server_class((host, port), _BulkHandler)
        self._server.source = source
        self.port: int = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="weights-bulk", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True  # a stream in progress does not hold the coordinator's exit
    allow_reuse_address = True
    source: WeightsSource


class _ServerV6(_Server):
    address_family = socket.AF_INET6


class _BulkHandler(socketserver.BaseRequestHandler):
    server: _Server

    def handle(self) -> None:
        source = self.server.source
        sock: socket.socket = self.request
        sock.settimeout(IDLE_TIMEOUT_S)
        host, port = self.client_address[:2]
        peer = f"{host}:{port}"
        try:
            token, request = _read_hello(sock)
            source.authorize(token)
            with contextlib.closing(source.pieces(request, peer)) as pieces:
                for piece in pieces:
                    sock.sendall(LENGTH.pack(piece.size))
                    if piece.data is not None:
                        sock.sendall(piece.data)
                    else:  # from the page cache to the socket, no copy here
                        with os.fdopen(os.dup(piece.fd), "rb") as file:
                            sent = sock.sendfile(file, piece.offset, piece.length)
                        if sent != piece.length:  # the file shrank: the node sees the stream end
                            raise ConnectionAbortedError(f"sent {sent} of {piece.length} bytes")
        except WeightsRefusal as refusal:
            _send_refusal(sock, str(refusal))
        except BulkRefused as error:  # a malformed hello
            _send_refusal(sock, str(error))
        except OSError as error:  # the node went away, or stopped reading
            log.info("weights bulk stream to %s ended: %s", peer, error)


def _read_hello(sock: socket.socket) -> tuple[str, pb.WeightsFetchRequest]:
    if _recv_exact(sock, len(MAGIC)) != MAGIC:
        raise BulkRefused("not a weights bulk stream (bad magic)")
    token = _recv_exact(sock, _small_length(sock, MAX_TOKEN_BYTES, "token"))
    raw = _recv_exact(sock, _small_length(sock, MAX_REQUEST_BYTES, "request"))
    try:
        return token.decode(errors="replace"), pb.WeightsFetchRequest.FromString(raw)
    except DecodeError as error:
        raise BulkRefused(f"malformed WeightsFetchRequest: {error}") from None


def _small_length(sock: socket.socket, limit: int, what: str) -> int:
    (n,) = SMALL_LENGTH.unpack(_recv_exact(sock, SMALL_LENGTH.size))
    if n > limit:
        raise BulkRefused(f"{what} of {n} bytes exceeds {limit}")
    return n


def _send_refusal(sock: socket.socket, message: str) -> None:
    data = message.encode()
    with contextlib.suppress(OSError):  # the node is gone: nobody to tell
        sock.sendall(LENGTH.pack(REFUSED) + SMALL_LENGTH.pack(len(data)) + data)


# ---- the node's side ----


class ReceiveBuffers:
    """Chunk-sized buffers that the node's streams receive into, each handed back (`give`)
    once its chunk is verified and written. A fresh buffer per chunk would cost the node a
    zeroed page per 4 KiB of every chunk, about as much CPU as hashing it."""

    def __init__(self, size: int, keep: int):
        self.size = size
        self.keep = keep  # buffers held for reuse at most: the chunks a transfer has in flight
        self._free: queue.SimpleQueue[bytearray] = queue.SimpleQueue()

    def take(self, n: int) -> memoryview:
        """A writable view of n bytes, of a buffer nobody else uses until it is given back."""
        if n > self.size:
            return memoryview(bytearray(n))
        try:
            buffer = self._free.get_nowait()
        except queue.Empty:
            buffer = bytearray(self.size)
        return memoryview(buffer)[:n]

    def give(self, view: memoryview) -> None:
        """Hand back the buffer under `view` (from `take`); the caller is done with it."""
        buffer = view.obj
        ours = isinstance(buffer, bytearray) and len(buffer) == self.size
        if ours and self._free.qsize() < self.keep:
            self._free.put(buffer)


def fetch_pieces(
    address: tuple[str, int],
    token: str,
    request: pb.WeightsFetchRequest,
    buffers: ReceiveBuffers | None = None,
) -> Iterator[memoryview]:
    """The answers to `request`, in its order, each a view of its own buffer (taken from
    `buffers` where given, for the caller to give back); `BulkRefused` with the coordinator's
    message if it refuses, `BulkUnreachable` if it cannot connect, another `OSError` if the
    stream breaks."""
    expected = len(request.chunks) + len(request.files)
    hello = request.SerializeToString()
    secret = token.encode()
    try:
        sock = socket.create_connection(address, timeout=CONNECT_TIMEOUT_S)
    except OSError as error:
        raise BulkUnreachable(f"cannot connect to {address[0]}:{address[1]}: {error}") from None
    with sock:
        sock.settimeout(IDLE_TIMEOUT_S)
        sock.sendall(b"".join((
            MAGIC, SMALL_LENGTH.pack(len(secret)), secret, SMALL_LENGTH.pack(len(hello)), hello
        )))  # fmt: skip
        for _ in range(expected):
            (n,) = LENGTH.unpack(_recv_exact(sock, LENGTH.size))
            if n == REFUSED:
                _raise_refusal(sock)
            view = buffers.take(n) if buffers is not None else memoryview(bytearray(n))
            _recv_into(sock, view)
            yield view
        # The coordinator closes after the last answer, or refuses (a refusal of a request
        # asking for nothing comes here too).
        end = sock.recv(LENGTH.size, socket.MSG_WAITALL)
        if end == LENGTH.pack(REFUSED):
            _raise_refusal(sock)
        if end:
            raise BulkRefused("the coordinator sent more than was asked for")


def _raise_refusal(sock: socket.socket) -> None:
    (size,) = SMALL_LENGTH.unpack(_recv_exact(sock, SMALL_LENGTH.size))
    raise BulkRefused(_recv_exact(sock, size).decode(errors="replace"))


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buffer = bytearray(n)
    _recv_into(sock, buffer)
    return bytes(buffer)


def _recv_into(sock: socket.socket, buffer: bytearray | memoryview) -> None:
    view, got = memoryview(buffer), 0
    while got < len(buffer):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError(f"the stream closed after {got} of {len(buffer)} bytes")
        got += n
