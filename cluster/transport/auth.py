"""The cluster secret on every node RPC, and TLS when the cluster wants it.

Nothing that can load weights or run a forward pass is open to anyone on the network: each
call carries the secret in its metadata and the server compares it in constant time before
the handler runs.
"""

from __future__ import annotations

import hmac
import ssl
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc

from cluster.transport.wire import grpc_channel_options

TOKEN_HEADER = "x-cluster-token"


def token_metadata(token: str) -> tuple[tuple[str, str], ...]:
    return ((TOKEN_HEADER, token),)


class TokenInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, token: str):
        if not token:
            raise ValueError("a node needs a non-empty cluster token")
        self._token = token.encode()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        given = dict(details.invocation_metadata or ()).get(TOKEN_HEADER, "")
        if hmac.compare_digest(given.encode(), self._token):
            return handler
        return _refusal(handler)


def _refusal(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that only refuses the call."""

    async def refuse(_request: object, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong cluster token")

    if handler is None:
        return None
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse)
    return grpc.unary_unary_rpc_method_handler(refuse)


@dataclass(frozen=True, slots=True)
class TLSConfig:
    """TLS with one cluster certificate: nodes serve with it (certificate + key) and every
    peer (driver, coordinator, the previous node) trusts exactly it. Its subject alternative
    names must cover the addresses the nodes are dialled at."""

    cert: bytes
    key: bytes | None = None  # nodes only

    @classmethod
    def from_files(cls, cert: str | Path | None, key: str | Path | None = None) -> TLSConfig | None:
        if cert is None:
            if key is not None:
                raise ValueError("a TLS key needs its certificate (--tls-cert)")
            return None
        return cls(Path(cert).read_bytes(), Path(key).read_bytes() if key else None)

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self._node_key(), self.cert)])

    def server_context(self) -> ssl.SSLContext:
        """A node's side of its TLS step and results streams: the cluster certificate."""
        key = self._node_key()
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        # The ssl module loads a key from a file only: one of this user's alone (mkdtemp's
        # folder is 0700), gone once loaded.
        with tempfile.TemporaryDirectory() as folder:
            cert_file, key_file = Path(folder, "cluster.pem"), Path(folder, "cluster.key")
            cert_file.write_bytes(self.cert)
            key_file.write_bytes(key)
            context.load_cert_chain(cert_file, key_file)
        return context

    def client_context(self) -> ssl.SSLContext:
        """A peer's side: trusts exactly the cluster certificate, whose names must cover the
        address dialled (checked, as gRPC checks it)."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.load_verify_locations(cadata=self.cert.decode("ascii"))
        return context

    def _node_key(self) -> bytes:
        if self.key is None:
            raise ValueError("a node serving TLS needs the certificate's key (--tls-key)")
        return self.key


def client_context(tls: TLSConfig | None) -> ssl.SSLContext | None:
    """What a TCP stream to a node dials with: TLS where the cluster uses it."""
    return None if tls is None else tls.client_context()


def open_channel(
    address: str, tls: TLSConfig | None, *, own_connection: bool = False
) -> grpc.aio.Channel:
    """A channel to a node: TLS when the cluster uses it, plain otherwise. `own_connection`:
    never over a connection that another channel to the address holds (gRPC shares them),
    which a lost path may have left stuck: what it reaches, it reaches now."""
    options = grpc_channel_options()
    if own_connection:
        options.append(("grpc.use_local_subchannel_pool", 1))
    if tls is None:
        return grpc.aio.insecure_channel(address, options=options)
    credentials = grpc.ssl_channel_credentials(root_certificates=tls.cert)
    return grpc.aio.secure_channel(address, credentials, options=options)
