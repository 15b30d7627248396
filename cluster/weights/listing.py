"""The models a weights cache holds, with their sizes: this machine's, or running nodes' (from
their Info), as `cluster models` prints them."""

from __future__ import annotations

import asyncio
import time

from cluster.weights.store import CachedModelSummary
from proto import cluster_pb2 as pb


def size_text(n: int) -> str:
    """A byte count as GiB (from 1 GiB) or MiB."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def format_models(models: list[CachedModelSummary], now: float | None = None) -> list[str]:
    """The table's lines, most recently used model first (`now`: the time to count from)."""
    if not models:
        return ["no models cached"]
    now = time.time() if now is None else now
    lines = [f"{'model':<28} {'digest':<40} {'on disk':>10} {'tensors held':>20} {'used':>10}"]
    for m in sorted(models, key=lambda m: -m.last_used):
        held = f"{size_text(m.present_bytes)}/{size_text(m.model_bytes)}"
        ago = f"{(now - m.last_used) / 3600:.1f} h ago"
        disk = size_text(m.disk_bytes)
        lines.append(f"{m.name:<28} {m.digest:<40} {disk:>10} {held:>20} {ago:>10}")
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


async def node_infos(addresses: list[str], token: str) -> list[pb.NodeInfo | Exception]:
    """Each node's Info, or the error that asking it raised, in the order of `addresses`."""
    from cluster.transport.node_client import NodeClient

    clients = [NodeClient(address, token) for address in addresses]
    try:
        return await asyncio.gather(*(c.info() for c in clients), return_exceptions=True)
    finally:
        for client in clients:
            await client.close()
