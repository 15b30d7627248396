"""`cluster node`: a node daemon that serves one shard of a model (`node.server`)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import click

from cluster.commands.options import tls_cert_option, tls_key_option, token_option
from cluster.decode import late_input
from cluster.decode.worker import GPU_SPIN_S
from cluster.transport.auth import TLSConfig
from cluster.weights.store import WeightsStore, default_cache_dir
from node.server import NodeSettings, serve


@click.command("node")
@click.option("--host", default="0.0.0.0", show_default=True, help="Address to listen on.")
@click.option("--port", type=int, default=50151, show_default=True)
@token_option()
@click.option(
    "--token-file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Read the cluster secret from this file (mode 0600): kept off the command line.",
)
@click.option("--node-id", default=None, help="Name shown in the coordinator.")
@click.option(
    "--memory-gb",
    type=float,
    default=None,
    help="Report at most this much memory to the planner [default: the machine's].",
)
@click.option(
    "--memory-share",
    type=float,
    default=1.0,
    show_default=True,
    help="The share of the machine's memory (its GPU's, on CUDA) this node plans within: "
    "nodes that share one machine (`cluster up --local N`: 1/N each).",
)
@click.option(
    "--cache-budget-gb",
    type=float,
    default=None,
    help="Memory for request caches on this node (default: unlimited).",
)
@click.option(
    "--prefix-cache-gb",
    type=float,
    default=None,
    help="Memory for conversation (prefix) snapshots on this node, unless its coordinator "
    "plans it (`cluster coordinator` does, from --max-context) [default: 1].",
)
@click.option(
    "--idle-timeout",
    type=float,
    default=600.0,
    show_default=True,
    help="Seconds after which an idle request's caches are freed.",
)
@click.option(
    "--advertise/--no-advertise",
    default=True,
    show_default=True,
    help="Announce this node over mDNS (zeroconf).",
)
@tls_cert_option("Cluster certificate (PEM): serve and dial nodes over TLS.")
@tls_key_option("The certificate's private key (PEM).")
@click.option(
    "--cache-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Where fetched weights are cached [default: ~/.cache/cluster/models].",
)
@click.option(
    "--cache-cap-gb",
    type=float,
    default=None,
    help="Disk cap of the weights cache; least recently used models are evicted.",
)
@click.option(
    "--spin-ms",
    type=float,
    default=None,
    help="How long the MLX thread stays awake after a step for the next one, in ms "
    f"[default: {GPU_SPIN_S * 1e3:.0f} on a GPU, 0 on the CPU backend].",
)
@click.option(
    "--build-ahead",
    type=click.Choice(late_input.BUILD_AHEAD_SETTINGS),
    default="auto",
    show_default=True,
    help="Build (on CUDA, launch) the next decode step before its message arrives: auto is "
    "on with MLX CUDA only; on also builds ahead on the CPU and Metal.",
)
def node_command(
    host: str,
    port: int,
    token: str | None,
    token_file: Path | None,
    node_id: str | None,
    memory_gb: float | None,
    memory_share: float,
    cache_budget_gb: float | None,
    prefix_cache_gb: float | None,
    idle_timeout: float,
    advertise: bool,
    tls_cert: str | None,
    tls_key: str | None,
    cache_dir: Path | None,
    cache_cap_gb: float | None,
    spin_ms: float | None,
    build_ahead: str,
) -> None:
    """Run a node daemon that serves one shard of a model."""
    if token_file is not None:
        from cluster.secret import read_secret

        try:
            token = read_secret(token_file)
        except OSError as error:
            raise click.BadParameter(str(error), param_hint="--token-file") from error
    if not token:
        raise click.UsageError("give the cluster secret: --token-file, --token or CLUSTER_TOKEN")
    if memory_gb is not None and memory_gb <= 0:
        raise click.BadParameter("--memory-gb must be positive")
    if not 0 < memory_share <= 1:
        raise click.BadParameter(f"--memory-share must be in (0, 1], got {memory_share:g}")
    budget = int(cache_budget_gb * 2**30) if cache_budget_gb is not None else None
    if prefix_cache_gb is not None and prefix_cache_gb < 0:
        raise click.BadParameter("--prefix-cache-gb must be >= 0")
    prefix_budget = int(prefix_cache_gb * 2**30) if prefix_cache_gb is not None else None
    if cache_cap_gb is not None and cache_cap_gb <= 0:
        raise click.BadParameter("--cache-cap-gb must be positive")
    if spin_ms is not None and spin_ms < 0:
        raise click.BadParameter("--spin-ms must be >= 0")
    store = WeightsStore(
        cache_dir or default_cache_dir(),
        int(cache_cap_gb * 2**30) if cache_cap_gb is not None else None,
    )
    try:
        tls = TLSConfig.from_files(tls_cert, tls_key)
        if tls is not None:
            tls.server_credentials()  # fail now if the key is missing
        settings = NodeSettings(
            token,
            host=host,
            port=port,
            node_id=node_id,
            tls=tls,
            cache_budget_bytes=budget,
            prefix_budget_bytes=prefix_budget,
            idle_timeout_s=idle_timeout,
            advertise=advertise,
            memory_cap_bytes=int(memory_gb * 2**30) if memory_gb is not None else None,
            memory_share=memory_share,
            spin_s=spin_ms / 1e3 if spin_ms is not None else None,
            build_ahead=build_ahead,
        )
        asyncio.run(serve(settings, weights_store=store))
    except KeyboardInterrupt:
        pass
    except (OSError, ValueError) as error:
        raise click.ClickException(str(error)) from error
