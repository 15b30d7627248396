"""Soak: many requests in waves, the memory of every process after each wave.

    python -m benchmarks.soak [--nodes 3] [--waves 17] [--json soak.json]

Starts `--nodes` local node daemons and a coordinator (`--all-nodes`), then runs waves of
requests against its OpenAI endpoint: each wave is `--sequential` requests one after the
other, `--concurrent` requests `--concurrency` at a time, and `--hangups` streaming requests
whose client hangs up after the first event. After each wave (once every node reports no
request held) it records each node's resident memory (RSS), MLX's active and cached memory
(from the node's Info) and the conversation cache's snapshots in it, and the coordinator's
RSS. A leak shows as growth after the first wave (which warms every buffer and cache up): the
report gives, per process and in percent of its memory after the second wave, the largest
change from it and the last wave's change. The machine's background load does not matter:
memory, not time, is measured.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time

import aiohttp

from benchmarks.common import (
    CODE_PROMPTS,
    LocalNodes,
    free_port,
    machine,
    source_state,
    stop,
    wait_for_port,
    write_json,
)
from cluster.transport.node_client import NodeClient


def rss_bytes(pid: int) -> int:
    """Resident memory of a process (`ps`, which Linux and macOS both have)."""
    out = subprocess.run(["ps", "-o", "rss=", "-p", str(pid)], capture_output=True, text=True)
    return int(out.stdout.strip() or 0) * 1024


async def _complete(session: aiohttp.ClientSession, url: str, i: int, max_tokens: int) -> None:
    body = {"prompt": CODE_PROMPTS[i % 3], "max_tokens": max_tokens, "temperature": 0.7,
            "seed": i}  # fmt: skip
    async with session.post(f"{url}/v1/completions", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"request {i}: HTTP {response.status}: {await response.text()}")
        await response.read()


async def _hang_up(session: aiohttp.ClientSession, url: str, i: int, max_tokens: int) -> None:
    body = {"prompt": CODE_PROMPTS[i % 3], "max_tokens": max_tokens * 8, "stream": True}
    async with session.post(f"{url}/v1/completions", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"hang-up {i}: HTTP {response.status}")
        await response.content.readline()  # the first event, then the client goes away
        response.close()


async def _wave(url: str, args: argparse.Namespace, first: int) -> int:
    """One wave; returns how many requests it sent."""
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        n = first
        for _ in range(args.sequential):
            await _complete(session, url, n, args.max_tokens)
            n += 1
        for start in range(0, args.concurrent, args.concurrency):
            size = min(args.concurrency, args.concurrent - start)
            await asyncio.gather(
                *(_complete(session, url, n + k, args.max_tokens) for k in range(size))
            )
            n += size
        await asyncio.gather(*(_hang_up(session, url, n + k, args.max_tokens)
                               for k in range(args.hangups)))  # fmt: skip
        n += args.hangups
    return n - first


async def _node_memory(addresses: list[str], token: str) -> list[dict]:
    """Each node's Info, once it holds no request (a hung-up request is freed just after)."""
    clients = [NodeClient(address, token) for address in addresses]
    try:
        deadline = time.monotonic() + 30
        while True:
            infos = await asyncio.gather(*(c.info() for c in clients))
            if all(i.active_requests == 0 for i in infos) or time.monotonic() > deadline:
                return [
                    {"active_requests": i.active_requests, "mlx_active": i.mlx_active_bytes,
                     "mlx_cache": i.mlx_cache_bytes, "mlx_peak": i.mlx_peak_bytes,
                     "mlx_cache_limit": i.mlx_cache_limit_bytes,
                     "prefix_snapshots": i.prefix_snapshot_bytes}
                    for i in infos
                ]  # fmt: skip
            await asyncio.sleep(0.2)
    finally:
        for client in clients:
            await client.close()


def _growth(series: list[int]) -> dict[str, float]:
    """In percent of the first value: the largest change from it, and the last one's."""
    base = series[0]
    if not base:
        return {"max_pct": 0.0, "drift_pct": 0.0}
    return {
        "max_pct": max(abs(v - base) for v in series) / base * 100,
        "drift_pct": (series[-1] - base) / base * 100,
    }


async def soak(args: argparse.Namespace) -> dict:
    with LocalNodes(args.nodes) as nodes:
        port = free_port()
        coordinator = subprocess.Popen(
            [sys.executable, "-m", "cluster", "coordinator", "--nodes", ",".join(nodes.addresses),
             "--no-mdns", "--all-nodes", "--port", str(port), "--token", nodes.token,
             "--max-running", str(args.concurrency)],
            stdout=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            wait_for_port(port, coordinator, 120)
            url = f"http://127.0.0.1:{port}"
            rows, sent = [], 0
            for wave in range(args.waves):
                started = time.perf_counter()
                sent += await _wave(url, args, sent)
                infos = await _node_memory(nodes.addresses, nodes.token)
                row = {
                    "wave": wave + 1,
                    "requests": sent,
                    "seconds": round(time.perf_counter() - started, 1),
                    "coordinator_rss": rss_bytes(coordinator.pid),
                    "nodes": [
                        {"rss": rss_bytes(proc.pid), **info}
                        for proc, info in zip(nodes.procs, infos, strict=True)
                    ],
                }
                rows.append(row)
                _print_row(row)
        finally:
            stop([coordinator])
    after_first = rows[1:] if len(rows) > 1 else rows
    growth = {
        "coordinator_rss": _growth([r["coordinator_rss"] for r in after_first]),
        "nodes": [
            {
                "rss": _growth([r["nodes"][i]["rss"] for r in after_first]),
                "rss_less_mlx_cache": _growth(
                    [r["nodes"][i]["rss"] - r["nodes"][i]["mlx_cache"] for r in after_first]
                ),
                "mlx_active": _growth([r["nodes"][i]["mlx_active"] for r in after_first]),
                # The conversation cache keeps prefix snapshots up to its budget: not a leak.
                "mlx_active_less_prefix_cache": _growth(
                    [
                        r["nodes"][i]["mlx_active"] - r["nodes"][i]["prefix_snapshots"]
                        for r in after_first
                    ]
                ),
            }
            for i in range(args.nodes)
        ],
    }
    return {"args": vars(args), "machine": machine(), "source": source_state(),
            "waves": rows, "growth_after_first_wave": growth}  # fmt: skip


def _print_row(row: dict) -> None:
    mib = 2**20
    nodes = "  ".join(
        f"rss {n['rss'] / mib:6.1f} act {n['mlx_active'] / mib:5.1f} "
        f"cache {n['mlx_cache'] / mib:5.1f}"
        for n in row["nodes"]
    )
    print(
        f"wave {row['wave']:3d}  {row['requests']:5d} req  {row['seconds']:6.1f} s  "
        f"coordinator rss {row['coordinator_rss'] / mib:6.1f} MiB  nodes [MiB]: {nodes}",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--waves", type=int, default=17)
    parser.add_argument("--sequential", type=int, default=15)
    parser.add_argument("--concurrent", type=int, default=40)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--hangups", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--json", default=None, help="Write the report here.")
    args = parser.parse_args(argv)
    report = asyncio.run(soak(args))
    growth = report["growth_after_first_wave"]
    print(f"\n{report['waves'][-1]['requests']} requests; after wave 1, largest change / drift:")

    def pct(g: dict[str, float]) -> str:
        return f"{g['max_pct']:.1f} / {g['drift_pct']:+.1f} %"

    print(f"  coordinator RSS {pct(growth['coordinator_rss'])}")
    for i, node in enumerate(growth["nodes"]):
        print(
            f"  node {i}: RSS {pct(node['rss'])}, RSS less MLX cache "
            f"{pct(node['rss_less_mlx_cache'])}, MLX active {pct(node['mlx_active'])} "
            f"(less prefix snapshots {pct(node['mlx_active_less_prefix_cache'])})"
        )
    write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
