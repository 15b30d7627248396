"""The cluster secret on every node RPC.

Nothing that can load weights or run a forward pass is open to anyone on the network: each
call carries the secret in its metadata and the server compares it in constant time before
the handler runs.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

import grpc

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
