"""The run: every phase asked for, in order, the report written after each."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import mlx.core as mx

from benchmarks import gpu_bench
from benchmarks.common import bench_parser, machine, write_json
from benchmarks.gpu_bench.diagnosis import diagnose
from benchmarks.gpu_bench.mlx_ring import mlx_pipeline, pipeline_worker
from benchmarks.gpu_bench.node_processes import node_pipeline
from benchmarks.gpu_bench.one_process import (
    DEFAULT_VARIANTS,
    VARIANTS,
    interleaved_variants,
    mlx_lm_decode,
    single_process,
)
from benchmarks.gpu_bench.phase import Deadline, recorded
from benchmarks.gpu_bench.side_by_side import paired
from benchmarks.gpu_bench.step_timing import free_memory
from benchmarks.gpu_bench.summary import summarize
from benchmarks.oracle_node import add_node_options
from benchmarks.random_checkpoint import SHAPES, bench_prompt, default_dir, write_checkpoint
from cluster.config import load_model_config
from cluster.decode.worker import MLXWorker
from cluster.messages import parse_mtp_depth


def device_name() -> str:
    try:
        query = [
            "nvidia-smi",
            "--query-gpu=name,memory.total,driver_version",
            "--format=csv,noheader",
        ]
        return subprocess.run(query, capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return str(mx.default_device())


async def run(args) -> dict:
    deadline = Deadline(args.deadline_s)
    path = args.dir or default_dir(args.shape, args.bits)
    report: dict[str, Any] = {
        "benchmark": "gpu_bench",
        "command": "python -m benchmarks.gpu_bench " + " ".join(args.argv),
        "machine": {**machine(), "gpu": device_name()},
        "shape": args.shape,
        "bits": args.bits,
        "group_size": args.group_size,
        "dir": str(path),
        "settings": {
            "tokens": args.tokens,
            "repeats": args.repeats,
            "prompt_len": args.prompt_len,
            "alphas": args.alphas,
            "node_alpha": args.node_alpha,
            "step_iters": args.step_iters,
            "gpus": args.gpus,
            "concurrent": args.concurrent,
            "variants": args.variants,
            "mtp_depths": args.mtp_depths,
        },
    }
    if os.environ.get("BENCH_COMMIT"):  # a tree copied without its .git says what it is
        report["machine"]["commit"] = os.environ["BENCH_COMMIT"]
    save = lambda: write_json(args.json, report)  # noqa: E731
    print(f"== checkpoint {path}", flush=True)
    worker = MLXWorker()
    report["checkpoint"] = await worker.run(
        write_checkpoint, path, args.shape, args.bits, args.group_size, args.seed
    )
    await worker.run(free_memory)
    worker.close()
    print(f"  {json.dumps(report['checkpoint'])}", flush=True)
    save()
    prompt = bench_prompt(load_model_config(path).text.vocab_size, args.prompt_len)
    if args.diagnose:
        print("== diagnose", flush=True)
        with recorded(report, "diagnose_error"):
            await diagnose(args, path, prompt, report)
        save()
        return report

    if "single" not in args.skip:
        print("== one process", flush=True)
        with recorded(report, "single_error"):
            await single_process(args, path, prompt, report)
        save()
    if args.interleave and deadline.allows("variants interleaved", 60, report):
        print("== variants interleaved", flush=True)
        with recorded(report, "interleaved_error"):
            await interleaved_variants(args, path, prompt, report)
        save()
    if "mlx_lm" not in args.skip and deadline.allows("mlx-lm stream_generate", 60, report):
        print("== mlx-lm stream_generate", flush=True)
        worker = MLXWorker()
        with recorded(report, "mlx_lm_error"):
            report["mlx_lm"] = await worker.run(
                mlx_lm_decode, path, prompt, args.tokens, args.repeats
            )
            print(f"  {report['mlx_lm']['median_tps']:.1f} tok/s", flush=True)
        await worker.run(free_memory)
        worker.close()
        save()
    log: list[str] = []
    report["nodes"] = {}
    for n in args.nodes:
        if "nodes" in args.skip or not deadline.allows(f"{n} nodes", 90, report):
            continue
        print(f"== {n} nodes", flush=True)
        try:
            report["nodes"][str(n)] = await node_pipeline(args, path, n, prompt, log)
        except Exception as error:  # keep the other phases' figures
            report["nodes"][str(n)] = {"error": f"{type(error).__name__}: {error}"}
            print(f"  failed: {error}", flush=True)
        save()
    if "paired" not in args.skip and deadline.allows("side by side", 150, report):
        print(f"== side by side: one process, mlx-lm, {args.paired_nodes} nodes", flush=True)
        with recorded(report, "paired_error"):
            await paired(args, path, prompt, report, log)
        save()
    report["node_log_tail"] = log[-60:]
    if "pipeline" not in args.skip and deadline.allows("mlx-lm pipeline", 90, report):
        print("== mlx-lm pipeline (mlx.launch, ring, 2 ranks)", flush=True)
        attempts = [mlx_pipeline(args, path, False, min(150, deadline.left() - 20))]
        if "median_tps" not in attempts[0] and deadline.allows("pipeline, comm on CPU", 70, report):
            print(f"  failed as is: {attempts[0]['error']}", flush=True)
            attempts.append(mlx_pipeline(args, path, True, min(150, deadline.left() - 10)))
        report["mlx_pipeline"] = attempts
        save()
    summarize(report)
    save()
    return report


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = bench_parser("gpu_bench", gpu_bench.__doc__, json=False, model=False)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3_5_27b")
    parser.add_argument("--bits", type=int, choices=(4, 8, 16), default=4, help="16: bf16")
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dir", type=Path, default=None, help="checkpoint dir (default: tmpfs)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--tokens", type=int, default=128, help="decode tokens per run")
    parser.add_argument("--repeats", type=int, default=3, help="runs per variant (median)")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument(
        "--step-iters",
        type=int,
        default=60,
        help="steps timed per figure (60); the breakdown and --diagnose's split and idle "
        "steps time half as many",
    )
    parser.add_argument("--step-warmup", type=int, default=8)
    parser.add_argument(
        "--alphas", type=lambda s: [float(a) for a in s.split(",")], default=[0.5, 0.7, 0.9]
    )
    parser.add_argument(
        "--mtp-depths",
        type=lambda s: [parse_mtp_depth(d) for d in s.split(",")],
        default=[],
        help="also decode with MTP at these depths (1..8 or auto) at alpha 0.7, per variant",
    )
    parser.add_argument(
        "--interleave",
        type=int,
        default=0,
        help="also measure --variants side by side in this many alternating rounds (fused ones)",
    )
    parser.add_argument("--node-alpha", type=float, default=0.7)
    parser.add_argument("--nodes", type=lambda s: [int(n) for n in s.split(",")], default=[2, 3])
    parser.add_argument(
        "--gpus", type=int, default=1, help="place node i on GPU i %% GPUS (CUDA_VISIBLE_DEVICES)"
    )
    parser.add_argument(
        "--concurrent", type=int, default=8, help="concurrent MTP-on requests through the nodes"
    )
    parser.add_argument(
        "--variants",
        type=lambda s: s.split(","),
        default=list(DEFAULT_VARIANTS),
        help="fast-path variants of the one-process phase, in this order; the last is the one "
        f"reported as the engine: {','.join(v[0] for v in VARIANTS)}",
    )
    parser.add_argument(
        "--skip",
        type=lambda s: set(s.split(",")),
        default=set(),
        help="phases to leave out: single,mlx_lm,nodes,paired,pipeline (with --diagnose: "
        "shapes,split,idle,mlx_lm,local)",
    )
    parser.add_argument(
        "--rounds", type=int, default=5, help="rounds of the side-by-side phase (paired)"
    )
    parser.add_argument(
        "--off-pairs",
        type=int,
        default=1,
        help="MTP-off decodes in one process and over the nodes, alternated, per round (paired)",
    )
    parser.add_argument(
        "--paired-nodes",
        type=int,
        default=2,
        help="node processes of the side-by-side phase (0: one process and mlx-lm only)",
    )
    parser.add_argument(
        "--node-sets",
        type=lambda s: s.split(";"),
        default=[""],
        help="side by side, one node set per ';'-separated entry of `cluster node` settings "
        "(--spin-ms, --build-ahead), alternated; the first is reported as the nodes, e.g. "
        "'--build-ahead auto;--build-ahead off' [default: one set at the nodes' defaults]",
    )
    parser.add_argument(
        "--driver-streams",
        type=lambda s: s.split(","),
        default=["tcp"],
        help="side by side, one node set per kind of the driver's streams to the nodes, "
        "alternated: tcp (the nodes' TCP step port, the default) or grpc [default: tcp]",
    )
    parser.add_argument("--deadline-s", type=float, default=500)
    parser.add_argument("--cache-limit-gb", type=float, default=8)
    parser.add_argument(
        "--diagnose",
        action="store_true",
        help="only the diagnosis: quantized matmul by rows, the backbone by step shape and its "
        "graph's primitives, a step split in two halves, each half after idling, mlx-lm's "
        "forward, the engine over 1 and 3 in-process shards",
    )
    parser.add_argument("--pipeline-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cpu-comm", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if unknown := set(args.variants) - {v[0] for v in VARIANTS}:
        parser.error(
            f"unknown variants {sorted(unknown)}; known: {', '.join(v[0] for v in VARIANTS)}"
        )
    if args.off_pairs < 1:
        parser.error("--off-pairs takes a number of alternations >= 1")
    node_options = argparse.ArgumentParser(prog="--node-sets", add_help=False, exit_on_error=False)
    add_node_options(node_options)
    for entry in args.node_sets:
        try:
            _, unknown = node_options.parse_known_args(shlex.split(entry))
        except (argparse.ArgumentError, ValueError) as error:
            parser.error(f"--node-sets entry {entry!r}: {error}")
        if unknown:
            parser.error(f"--node-sets entry {entry!r}: unknown settings {unknown}")
    if unknown := set(args.driver_streams) - {"tcp", "grpc"}:
        parser.error(f"--driver-streams takes tcp and grpc, not {sorted(unknown)}")
    if args.interleave < 0:
        parser.error("--interleave takes a number of rounds >= 0")
    if args.interleave and not all(v[1] for v in VARIANTS if v[0] in args.variants):
        parser.error("--interleave takes variants with fused projections only (not 'plain')")
    args.argv = sys.argv[1:] if argv is None else argv
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.pipeline_worker:
        pipeline_worker(args)
        return 0
    mx.set_cache_limit(int(args.cache_limit_gb * 2**30))
    started = time.perf_counter()
    asyncio.run(run(args))
    print(f"({time.perf_counter() - started:.0f} s)", flush=True)
    return 0
