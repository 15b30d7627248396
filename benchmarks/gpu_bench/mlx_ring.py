"""mlx-lm's own pipeline under `mlx.launch --backend ring`."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import mlx.core as mx

from benchmarks.common import free_port, median
from benchmarks.gpu_bench.node_processes import REPO
from benchmarks.random_checkpoint import bench_prompt
from cluster.config import load_model_config

LAUNCH = "import sys; from mlx._distributed_utils.launch import main; sys.exit(main())"


def mlx_pipeline(args, path: Path, cpu_comm: bool, timeout_s: float) -> dict:
    """mlx-lm's pipeline with the ring backend, 2 ranks on loopback; rank 0's figures or the
    launcher's error."""
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rank0.json"
        command = [
            *[sys.executable, "-c", LAUNCH, "--backend", "ring", "-n", "2"],
            *["--hosts", "127.0.0.1", "--starting-port", str(port), "--"],
            *[sys.executable, "-m", "benchmarks.gpu_bench", "--pipeline-worker"],
            *["--dir", str(path), "--json", str(out), "--tokens", str(args.tokens)],
            *["--repeats", str(args.repeats), "--prompt-len", str(args.prompt_len)],
            *(["--cpu-comm"] if cpu_comm else []),
        ]
        shown = "mlx.launch " + " ".join(command[3:])
        proc = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=REPO,
            start_new_session=True,
        )
        try:
            output, _ = proc.communicate(timeout=timeout_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the launcher's own process group
            output, _ = proc.communicate()
            timed_out = True
        result: dict[str, Any] = {"command": shown, "cpu_comm": cpu_comm, "exit": proc.returncode}
        if out.is_file():
            result.update(json.loads(out.read_text()))
        else:
            result["error"] = _error_lines(output) or ("timed out" if timed_out else "no output")
        result["output_tail"] = output[-3000:]
        return result


def _error_lines(output: str) -> str:
    hits = [
        line.strip()
        for line in output.splitlines()
        if re.search(r"(Error|error:|Exception|has no CUDA|not implemented)", line)
    ]
    return "\n".join(dict.fromkeys(hits))[-1500:]


def pipeline_worker(args) -> None:
    """One rank of mlx-lm's pipeline (run by mlx.launch); rank 0 writes the figures."""
    group = mx.distributed.init(strict=True, backend="ring")
    mx.set_cache_limit(2 << 30)
    if args.cpu_comm:
        _comm_on_cpu()
    from mlx_lm import stream_generate
    from mlx_lm.utils import sharded_load

    t0 = time.perf_counter()
    model, tokenizer = sharded_load(str(args.dir), pipeline_group=group)
    load_s = time.perf_counter() - t0
    tokenizer.eos_token_ids = set()
    vocab = load_model_config(args.dir).text.vocab_size
    prompt = list(bench_prompt(vocab, args.prompt_len))

    def run(n: int) -> float:
        stamps = [
            time.perf_counter() for _ in stream_generate(model, tokenizer, prompt, max_tokens=n)
        ]
        return (len(stamps) - 1) / (stamps[-1] - stamps[0])

    run(16)
    tps = [run(args.tokens) for _ in range(args.repeats)]
    # Each generation leaves one step in flight (mlx-lm evaluates the next step ahead); a rank
    # that exits with it pending breaks its peer's ring, so all ranks meet here first.
    mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group, stream=mx.cpu))
    if group.rank() == 0:
        inner = model.model
        report = {
            "ranks": group.size(),
            "rank0_layers": [inner.start_idx, inner.end_idx],
            "load_s": load_s,
            "decode_tps": tps,
            "median_tps": median(tps),
        }
        Path(args.json).write_text(json.dumps(report))


def _comm_on_cpu() -> None:
    """Run mlx-lm's send / recv_like / all_gather on the CPU stream, where the ring backend
    implements them (its GPU side may have none)."""
    dist = mx.distributed
    for name in ("send", "recv_like", "all_gather"):
        original = getattr(dist, name)

        def on_cpu(*a, _original=original, **kw):
            kw["stream"] = mx.cpu
            return _original(*a, **kw)

        setattr(dist, name, on_cpu)
