"""`--diagnose`: where a step loses time (no decode benchmark)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks.gpu_bench.one_process import engine_decode, set_variant, warm_up
from benchmarks.gpu_bench.phase import recorded
from benchmarks.gpu_bench.split_step import idle_steps, split_steps
from benchmarks.gpu_bench.step_timing import (
    backbone_shapes,
    free_memory,
    graph_primitives,
    mlp_chain,
    mlx_lm_forward,
    qmm_micro,
    sync_latency,
)
from benchmarks.oracle_node import install_oracle, remove_oracle
from cluster.config import load_model_config
from cluster.decode.worker import MLXWorker
from cluster.model import few_row_matmul, gated_delta_kernel, row_padding
from cluster.model.loading import load_shard


async def _step_shapes(
    worker: MLXWorker, path: Path, prompt: tuple[int, ...], diag: dict[str, Any]
) -> None:
    """`diagnose`'s MLPs by rows and the backbone by step shape, under each fast-path kernel."""
    shard = await worker.run(load_shard, path, for_decoding=True)
    diag["mlp_chain"] = await worker.run(mlp_chain, shard)
    print(f"  MLPs by rows, chained and independent {json.dumps(diag['mlp_chain'])}", flush=True)
    # (key, padded, few-row kernel, recurrence kernel)
    backbones = [("backbone_ms", False, False, False), ("backbone_padded_ms", True, False, False)]
    if few_row_matmul.available():
        backbones.append(("backbone_few_row_ms", False, True, False))
    if gated_delta_kernel.available():
        backbones.append(("backbone_few_row_recurrence_kernel_ms", False, True, True))
    for key, pad, few_row, recurrence in backbones:
        pad_from = row_padding.PAD_FROM if pad else 0
        await worker.run(set_variant, shard, None, None, pad_from, few_row, recurrence)
        diag[key] = await worker.run(backbone_shapes, shard, prompt, 30, 5)
        primitives = diag[key.replace("_ms", "_primitives")] = await worker.run(
            graph_primitives, shard, prompt
        )
        print(f"  {key} {json.dumps(diag[key])}; primitives {json.dumps(primitives)}", flush=True)
    await worker.run(set_variant, shard, None, None, None, None)
    del shard
    await worker.run(free_memory)


def _pair_ms(halves: dict[str, float]) -> str:
    return f"{halves['head']:.2f} and {halves['tail']:.2f} ms"


async def diagnose(args, path: Path, prompt: tuple[int, ...], report: dict) -> None:
    """Where the verify step and the shard boundaries lose time (no decode benchmark)."""
    diag: dict[str, Any] = {}
    report["diagnose"] = diag
    worker = MLXWorker()
    diag["sync_latency_ms"] = await worker.run(sync_latency)
    config = load_model_config(path)
    if args.bits < 16:  # the quantized matmul by rows
        diag["qmm"] = await worker.run(qmm_micro, config, args.group_size, args.bits)
        print(f"  qmm {json.dumps(diag['qmm'])}", flush=True)
    if "shapes" not in args.skip:
        await _step_shapes(worker, path, prompt, diag)
    if "split" not in args.skip:
        diag["split_steps"] = await worker.run(
            split_steps, path, prompt, args.rounds, args.step_iters // 2
        )
        print(
            f"  two halves against the whole {json.dumps(diag['split_steps']['medians'])}; "
            f"over every 8 layers {json.dumps(diag['split_steps']['over_every'])}",
            flush=True,
        )
        await worker.run(free_memory)
    if "idle" not in args.skip:
        idle = diag["idle_steps"] = await worker.run(
            idle_steps, path, prompt, args.rounds, args.step_iters // 2
        )
        m, ratio = idle["medians"], idle["over_back_to_back"]
        after = "; ".join(
            f"{how} {_pair_ms(m[name])} ({ratio[name]['head']:.3f}x, {ratio[name]['tail']:.3f}x)"
            for name, how in (
                ("idle", "asleep"),
                ("busy", "spinning"),
                ("busy_without_gil", "spinning without the GIL"),
            )
        )
        print(
            f"  each half's step (head, tail) back to back {_pair_ms(m['back_to_back'])}; "
            f"after {idle['gap_ms']:.2f} ms {after}",
            flush=True,
        )
        await worker.run(free_memory)
    if "mlx_lm" not in args.skip:
        with recorded(diag, "mlx_lm_error"):
            diag["mlx_lm_forward"] = await worker.run(mlx_lm_forward, path, prompt, 30, 5)
            print(f"  mlx-lm forward {json.dumps(diag['mlx_lm_forward'])}", flush=True)
        await worker.run(free_memory)
    worker.close()
    if "local" in args.skip:
        return
    from cluster.decode.local_engine import open_local_engine
    from cluster.model.shard import even_ranges

    for parts in (1, 3):
        local = await open_local_engine(path, ranges=even_ranges(config.num_layers, parts))
        try:
            await warm_up(local.engine, prompt)
            row = {"mtp_off": await engine_decode(local.engine, prompt, args.tokens, 2, False)}
            previous = install_oracle(0.7, seed=3)
            try:
                row["mtp_on"] = await engine_decode(local.engine, prompt, args.tokens, 2, True)
            finally:
                remove_oracle(previous)
            diag[f"local_{parts}_shards"] = row
            print(
                f"  {parts} shard(s) in one process: off {row['mtp_off']['median_tps']:.1f}, "
                f"on {row['mtp_on']['median_tps']:.1f} tok/s",
                flush=True,
            )
        finally:
            await local.worker.run(free_memory)
            local.close()
