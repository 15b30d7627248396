"""What a coordinator is told at its start, as one value: built once from the command line
(or a test) and read, never changed, by the service.

Light to import (no MLX, gRPC, HTTP stack or tokenizer): a command builds it before it
loads any of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: these bring MLX, gRPC and aiohttp
    from cluster.messages import MtpDepth
    from cluster.transport.auth import TLSConfig
    from coordinator.api_keys import ApiKeys

# How long a request that lost its pipeline waits for a new placement before it fails.
REPLAY_WAIT_S = 60.0
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "::1", "localhost"})
KEY_FLAGS = "--api-key KEY, --api-key-file FILE or $CLUSTER_API_KEY"


class ApiKeyError(ValueError):
    """API keys that cannot be used: an unreadable or empty key file, a malformed key."""


class OpenEndpointError(ValueError):
    """A coordinator asked to listen beyond loopback with no API key and no `--no-api-key`."""


class MaxContextError(ValueError):
    """A `--max-context` (or cluster-file `max_context`) the model cannot serve."""


def check_max_context(max_context: int, model_dir: Path) -> None:
    """Refuse a limit below 1 or beyond the model's own context (`max_position_embeddings`),
    naming both, before anything starts."""
    from cluster.model.footprint import model_max_context

    if max_context < 1:
        raise MaxContextError(f"--max-context must be at least 1 token, got {max_context}")
    limit = model_max_context(model_dir)
    if max_context > limit:
        raise MaxContextError(
            f"--max-context {max_context} is beyond the model's own context of {limit} tokens "
            f"(max_position_embeddings of {model_dir.name}); give at most {limit}"
        )


def check_endpoint(host: str, has_keys: bool, allow_open: bool) -> None:
    """Refuse to serve beyond loopback without an API key: anyone who reaches the port could
    use the cluster. `allow_open` (`--no-api-key`) is the explicit choice to do so anyway."""
    if has_keys or allow_open or host in LOOPBACK_HOSTS:
        return
    raise OpenEndpointError(
        f"refusing to serve on {host} without an API key: anyone who reaches it could use it. "
        f"Give {KEY_FLAGS} (or --no-api-key to serve it open on purpose)"
    )


@dataclass(frozen=True, slots=True)
class CoordinatorSettings:
    """A coordinator's configuration.

    Nodes: `nodes` (HOST:PORT, always tried) and, with `browse`, those mDNS finds; `token`
    and `tls` reach them. Placement: `layers` fixes each stage's half-open layer range (None:
    planned from the nodes' free memory), `use_all` spreads the model over every node rather
    than the fewest that fit, and each node reserves the caches of `max_running` requests of
    `max_context` tokens each (prompt plus max_tokens: the longest request served; None: the
    model's own context where that fits, else the longest that fits at the first placement)
    and, with `prefix_cache`, a conversation snapshot for each. `node_model_dir`: the
    model's path on the nodes (None: they fetch its weights from this coordinator's Weights
    service, when `serve_weights`, on `weights_port`, 0 for any free port).
    `pinned_addresses`: nodes whose upstream streams to exactly the given address.
    `adopt_shards`: keep the shards nodes already hold when they form the planned pipeline
    (no reload after a restart).

    HTTP: served on `host`:`port`, behind `api_keys` (None: open), at most `max_running`
    requests at once and `max_queued` waiting; `mtp_depth` for requests that name none;
    `prefix_cache` keeps conversation snapshots on the nodes; `announce` prints the URLs once
    serving. A request that lost its pipeline waits `replay_wait_s` for a new one. Beyond
    loopback without `api_keys` the coordinator refuses to start unless `allow_open`.
    `warmup`: run every shape the nodes will serve before saying ready (cluster.decode.warmup);
    off, the first requests pay for building them."""

    model_dir: Path
    token: str = field(repr=False)  # the cluster secret: kept out of logs
    nodes: tuple[str, ...] = ()
    browse: bool = True
    tls: TLSConfig | None = None
    layers: list[tuple[int, int]] | None = None
    use_all: bool = False
    max_context: int | None = None
    node_model_dir: str | None = None
    serve_weights: bool = True
    weights_port: int = 0
    pinned_addresses: frozenset[str] = frozenset()
    adopt_shards: bool = False
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: ApiKeys | None = None
    max_running: int = 8
    max_queued: int = 64
    mtp_depth: MtpDepth = "auto"
    prefix_cache: bool = True
    announce: bool = True
    warmup: bool = True
    replay_wait_s: float = REPLAY_WAIT_S
    allow_open: bool = False

    def __post_init__(self) -> None:
        if self.max_context is not None and self.max_context < 1:
            raise MaxContextError(f"--max-context must be at least 1 token, got {self.max_context}")


@dataclass(frozen=True, slots=True)
class ServingOptions:
    """The serving options that `cluster coordinator`, `cluster up` and a cluster file share,
    each None where not given, so that given ones can win over others (`over`) before the
    defaults fill the rest (`settings`)."""

    host: str | None = None
    port: int | None = None
    api_key: str | None = field(default=None, repr=False)
    api_key_file: Path | None = None
    no_api_key: bool | None = None
    mtp_depth: MtpDepth | None = None
    prefix_cache: bool | None = None
    open_monitoring: bool | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    max_running: int | None = None
    max_queued: int | None = None
    weights_port: int | None = None
    max_context: int | None = None

    def over(self, base: ServingOptions) -> ServingOptions:
        """These options where given, `base`'s elsewhere (flags over a cluster file). The API
        key is one choice: any of `api_key`, `api_key_file`, `no_api_key` given here replaces
        all three of `base`'s, so that a flag never adds to the file's keys unasked."""
        mine = {f.name: getattr(self, f.name) for f in fields(self)}
        merged = {k: getattr(base, k) if v is None else v for k, v in mine.items()}
        if any(v is not None for v in (self.api_key, self.api_key_file, self.no_api_key)):
            merged.update(
                api_key=self.api_key, api_key_file=self.api_key_file, no_api_key=self.no_api_key
            )
        return ServingOptions(**merged)

    def settings(self, model_dir: Path, token: str, **rest: object) -> CoordinatorSettings:
        """The coordinator's settings: these options (defaults where None) and `rest` (nodes,
        placement). Reads the key file; raises ApiKeyError for keys that cannot be used,
        OpenEndpointError for an open endpoint beyond loopback, MaxContextError for a
        `max_context` the model cannot serve and ValueError or OSError for TLS files that
        cannot be used, before anything starts."""
        from cluster.transport.auth import TLSConfig
        from coordinator.api_keys import ApiKeys, read_api_keys

        default = CoordinatorSettings(model_dir, token)
        try:
            keys = ApiKeys.of(
                read_api_keys(self.api_key, self.api_key_file),
                open_monitoring=bool(self.open_monitoring),
            )
        except (OSError, ValueError) as error:
            raise ApiKeyError(str(error)) from error
        if keys.enabled and self.no_api_key:
            raise ApiKeyError("--no-api-key and an API key were both given: choose one")
        host = default.host if self.host is None else self.host
        check_endpoint(host, keys.enabled, bool(self.no_api_key))
        if self.max_context is not None:
            check_max_context(self.max_context, model_dir)
        tls = TLSConfig.from_files(
            str(self.tls_cert) if self.tls_cert else None,
            str(self.tls_key) if self.tls_key else None,
        )
        given = {
            "host": host,
            "port": self.port,
            "mtp_depth": self.mtp_depth,
            "prefix_cache": self.prefix_cache,
            "max_running": self.max_running,
            "max_queued": self.max_queued,
            "weights_port": self.weights_port,
            "max_context": self.max_context,
        }
        return replace(
            default,
            api_keys=keys if keys.enabled else None,
            allow_open=bool(self.no_api_key),
            tls=tls,
            **{k: v for k, v in given.items() if v is not None},
            **rest,
        )
