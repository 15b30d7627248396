"""`cluster models`: the models in a weights cache, this machine's or running nodes'."""

from __future__ import annotations

import asyncio
from pathlib import Path

import click

from cluster.commands.options import token_option
from cluster.weights.listing import format_models, node_infos, size_text, summaries_from_info
from cluster.weights.store import WeightsStore, default_cache_dir


@click.command("models")
@click.option(
    "--cache-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="This machine's weights cache [default: ~/.cache/cluster/models].",
)
@click.option("--nodes", default="", help="Ask running nodes instead: HOST:PORT,...")
@token_option("Cluster secret (with --nodes).")
def models_command(cache_dir: Path | None, nodes: str, token: str | None) -> None:
    """List the models in a weights cache (what `cluster node` fetched), with their sizes."""
    addresses = [n for n in nodes.split(",") if n]
    if not addresses:
        store = WeightsStore(cache_dir or default_cache_dir())
        click.echo("\n".join(format_models(store.models())))
        click.echo(f"total {size_text(store.usage_bytes())} in {store.root}")
        return
    if not token:
        raise click.UsageError("--nodes needs the cluster token (--token or CLUSTER_TOKEN)")
    for address, info in zip(addresses, asyncio.run(node_infos(addresses, token)), strict=True):
        if isinstance(info, Exception):
            click.echo(f"{address}: unreachable ({info})")
            continue
        click.echo(f"node {info.node_id} ({address})")
        click.echo("\n".join("  " + line for line in format_models(summaries_from_info(info))))
