"""mlx-lm's own pipeline parallelism, `cluster bench --baseline ring`'s figures.

`run_ring` launches `mlx.launch --backend ring -n RANKS --hosts 127.0.0.1 -- python -m
cluster.bench.ring_baseline --worker ...` (the ring of `--local N`); `cluster bench --hosts`
starts the same worker once per host of the cluster file (`ring_hosts` here, `ring_rank` on
each host, with MLX_RANK and MLX_HOSTFILE set as mlx.launch sets them).

Every rank loads its share of the layers with mlx-lm's `sharded_load`
(`model.model.pipeline(group)`: rank 0 holds the last layers) and runs mlx-lm's
`stream_generate` on the bench's prompts, as (token ids, sampled) runs, with the same seed;
each decode step sends the hidden state down the ring and all-gathers the last one. Stop
tokens are ignored, so every run decodes exactly --max-tokens tokens. Rank 0 writes each run's
figures, defined as for mlx-lm in one process (`metrics.timing`).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cluster.bench.metrics import timing

LAUNCH_TIMEOUT_S = 300
WORKER_MODULE = "cluster.bench.ring_baseline"


def launcher_path() -> str:
    """The `mlx.launch` script of this interpreter's environment."""
    beside = Path(sys.executable).parent / "mlx.launch"
    return str(beside) if beside.exists() else "mlx.launch"


def run_ring(
    model_dir: Path,
    prompt_runs: list[tuple[list[int], bool]],
    *,
    ranks: int = 2,
    max_tokens: int = 128,
    temperature: float,
    seed: int = 0,
    timeout_s: float = LAUNCH_TIMEOUT_S,
) -> dict:
    """Run the ring over `ranks` processes on this machine, as a user would launch it; rank
    0's report, whose `runs` follow `prompt_runs`. Raises RuntimeError with the launcher's
    output when the ring does not run."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rank0.json"
        runs_file = Path(tmp) / "runs.json"
        runs_file.write_text(json.dumps(prompt_runs))
        worker = worker_argv(out, model_dir, runs_file, max_tokens, temperature, seed)
        command = [launcher_path(), "--backend", "ring", "-n", str(ranks), "--hosts",
                   "127.0.0.1", "--starting-port", str(_free_port()), "--", *worker]  # fmt: skip
        proc = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout_s, cwd=os.getcwd()
        )
        shown = " ".join(command[:9]) + f" -- python -m {WORKER_MODULE} --worker"
        if not out.exists():
            raise RuntimeError(
                f"the ring did not run ({shown}): exit {proc.returncode}\n"
                f"stdout: {proc.stdout[-2000:]}\nstderr: {proc.stderr[-2000:]}"
            )
        report = json.loads(out.read_text())
    return report | {"command": shown}


def worker_argv(
    out: Path,
    model_dir: Path | str,
    runs_file: Path,
    max_tokens: int,
    temperature: float,
    seed: int,
) -> list[str]:
    """The command line of one rank (the ring's environment says which)."""
    return [
        sys.executable, "-m", WORKER_MODULE, "--worker", "--out", str(out),
        "--model", str(model_dir), "--max-tokens", str(max_tokens),
        "--temperature", str(temperature), "--seed-base", str(seed),
        "--prompt-runs", str(runs_file),
    ]  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(args: argparse.Namespace) -> None:
    """One rank: load its layers, decode the runs; rank 0 writes the figures."""
    import mlx.core as mx
    from mlx_lm.utils import sharded_load

    # One group: ops given no group use the default ("any") one, and a second ring group
    # on the same ports breaks the first (connection lost mid-run).
    group = mx.distributed.init()
    if group.size() < 2:
        raise RuntimeError("not launched as a distributed job (use mlx.launch)")
    t0 = time.perf_counter()
    model, tokenizer = sharded_load(str(args.model), pipeline_group=group)
    load_s = time.perf_counter() - t0
    tokenizer.eos_token_ids = set()
    prompt_runs = json.loads(Path(args.prompt_runs).read_text())
    decode(model, tokenizer, prompt_runs[0][0][:16], True, 4, args)  # warm up
    runs = [
        decode(model, tokenizer, ids, sampled, args.max_tokens, args)
        for ids, sampled in prompt_runs
    ]
    # A last collective: neither rank exits while the other still runs the step that
    # mlx-lm's generator computes ahead (exiting early breaks the peer's sockets).
    mx.eval(mx.distributed.all_sum(mx.array(1.0), stream=mx.cpu))
    if group.rank() == 0:
        Path(args.out).write_text(
            json.dumps(
                {
                    "ranks": group.size(),
                    "rank0_layers": [model.model.start_idx, model.model.end_idx],
                    "load_s": load_s,
                    "max_tokens": args.max_tokens,
                    "temperature": args.temperature,
                    "runs": runs,
                }
            )
        )


def decode(model, tokenizer, ids: list[int], sampled: bool, max_tokens: int, args) -> dict:
    """One run's TTFT and decode tokens/s: greedy, or sampled at --temperature, seeded."""
    import mlx.core as mx
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    mx.random.seed(args.seed_base)
    sampler = make_sampler(args.temperature if sampled else 0.0)
    started = time.perf_counter()
    stamps = [
        time.perf_counter()
        for _ in stream_generate(
            model, tokenizer, list(ids), max_tokens=max_tokens, sampler=sampler
        )
    ]
    return timing(len(ids), started, stamps)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=f"python -m {WORKER_MODULE}",
        description="One rank of mlx-lm's ring pipeline (started by `cluster bench`).",
    )
    parser.add_argument("--worker", action="store_true", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--prompt-runs", required=True, help="JSON: [[token ids, sampled], ...]")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, required=True)
    parser.add_argument("--seed-base", type=int, default=0)
    worker(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
