"""A node's memory for its weights against the bytes of its own shard.

    python -m benchmarks.memory_bench [--json OUT] [--repeats 3]

Each case loads one shard (`cluster.model.loading.load_shard`, as a node's LoadShard does) in a
fresh subprocess and reports, after the load:
  active   mx.get_active_memory() growth: the arrays MLX holds
  peak     mx.get_peak_memory() growth: the most held at once while loading
  rss      the process's resident set growth (/proc/self/statm), which also counts
           allocator slack and mapped file pages
against the shard's own bytes: the sizes of exactly the tensors it reads
(`cluster.model.loading.shard_tensor_names`), from the safetensors headers. Target: active over
shard bytes <= 1.1. Cases: the head [0, 3), the tail [3, 8) (with lm_head, the MTP head and
its embedding) and the whole model, bf16; and the whole model converted to 8 and 4 bits
(when `cluster.model.convert` exists). Medians over --repeats fresh processes.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import bench_parser, default_model, machine, median, write_json

CASES = (("head [0, 3)", 0, 3), ("tail [3, 8)", 3, 8), ("whole [0, 8)", 0, 8))


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def shard_bytes(model_dir: Path, start: int, end: int, num_layers: int) -> int:
    from cluster.model.footprint import read_safetensors_header_sizes
    from cluster.model.loading import CheckpointIndex, shard_tensor_names
    from cluster.model.shard import ShardSpec

    spec = ShardSpec(start, end, start == 0, end == num_layers)
    index = CheckpointIndex.read(model_dir)
    sizes: dict[str, int] = {}
    for file in sorted(set(index.files.values())):
        sizes.update(read_safetensors_header_sizes(model_dir / file))
    return sum(sizes[name] for name in shard_tensor_names(model_dir, spec))


def child(model_dir: Path, start: int, end: int) -> dict:
    """In a fresh process: load one shard and measure what it holds."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from cluster.config import load_model_config
    from cluster.model.loading import load_shard
    from cluster.model.shard import ShardSpec

    num_layers = load_model_config(model_dir).num_layers
    spec = ShardSpec(start, end, start == 0, end == num_layers)
    mx.eval(mx.zeros(1))  # the runtime itself is not the shard's
    gc.collect()
    active0, rss0 = mx.get_active_memory(), rss_bytes()
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    shard = load_shard(model_dir, spec, for_decoding=True)  # as a node's LoadShard loads it
    load_s = time.perf_counter() - t0
    gc.collect()
    return {
        "active": mx.get_active_memory() - active0,
        "peak": mx.get_peak_memory() - active0,
        "rss": rss_bytes() - rss0,
        "parameters": sum(v.nbytes for _, v in tree_flatten(shard.parameters())),
        "load_s": load_s,
    }


def run_case(model_dir: Path, start: int, end: int) -> dict:
    command = [
        sys.executable,
        "-m",
        "benchmarks.memory_bench",
        "--child",
        "--model",
        str(model_dir),
        "--start",
        str(start),
        "--end",
        str(end),
    ]
    out = subprocess.run(command, capture_output=True, text=True, check=True, timeout=300)
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure(model_dirs: dict[str, Path], repeats: int) -> list[dict]:
    from cluster.config import load_model_config

    rows = []
    for weights, model_dir in model_dirs.items():
        num_layers = load_model_config(model_dir).num_layers
        cases = CASES if weights == "bf16" else CASES[2:]
        for label, start, end in cases:
            own = shard_bytes(model_dir, start, end, num_layers)
            runs = [run_case(model_dir, start, end) for _ in range(repeats)]
            row = {
                "weights": weights,
                "shard": label,
                "start": start,
                "end": end,
                "shard_bytes": own,
            }
            for key in ("active", "peak", "rss", "parameters", "load_s"):
                row[key] = median(r[key] for r in runs)
            for key in ("active", "peak", "rss", "parameters"):
                row[f"{key}_over_shard"] = row[key] / own
            rows.append(row)
            print(f"  {weights} {label}: done", flush=True)
    return rows


def print_report(rows: list[dict]) -> None:
    mib = 2**20
    print("\nmemory after loading a shard in a fresh process, over the shard's own tensor bytes")
    print(
        f"{'weights':<7} {'shard':<13} {'shard MiB':>9} {'active':>15} {'peak':>15} "
        f"{'RSS growth':>15}"
    )
    for r in rows:
        cells = [
            f"{r[k] / mib:6.2f} ({r[f'{k}_over_shard']:.2f}x)" for k in ("active", "peak", "rss")
        ]
        print(
            f"{r['weights']:<7} {r['shard']:<13} {r['shard_bytes'] / mib:>9.2f} "
            + " ".join(f"{c:>15}" for c in cells)
        )


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser("memory_bench", __doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-quantized", action="store_true")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--start", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--end", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    model_dir = args.model or default_model()
    if args.child:
        print(json.dumps(child(model_dir, args.start, args.end)))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        dirs = {"bf16": model_dir}
        if not args.no_quantized:
            try:
                from cluster.model.convert import convert
            except ImportError:
                convert = None
            if convert is not None:
                for bits in (8, 4):
                    dirs[f"q{bits}"] = convert(model_dir, Path(tmp) / f"q{bits}", q_bits=bits)
        rows = measure(dirs, args.repeats)
    print_report(rows)
    write_json(
        args.json,
        {
            "benchmark": "memory_bench",
            "command": "python -m benchmarks.memory_bench "
            + " ".join(sys.argv[1:] if argv is None else argv),
            "machine": machine(),
            "model": str(model_dir),
            "rows": rows,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
