"""API keys: who may use the HTTP endpoint.

With keys configured, every `/v1` route needs `Authorization: Bearer KEY`; the monitoring
routes (the dashboard's data at /api/cluster, /metrics, /health) need it too unless they are
left open on purpose. The dashboard's page and its static files hold no data and stay open,
so that a browser can load it and then send the key with its requests. Keys are compared in
constant time, each against every configured key, so that timing reveals neither a key's
prefix nor which key matched.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from coordinator.openai_schema import ApiError

API_KEY_ENV = "CLUSTER_API_KEY"
MONITORING_PATHS = frozenset({"/api/cluster", "/metrics", "/health"})
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True, slots=True)
class ApiKeys:
    """The accepted keys; none means the endpoint is open (loopback use)."""

    keys: tuple[bytes, ...] = ()
    open_monitoring: bool = False  # leave /api/cluster, /metrics and /health without a key

    @classmethod
    def of(cls, keys: Iterable[str], *, open_monitoring: bool = False) -> ApiKeys:
        encoded = []
        for key in keys:
            if not key or key != key.strip():
                raise ValueError("an API key must be non-empty, without surrounding spaces")
            encoded.append(key.encode())
        return cls(tuple(encoded), open_monitoring)

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def guards(self, path: str) -> bool:
        """Whether a request for `path` must carry a key."""
        if not self.keys:
            return False
        if path == "/v1" or path.startswith("/v1/"):
            return True
        return path in MONITORING_PATHS and not self.open_monitoring

    def accepts(self, authorization: str | None) -> bool:
        """Whether an `Authorization` header carries one of the keys (constant time)."""
        scheme, _, presented = (authorization or "").partition(" ")
        if scheme.lower() != "bearer":
            return False
        candidate = presented.strip().encode()
        matched = False
        for key in self.keys:  # no early exit: every key costs the same comparison
            matched |= hmac.compare_digest(candidate, key)
        return matched


def read_api_keys(key: str | None, key_file: Path | None) -> list[str]:
    """The keys from `--api-key` and from a file (one key a line; blank and # lines skipped)."""
    keys = [key] if key else []
    if key_file is not None:
        for line in key_file.read_text().splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                keys.append(line)
        if len(keys) == (1 if key else 0):
            raise ValueError(f"{key_file} holds no API key")
    return keys


def api_key_middleware(keys: ApiKeys) -> Callable[[web.Request, _Handler], Awaitable]:
    """Refuse a guarded route without a valid key: 401 with an OpenAI error body."""

    @web.middleware
    async def require_api_key(request: web.Request, handler: _Handler) -> web.StreamResponse:
        if keys.guards(request.path):
            header = request.headers.get("Authorization")
            if not keys.accepts(header):
                raise _unauthorized(header is None)
        return await handler(request)

    return require_api_key


def _unauthorized(missing: bool) -> ApiError:
    message = (
        "You didn't provide an API key. Send it as 'Authorization: Bearer YOUR_KEY'."
        if missing
        else "Incorrect API key provided."
    )
    return ApiError(
        401,
        message,
        code="invalid_api_key",
        headers={"WWW-Authenticate": 'Bearer realm="cluster"'},
    )
