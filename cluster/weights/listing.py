"""`cluster models`: the models a weights cache holds, with their sizes: this machine's, or
running nodes' (from their Info)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import click

from cluster.weights.store import CachedModelSummary, WeightsStore, default_cache_dir
from proto import cluster_pb2 as pb


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def format_models(models: list[CachedModelSummary], now: float | None = None) -> list[str]:
    if not models:
        return ["no models cached"]
    now = time.time() if now is None else now
    lines = [f"{'model':<28} {'digest':<40} {'on disk':>10} {'tensors held':>20} {'used':>10}"]
    for m in sorted(models, key=lambda m: -m.last_used):
        held = f"{_size(m.present_bytes)}/{_size(m.model_bytes)}"
        ago = f"{(now - m.last_used) / 3600:.1f} h ago"
        lines.append(f"{m.name:<28} {m.digest:<40} {_size(m.disk_bytes):>10} {held:>20} {ago:>10}")
    return lines


def summaries_from_info(info: pb.NodeInfo) -> list[CachedModelSummary]:
    return [
        CachedModelSummary(
            digest=m.digest,
            name=m.name,
            disk_bytes=m.disk_bytes,
            model_bytes=m.model_bytes,
            present_bytes=m.present_bytes,
            last_used=m.last_used,
        )
        for m in info.cached_models
    ]


async def _node_infos(addresses: list[str], token: str) -> list[pb.NodeInfo | Exception]:
    from cluster.transport.node_client import NodeClient

    clients = [NodeClient(address, token) for address in addresses]
    try:
        return await asyncio.gather(*(c.info() for c in clients), return_exceptions=True)
    finally:
        for client in clients:
            await client.close()


@click.command("models")
@click.option(
    "--cache-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="This machine's weights cache [default: ~/.cache/cluster/models].",
)
@click.option("--nodes", default="", help="Ask running nodes instead: HOST:PORT,...")
@click.option("--token", envvar="CLUSTER_TOKEN", default="", help="Cluster secret (with --nodes).")
def models_command(cache_dir: Path | None, nodes: str, token: str) -> None:
    """List the models in a weights cache (what `cluster node` fetched), with their sizes."""
    addresses = [n for n in nodes.split(",") if n]
    if not addresses:
        store = WeightsStore(cache_dir or default_cache_dir())
        click.echo("\n".join(format_models(store.models())))
        click.echo(f"total {_size(store.usage_bytes())} in {store.root}")
        return
    if not token:
        raise click.UsageError("--nodes needs the cluster token (--token or CLUSTER_TOKEN)")
    for address, info in zip(addresses, asyncio.run(_node_infos(addresses, token)), strict=True):
        if isinstance(info, Exception):
            click.echo(f"{address}: unreachable ({info})")
            continue
        click.echo(f"node {info.node_id} ({address})")
        click.echo("\n".join("  " + line for line in format_models(summaries_from_info(info))))
