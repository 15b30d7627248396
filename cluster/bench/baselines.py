"""What the cluster is measured against, in the same run: mlx-lm on its own.

  mlx-lm  `mlx_lm.stream_generate` in this process, one request at a time: the speed of
          the model on one machine with no cluster around it
  ring    mlx-lm's own pipeline parallelism (`mlx.launch --backend ring`, every rank
          holding a share of the layers; `ring_baseline`) on the same hosts:
          for `--local N`, N ranks on this machine; for `--hosts FILE`, one rank on each
          host of the cluster file (`ring_hosts`)

Both decode the bench's own prompts (same lengths, same sampling; stop tokens ignored, so
every run generates exactly --max-tokens tokens) and report TTFT (prompt in, first token
out), decode tokens/s (tokens after the first over the time after the first) and prefill
tokens/s (prompt tokens / TTFT). Each scenario's figures are then also given as ratios to
them (`ratios`): over 1 means the cluster is faster (TTFT: slower, it is a time).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cluster.bench.metrics import timing
from cluster.bench.ring_baseline import run_ring
from cluster.bench.workload import SAMPLED_TEMPERATURE, Scenario
from cluster.hosts.clusterfile import ClusterFile

MEMORY_SHARE = 0.75  # the model "fits" a machine when its weights take at most this share
KINDS = ("mlx-lm", "ring")


def fits_this_machine(model_dir: Path) -> bool:
    from cluster.model.footprint import ModelFootprint
    from node.server import total_memory_bytes

    total = total_memory_bytes()
    return total == 0 or ModelFootprint.from_dir(model_dir).total_bytes <= MEMORY_SHARE * total


def runs_wanted(scenarios: Sequence[Scenario]) -> list[tuple[int, bool]]:
    """The (prompt length, sampled) pairs the scenarios use: one baseline run each."""
    return sorted({(s.prompt_tokens, s.sampled) for s in scenarios})


def mlx_lm_baseline(
    model_dir: Path,
    prompts: dict[int, tuple[int, ...]],
    runs: list[tuple[int, bool]],
    max_tokens: int,
    seed: int,
) -> dict[str, Any]:
    """`stream_generate` on each (prompt length, sampling) in this process."""
    import mlx.core as mx
    from mlx_lm import load, stream_generate
    from mlx_lm.sample_utils import make_sampler

    model, tokenizer = load(str(model_dir))
    tokenizer.eos_token_ids = set()  # generate exactly max_tokens, as the scenarios do

    def one(ids: tuple[int, ...], sampled: bool, tokens: int) -> dict[str, float]:
        mx.random.seed(seed)
        sampler = make_sampler(SAMPLED_TEMPERATURE if sampled else 0.0)
        started = time.perf_counter()
        stamps = [
            time.perf_counter()
            for _ in stream_generate(
                model, tokenizer, list(ids), max_tokens=tokens, sampler=sampler
            )
        ]
        return timing(len(ids), started, stamps)

    one(prompts[runs[0][0]][:16], True, 4)  # warm up
    out = []
    for length, sampled in runs:
        row = one(prompts[length], sampled, max_tokens)
        out.append({"prompt_tokens": length, "sampling": _sampling(sampled), **row})
    return {"description": "mlx_lm.stream_generate, one process, one request", "runs": out}


def ring_baseline(
    model_dir: Path,
    prompts: dict[int, tuple[int, ...]],
    runs: list[tuple[int, bool]],
    max_tokens: int,
    seed: int,
    ranks: int,
) -> dict[str, Any]:
    """mlx-lm's ring pipeline over `ranks` processes on this machine."""
    if ranks < 2:
        return {"skipped": "mlx-lm's ring pipeline needs at least 2 ranks"}
    report = run_ring(
        model_dir,
        [(list(prompts[length]), sampled) for length, sampled in runs],
        ranks=ranks,
        max_tokens=max_tokens,
        temperature=SAMPLED_TEMPERATURE,
        seed=seed,
    )
    out = [
        {"prompt_tokens": length, "sampling": _sampling(sampled), **row}
        for (length, sampled), row in zip(runs, report["runs"], strict=True)
    ]
    return {
        "description": f"mlx.launch --backend ring, {ranks} ranks on 127.0.0.1",
        "command": report["command"],
        "runs": out,
    }


def ring_hosts_baseline(
    cluster: ClusterFile,
    prompts: dict[int, tuple[int, ...]],
    runs: list[tuple[int, bool]],
    max_tokens: int,
    seed: int,
    pipeline: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """mlx-lm's ring pipeline with one rank on each host of the cluster file; an `error`
    (naming the host) or a `skipped` entry when it cannot run there. `pipeline`: the bench's
    `hardware` (the cluster's nodes, head first, with their hops): the ring then takes the
    links the pipeline streams over."""
    from cluster.bench.ring_hosts import (
        RingHostsError,
        probe_hosts,
        run_ring_on_hosts,
        why_it_does_not_fit,
    )
    from cluster.hosts.ssh import SSH

    if len(cluster.nodes) < 2:
        return {"skipped": "mlx-lm's ring pipeline needs at least 2 ranks: the file has 1 host"}
    ssh = SSH(cluster.ssh_config)
    try:
        hosts = probe_hosts(cluster, ssh, pipeline)
        if (reason := why_it_does_not_fit(cluster.model, hosts, MEMORY_SHARE)) is not None:
            return {"skipped": reason}
        report = run_ring_on_hosts(
            cluster,
            hosts,
            [(list(prompts[length]), sampled) for length, sampled in runs],
            max_tokens=max_tokens,
            seed=seed,
            temperature=SAMPLED_TEMPERATURE,
            ssh=ssh,
        )
    except RingHostsError as error:
        return {"error": f"mlx-lm's ring pipeline did not run on the hosts: {error}"}
    out = [
        {"prompt_tokens": length, "sampling": _sampling(sampled), **row}
        for (length, sampled), row in zip(runs, report["runs"], strict=True)
    ]
    return {
        "description": f"mlx-lm pipeline, ring backend, {len(hosts)} ranks: one on each host "
        f"of {cluster.path.name}",
        "command": "cluster hosts ring-rank on each host over ssh (MLX_RANK and MLX_HOSTFILE "
        "as mlx.launch --backend ring sets them)",
        "hosts": report["hosts"],
        "runs": out,
    }


def ratios(scenario: dict[str, Any], baseline: dict[str, Any]) -> dict[str, float | None]:
    """The scenario's figures over the baseline run of the same prompt length and sampling."""
    settings = scenario["settings"]
    match = [
        r
        for r in baseline.get("runs", [])
        if r["prompt_tokens"] == settings["prompt_tokens"] and r["sampling"] == settings["sampling"]
    ]
    if not match:
        return {}
    base, m = match[0], scenario["metrics"]

    def over(value: float | None, reference: float) -> float | None:
        return value / reference if value is not None and reference else None

    return {
        "output_throughput": over(m["output_throughput"], base["decode_tps"]),
        "per_stream_throughput": over(m["per_stream_throughput"], base["decode_tps"]),
        "median_ttft_ms": over(m["median_ttft_ms"], base["ttft_ms"]),
        "prefill_throughput": over(m["prefill_throughput"], base["prefill_tps"]),
    }


def _sampling(sampled: bool) -> str:
    return "sampled" if sampled else "greedy"
