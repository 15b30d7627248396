"""A cluster's first start on a host that has compiled nothing: `cluster up` with its kernels
built ahead beside the load (`cluster.decode.kernel_builds`) and without, side by side.

Each variant starts `cluster up --local NODES` with an empty MLX kernel cache of its own
(`MLX_PTX_CACHE_DIR`: what a new host has), so both variants meet a new host on one machine.
It times the start until `/health` says ok, reads the warm-up's seconds and each node's
kernel-build line, then (unless `--no-bench`) runs `cluster bench` twice: first as the first
users would (the first request's TTFT over the next three, and the ITL p50 and p99 when 8
requests first arrive together), then again on the now warm cluster, the same figures a
warm cluster gives. `--keep DIR` keeps each variant's `cluster up` log and bench reports.

    python -m benchmarks.warmup_bench --shape qwen3_5_27b --builds on,off --json $OUT/warm.json

On the CPU and on Metal nothing is compiled at first use, so both variants build nothing.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks import random_checkpoint
from benchmarks.common import bench_parser, default_model, free_port, machine, write_json
from cluster.decode.kernel_builds import SWITCH

BENCH = ("--prompt-tokens", "128", "--concurrency", "1,8", "--max-tokens", "64", "--mtp", "on",
         "--sampling", "greedy", "--baseline", "none")  # fmt: skip


def run_variant(
    model: Path, nodes: int, builds: bool, bench: bool, timeout_s: float, keep: Path | None = None
) -> dict:
    """One `cluster up` on an empty kernel cache, with kernel builds on or off; `keep`: where
    its log and bench reports are left (else they are removed)."""
    cache = Path(tempfile.mkdtemp(prefix="warmup-bench-ptx-"))
    out = Path(tempfile.mkdtemp(prefix="warmup-bench-out-"))
    env = {**os.environ, "MLX_PTX_CACHE_DIR": str(cache), SWITCH: "1" if builds else "0"}
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "cluster", "up", "--local", str(nodes),
               "--model", str(model), "--port", str(port)]  # fmt: skip
    started = time.monotonic()
    log = (out / "up.log").open("w")
    up = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    result: dict[str, Any] = {"builds": builds}
    try:
        result["ready_s"] = _wait_healthy(url, up, timeout_s) - started
        result["ready_unix_s"] = time.time()
        metrics = _get(f"{url}/metrics")
        result["warmup_s"] = _gauge(metrics, "cluster_warmup_seconds")
        nodes_seen = json.loads(_get(f"{url}/api/cluster"))["nodes"]
        result["kernel_builds"] = {n["node_id"]: n.get("kernel_builds", "") for n in nodes_seen}
        if bench:
            result |= _bench_users(url, model, out / "bench-first")
            warm = _bench_users(url, model, out / "bench-warm")
            result |= {f"warm_{name}": value for name, value in warm.items() if "c8" in name}
    except Exception:
        log.flush()
        sys.stderr.write("cluster up's last lines:\n" + _tail(out / "up.log"))
        raise
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            up.kill()
            up.wait()
        log.close()
        files = list(cache.iterdir()) if cache.is_dir() else []
        result["cache_files"] = len(files)
        # What was compiled once the cluster said it was ready: what its first users waited for.
        ready = result.get("ready_unix_s", float("inf"))
        result["built_after_ready"] = sorted(f.name for f in files if f.stat().st_mtime > ready)
        shutil.rmtree(cache, ignore_errors=True)
        if keep is not None:  # flat: the reports' plots are left out
            keep.mkdir(parents=True, exist_ok=True)
            for report in [out / "up.log", *out.glob("*/bench.json")]:
                name = "-".join(report.relative_to(out).parts)
                shutil.copy(report, keep / f"builds-{'on' if builds else 'off'}-{name}")
        shutil.rmtree(out, ignore_errors=True)
    return result


def _bench_users(url: str, model: Path, out: Path) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "cluster", "bench", "--url", url, "--model", str(model), *BENCH,
         "--out", str(out)],
        capture_output=True, text=True,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"cluster bench failed: {done.stderr[-2000:]}")
    report = json.loads((out / "bench.json").read_text())
    eight = next(s for s in report["scenarios"] if s["settings"]["concurrency"] == 8)["metrics"]
    return {
        "first_request_over_warm": report["first_request"]["over_warm"],
        "c8_itl_p50_ms": eight["median_itl_ms"],
        "c8_itl_p99_ms": eight["p99_itl_ms"],
        "c8_itl_p99_over_p50": eight["p99_itl_ms"] / eight["median_itl_ms"],
    }


def _wait_healthy(url: str, up: subprocess.Popen, timeout_s: float) -> float:
    """The moment `/health` first answers 200 (every node up and warm)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if up.poll() is not None:
            raise RuntimeError(f"cluster up exited with {up.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                if response.status == 200:
                    return time.monotonic()
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"not ready after {timeout_s:.0f} s")


def _tail(path: Path, lines: int = 40) -> str:
    return "".join(path.read_text(errors="replace").splitlines(keepends=True)[-lines:])


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as response:
        return response.read().decode()


def _gauge(metrics: str, name: str) -> float:
    for line in metrics.splitlines():
        if line.startswith(f"{name} "):
            return float(line.split()[1])
    raise KeyError(name)


def main(argv: list[str] | None = None) -> None:
    parser = bench_parser("warmup_bench", __doc__)
    parser.add_argument(
        "--shape",
        choices=sorted(random_checkpoint.SHAPES),
        default=None,
        help="a real model's shape with random weights (instead of --model)",
    )
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--builds", default="on,off", help="on, off or both, in this order")
    parser.add_argument("--no-bench", action="store_true", help="time the start only")
    parser.add_argument("--keep", type=Path, default=None, help="keep logs and reports here")
    parser.add_argument("--timeout-s", type=float, default=900.0)  # fmt: skip
    args = parser.parse_args(argv)
    variants = [v.strip() for v in args.builds.split(",")]
    if not variants or set(variants) - {"on", "off"}:
        parser.error(f"--builds takes on, off or on,off, not {args.builds!r}")
    model = args.model or default_model()
    if args.shape:
        model = args.model or random_checkpoint.default_dir(args.shape, args.bits)
        random_checkpoint.write_checkpoint(model, args.shape, args.bits, 64, 0)
    runs = []
    for variant in variants:
        on = variant == "on"
        run = run_variant(model, args.nodes, on, not args.no_bench, args.timeout_s, args.keep)
        runs.append(run)
        line = f"builds {variant}: ready after {run['ready_s']:.1f} s"
        line += f", warm-up {run['warmup_s']:.1f} s"
        if "c8_itl_p99_ms" in run:
            line += (f", first request {run['first_request_over_warm']:.2f}x warm,"
                     f" c=8 ITL p99 {run['c8_itl_p99_over_p50']:.1f}x p50"
                     f" ({run['warm_c8_itl_p99_over_p50']:.1f}x when warm)")  # fmt: skip
        print(line, flush=True)
        if run["built_after_ready"]:
            print(f"  compiled after ready: {', '.join(run['built_after_ready'])}")
        for node, line in run["kernel_builds"].items():
            if line:
                print(f"  {node}: {line}")
    write_json(args.json, {"benchmark": "warmup_bench", "model": str(model), "nodes": args.nodes,
                           "machine": machine(), "runs": runs})  # fmt: skip


if __name__ == "__main__":
    main()
