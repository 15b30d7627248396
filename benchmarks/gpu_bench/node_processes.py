"""Oracle node processes on loopback, one per GPU, and decoding through them."""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import secrets
import shlex
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from benchmarks.common import free_port
from benchmarks.gpu_bench.one_process import (
    concurrent_decode,
    engine_decode,
    warm_tokens,
    warm_up,
)

REPO = Path(__file__).resolve().parents[2]  # the checkout: where node and rank processes start


@contextlib.asynccontextmanager
async def node_processes(
    args, nodes: int, log: list[str], node_options: str = ""
) -> AsyncIterator[tuple[list[str], str]]:
    """`nodes` oracle node processes on loopback (node i on GPU i % --gpus), with the
    `cluster node` settings `node_options` (a `--node-sets` entry); yields their addresses
    and token, and stops them on the way out. Each node plans its caches within an even share
    of a GPU among the most nodes one GPU holds and the benchmark's one process (on GPU 0)."""
    token = secrets.token_hex(16)
    ports = [free_port() for _ in range(nodes)]
    procs: list[asyncio.subprocess.Process] = []
    share = 1 / (math.ceil(nodes / max(args.gpus, 1)) + 1)
    readers: list[asyncio.Task] = []
    try:
        for i, port in enumerate(ports):
            env = dict(os.environ)
            if args.gpus > 1:  # one node per GPU, round robin
                env["CUDA_VISIBLE_DEVICES"] = str(i % args.gpus)
            proc = await asyncio.create_subprocess_exec(
                *[sys.executable, "-m", "benchmarks.oracle_node", "--host", "127.0.0.1"],
                *["--port", str(port), "--token", token, "--accept-rate", str(args.node_alpha)],
                *["--node-id", f"bench-{i}", "--cache-limit-gb", "2"],
                *["--memory-share", f"{share:.6f}"],
                *shlex.split(node_options),
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                cwd=REPO,
                env=env,
            )
            procs.append(proc)
        ready = [asyncio.Event() for _ in procs]
        readers = [
            asyncio.create_task(_read_lines(p, f"node{i}", log, ready[i]))
            for i, p in enumerate(procs)
        ]
        all_ready = asyncio.ensure_future(asyncio.gather(*(r.wait() for r in ready)))
        await asyncio.wait([all_ready, *readers], timeout=180, return_when="FIRST_COMPLETED")
        if not all_ready.done():
            all_ready.cancel()
            raise RuntimeError("nodes did not start:\n" + "\n".join(log[-20:]))
        yield [f"127.0.0.1:{p}" for p in ports], token
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.terminate()
        for proc in procs:
            try:
                await asyncio.wait_for(proc.wait(), 15)
            except TimeoutError:
                proc.kill()
                await proc.wait()
        for reader in readers:
            reader.cancel()


async def node_pipeline(
    args, path: Path, nodes: int, prompt: tuple[int, ...], log: list[str]
) -> dict:
    """`nodes` oracle node processes on loopback, driven as `cluster generate --nodes` does."""
    from cluster.decode.remote_pipeline import PipelineSettings, open_remote_engine

    async with node_processes(args, nodes, log) as (addresses, token):
        t0 = time.perf_counter()
        remote = await open_remote_engine(path, addresses, PipelineSettings(token))
        row: dict[str, Any] = {"nodes": nodes, "load_s": time.perf_counter() - t0}
        try:
            await warm_up(remote.engine, prompt)
            for key, mtp in (("mtp_off", False), ("mtp_on", True)):
                row[key] = await engine_decode(
                    remote.engine, prompt, args.tokens, args.repeats, mtp
                )
                infos = [await c.info() for c in remote.pipeline.clients]
                row[key]["node_step_ms"] = [i.step_latency_ms for i in infos]
                print(f"  {nodes} nodes {key}: {row[key]['median_tps']:.1f} tok/s", flush=True)
            row["on_over_off"] = row["mtp_on"]["median_tps"] / row["mtp_off"]["median_tps"]
            if args.concurrent > 1:
                # A short batch first, kept apart: the first batch of a shape pays one-time costs.
                first = await concurrent_decode(
                    remote.engine, prompt, warm_tokens(args), args.concurrent
                )
                row["concurrent"] = await concurrent_decode(
                    remote.engine, prompt, args.tokens, args.concurrent
                )
                row["concurrent"]["first_batch"] = first
                print(
                    f"  {nodes} nodes, {args.concurrent} concurrent MTP on: "
                    f"{row['concurrent']['aggregate_tps']:.1f} tok/s",
                    flush=True,
                )
        finally:
            await remote.close()
        return row


async def _read_lines(
    proc: asyncio.subprocess.Process, name: str, log: list[str], ready: asyncio.Event
) -> None:
    assert proc.stdout is not None
    async for raw in proc.stdout:
        line = raw.decode(errors="replace").rstrip()
        log.append(f"[{name}] {line}")
        if "listening on" in line:
            ready.set()
    log.append(f"[{name}] exited with {await proc.wait()}")
    if not ready.is_set():
        raise RuntimeError(f"{name} exited before listening:\n" + "\n".join(log[-20:]))
