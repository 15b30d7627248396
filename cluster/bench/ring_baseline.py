"""mlx-lm's own pipeline parallelism on loopback: the baseline of our node pipeline.

    python -m cluster.bench.ring_baseline [--json OUT] [--ranks 2] [--max-tokens 128]

Launches `mlx.launch --backend ring -n RANKS --hosts 127.0.0.1 -- python -m
cluster.bench.ring_baseline --worker ...`: every rank loads its share of the layers with
mlx-lm's `sharded_load` (`model.model.pipeline(group)`: rank 0 holds the last layers) and
runs mlx-lm's `stream_generate` on the same prompts with the same seeds; each decode step
sends the hidden state down the ring and all-gathers the last one. Rank 0 reports decode
tokens/s (tokens after the first over the time after the first, as `engine_bench` measures;
stop tokens ignored so every run decodes --max-tokens tokens).

`pipeline_bench` runs this between its rounds and reports our 2-node pipeline over it. The
worker also runs each rank of `cluster bench --hosts FILE --baseline ring`, one per host of
the cluster file (`cluster.bench.ring_hosts`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import (
    CODE_PROMPTS,
    SAMPLED_TEMPERATURE,
    bench_parser,
    default_model,
    free_port,
    machine,
    median,
    stop,
    write_json,
)

LAUNCH_TIMEOUT_S = 300


def launcher_path() -> str:
    """The `mlx.launch` script of this interpreter's environment."""
    beside = Path(sys.executable).parent / "mlx.launch"
    return str(beside) if beside.exists() else "mlx.launch"


def run_ring(
    model_dir: Path,
    *,
    ranks: int = 2,
    max_tokens: int = 128,
    prompts: int = len(CODE_PROMPTS),
    temperature: float = SAMPLED_TEMPERATURE,
    seed_base: int = 0,
    launcher: str = "mlx.launch",
    timeout_s: float = LAUNCH_TIMEOUT_S,
    prompt_runs: list[tuple[list[int], bool]] | None = None,
) -> dict:
    """Run the ring and return rank 0's report; raises RuntimeError with the ranks' output
    when it does not run.

    launcher "mlx.launch": `mlx.launch --backend ring -n RANKS --hosts 127.0.0.1`, as a
    user would. "direct": the same ranks with the same environment (MLX_RANK, and
    MLX_HOSTFILE holding the ring's addresses, as mlx.launch writes it), started here with
    their output going to files: mlx.launch relays the ranks' output in a loop that never
    sleeps (its select() always finds the ranks' stdin writable), which takes most of a core,
    a handicap on a 2-core machine that the ring itself does not have.
    """
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rank0.json"
        worker = [
            sys.executable, "-m", "cluster.bench.ring_baseline", "--worker",
            "--out", str(out), "--model", str(model_dir), "--max-tokens", str(max_tokens),
            "--prompts", str(prompts), "--temperature", str(temperature),
            "--seed-base", str(seed_base),
        ]  # fmt: skip
        if prompt_runs is not None:  # `cluster bench`'s prompts: (ids, sampled) per run
            runs_file = Path(tmp) / "runs.json"
            runs_file.write_text(json.dumps(prompt_runs))
            worker += ["--prompt-runs", str(runs_file)]
        port = free_port()
        if launcher == "mlx.launch":
            command = [launcher_path(), "--backend", "ring", "-n", str(ranks), "--hosts",
                       "127.0.0.1", "--starting-port", str(port), "--", *worker]  # fmt: skip
            proc = subprocess.run(
                command, capture_output=True, text=True, timeout=timeout_s, cwd=os.getcwd()
            )
            output = f"exit {proc.returncode}\nstdout: {proc.stdout[-2000:]}\n" \
                     f"stderr: {proc.stderr[-2000:]}"  # fmt: skip
            shown = " ".join(command[:9]) + " -- python -m cluster.bench.ring_baseline --worker"
        elif launcher == "direct":
            output = _run_direct(worker, ranks, port, Path(tmp), timeout_s)
            shown = f"{ranks} ranks started directly, MLX_HOSTFILE as mlx.launch writes it"
        else:
            raise ValueError(f"unknown launcher {launcher!r}")
        if not out.exists():
            raise RuntimeError(f"the ring did not run ({shown}): {output}")
        report = json.loads(out.read_text())
    return report | {"launcher": launcher, "command": shown}


def _run_direct(worker: list[str], ranks: int, port: int, tmp: Path, timeout_s: float) -> str:
    hostfile = tmp / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{port + r}"] for r in range(ranks)]))
    procs, logs = [], []
    try:
        for rank in range(ranks):
            log = open(tmp / f"rank{rank}.log", "w")  # noqa: SIM115 - closed below
            logs.append(log)
            env = {**os.environ, "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile)}
            procs.append(subprocess.Popen(worker, env=env, stdout=log, stderr=log))
        deadline = time.monotonic() + timeout_s
        for proc in procs:
            proc.wait(timeout=max(deadline - time.monotonic(), 1))
    except subprocess.TimeoutExpired:
        pass
    finally:
        stop(procs)
        for log in logs:
            log.close()
    codes = [p.returncode for p in procs]
    tails = [(tmp / f"rank{r}.log").read_text()[-1500:] for r in range(ranks)]
    return f"exit codes {codes}\n" + "\n".join(f"rank {r}: {t}" for r, t in enumerate(tails))


def worker(args) -> None:
    """One rank: load its layers, decode the prompts, rank 0 writes the figures."""
    import mlx.core as mx
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler
    from mlx_lm.utils import sharded_load

    from benchmarks.common import encode

    # One group: ops given no group use the default ("any") one, and a second ring group
    # on the same ports breaks the first (connection lost mid-run).
    group = mx.distributed.init()
    if group.size() < 2:
        raise RuntimeError("not launched as a distributed job (use mlx.launch)")
    t0 = time.perf_counter()
    model, tokenizer = sharded_load(str(args.model), pipeline_group=group)
    load_s = time.perf_counter() - t0
    tokenizer.eos_token_ids = set()
    prompts = [encode(tokenizer, p) for p in CODE_PROMPTS[: args.prompts]]

    def decode(ids, max_tokens: int, seed: int) -> float:
        mx.random.seed(seed)
        stamps = []
        sampler = make_sampler(args.temperature)
        for _ in stream_generate(
            model, tokenizer, list(ids), max_tokens=max_tokens, sampler=sampler
        ):
            stamps.append(time.perf_counter())
        return (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else 0.0

    decode(prompts[0], 16, 0)  # warm up
    if args.prompt_runs:
        runs = bench_runs(model, tokenizer, json.loads(Path(args.prompt_runs).read_text()), args)
        tps = [run["decode_tps"] for run in runs]
    else:
        tps = [decode(ids, args.max_tokens, args.seed_base + p) for p, ids in enumerate(prompts)]
    # A last collective: neither rank exits while the other still runs the step that
    # mlx-lm's generator computes ahead (exiting early breaks the peer's sockets).
    mx.eval(mx.distributed.all_sum(mx.array(1.0), stream=mx.cpu))
    if group.rank() == 0:
        model_layers = model.model
        Path(args.out).write_text(
            json.dumps(
                {
                    "ranks": group.size(),
                    "rank0_layers": [model_layers.start_idx, model_layers.end_idx],
                    "load_s": load_s,
                    "max_tokens": args.max_tokens,
                    "temperature": args.temperature,
                    "decode_tps": tps,
                    "median_tps": median(tps),
                    "runs": runs if args.prompt_runs else None,
                }
            )
        )


def bench_runs(model, tokenizer, prompt_runs: list, args) -> list[dict]:
    """`cluster bench`'s (ids, sampled) runs: TTFT and decode tokens/s of each, timed as
    `cluster.bench.baselines.timing` does for mlx-lm in one process."""
    import mlx.core as mx
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    from cluster.bench.baselines import timing

    out = []
    for ids, sampled in prompt_runs:
        mx.random.seed(args.seed_base)
        sampler = make_sampler(args.temperature if sampled else 0.0)
        started = time.perf_counter()
        stamps = [
            time.perf_counter()
            for _ in stream_generate(
                model, tokenizer, list(ids), max_tokens=args.max_tokens, sampler=sampler
            )
        ]
        out.append(timing(len(ids), started, stamps))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser("ring_baseline", __doc__)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=len(CODE_PROMPTS))
    parser.add_argument("--temperature", type=float, default=SAMPLED_TEMPERATURE)
    parser.add_argument("--seed-base", type=int, default=0)
    parser.add_argument("--launcher", choices=("mlx.launch", "direct"), default="mlx.launch")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--prompt-runs", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.model = args.model or default_model()
    if args.worker:
        worker(args)
        return 0
    try:
        report = run_ring(
            args.model,
            ranks=args.ranks,
            max_tokens=args.max_tokens,
            prompts=args.prompts,
            temperature=args.temperature,
            seed_base=args.seed_base,
            launcher=args.launcher,
        )
    except (RuntimeError, subprocess.TimeoutExpired) as error:
        print(f"mlx-lm ring pipeline did not run: {error}")
        write_json(args.json, {"benchmark": "ring_baseline", "error": str(error)})
        return 1
    print(
        f"mlx-lm pipeline, ring backend, {report['ranks']} ranks on 127.0.0.1 "
        f"({report['launcher']}): "
        f"{report['median_tps']:.1f} decode tokens/s (median of {len(report['decode_tps'])} "
        f"prompts, {report['max_tokens']} tokens, temperature {report['temperature']})"
    )
    write_json(args.json, {"benchmark": "ring_baseline", "machine": machine(), **report})
    return 0


if __name__ == "__main__":
    sys.exit(main())
