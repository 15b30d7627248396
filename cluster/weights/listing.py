"""`cluster models`: the models a node's weights cache holds, with their sizes."""

from __future__ import annotations

import time
from pathlib import Path

import click

from cluster.weights.store import WeightsStore, default_cache_dir


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def format_models(store: WeightsStore, now: float | None = None) -> str:
    models = sorted(store.models(), key=lambda m: -m.last_used)
    if not models:
        return f"no models cached in {store.root}"
    now = time.time() if now is None else now
    lines = [f"{'model':<28} {'digest':<40} {'on disk':>10} {'tensors held':>18} {'used':>10}"]
    for m in models:
        held = f"{_size(m.present_bytes)}/{_size(m.model_bytes)}"
        ago = f"{(now - m.last_used) / 3600:.1f} h ago"
        lines.append(f"{m.name:<28} {m.digest:<40} {_size(m.disk_bytes):>10} {held:>18} {ago:>10}")
    cap = f" of {_size(store.cap_bytes)}" if store.cap_bytes else ""
    lines.append(f"total {_size(store.usage_bytes())}{cap} in {store.root}")
    return "\n".join(lines)


@click.command("models")
@click.option(
    "--cache-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="The node's weights cache [default: ~/.cache/cluster/models].",
)
def models_command(cache_dir: Path | None) -> None:
    """List the models in this machine's weights cache (what `cluster node` fetched)."""
    click.echo(format_models(WeightsStore(cache_dir or default_cache_dir())))
