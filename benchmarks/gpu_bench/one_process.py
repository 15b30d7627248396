"""The engine in one process, each fast-path variant, and mlx-lm's `stream_generate`."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from benchmarks.common import median
from benchmarks.gpu_bench.step_timing import (
    breakdown,
    copy_bandwidth,
    free_memory,
    logits_check,
    step_times,
    weight_bytes,
)
from benchmarks.oracle_node import install_oracle, remove_oracle
from cluster.config import load_model_config
from cluster.decode.engine import GenerationEngine, GenerationRequest
from cluster.decode.pipeline import LocalPipeline
from cluster.decode.runner import ShardRunner
from cluster.decode.worker import MLXWorker
from cluster.messages import MtpDepth, RequestOptions
from cluster.model import row_padding
from cluster.model.cache import RequestCache
from cluster.model.fast_path import DecodeFastPath
from cluster.model.layers import Segment
from cluster.model.loading import load_shard
from cluster.model.shard import ModelShard


def mlx_lm_load(path: Path) -> tuple[nn.Module, Any]:
    """mlx-lm's `load` of the directory, its stop tokens cleared (every run decodes all of its
    tokens)."""
    from mlx_lm import load

    model, tokenizer = load(str(path))
    tokenizer.eos_token_ids = set()
    return model, tokenizer


def mlx_lm_run(model: nn.Module, tokenizer: Any, prompt: tuple[int, ...], tokens: int) -> dict:
    """One greedy `stream_generate`: decode tokens/s from its responses' time stamps, and
    the figure mlx-lm reports itself."""
    from mlx_lm import stream_generate

    stamps, last = [], None
    for response in stream_generate(model, tokenizer, list(prompt), max_tokens=tokens):
        stamps.append(time.perf_counter())
        last = response
    return {
        "tps": (len(stamps) - 1) / (stamps[-1] - stamps[0]),
        "reported": last.generation_tps if last else None,
    }


def mlx_lm_decode(path: Path, prompt: tuple[int, ...], tokens: int, repeats: int) -> dict:
    """mlx-lm's `load` + `stream_generate` (greedy) on the same directory."""
    t0 = time.perf_counter()
    model, tokenizer = mlx_lm_load(path)
    load_s = time.perf_counter() - t0
    mlx_lm_run(model, tokenizer, prompt, 16)
    runs = [mlx_lm_run(model, tokenizer, prompt, tokens) for _ in range(repeats)]
    tps = [r["tps"] for r in runs]
    return {
        "load_s": load_s,
        "decode_tps": tps,
        "median_tps": median(tps),
        "reported_generation_tps": [r["reported"] for r in runs],
    }


async def engine_decode(
    engine: GenerationEngine,
    prompt: tuple[int, ...],
    tokens: int,
    repeats: int,
    mtp: bool,
    depth: MtpDepth = 1,
) -> dict:
    """Decode tokens/s; in one process also the engine's time after the first token over the
    time its shards spent in those decode steps (`ShardRunner.run`, as their `StepCost`
    records it), both from the same runs: what the engine adds to its steps."""
    costs = [r.step_cost for r in getattr(engine.pipeline, "runners", [])]
    outs, over_steps = [], []
    for _ in range(repeats):
        request = GenerationRequest(prompt, tokens, RequestOptions(mtp=mtp, mtp_depth=depth))
        busy = sum(c.total_seconds for c in costs)
        outs.append(out := await engine.generate(request))
        busy = sum(c.total_seconds for c in costs) - busy
        if busy > 0 and out.generation_tps:
            over_steps.append((len(out.tokens) - 1) / out.generation_tps / busy)
    tps = [o.generation_tps for o in outs]
    drafted = sum(o.drafted for o in outs)
    return {
        "decode_tps": tps,
        "median_tps": median(tps),
        "tokens": [len(o.tokens) for o in outs],
        "acceptance": sum(o.accepted for o in outs) / drafted if drafted else None,
        "steps_per_token": None if not drafted else drafted / sum(len(o.tokens) for o in outs),
        "engine_over_steps": median(over_steps) if over_steps else None,
    }


# The decoding fast path in steps, each measured against the one before in the same process:
# (name, projections fused at load, compiled GatedDeltaNet recurrence, whole GatedDeltaNet
# layers compiled, the row count from which a step's stream is padded to 8 rows, 0: never
# (`cluster.model.row_padding`), the few-row quantized matmul kernel
# (`cluster.model.few_row_matmul`) for steps of up to 3 rows, the recurrence as one kernel
# (`cluster.model.gated_delta_kernel`)). `defaults` leaves every switch at this backend's
# default: what `cluster` runs (on CUDA the same as `+padded+few-row+recurrence`).
VARIANTS = (
    ("defaults", True, None, None, None, None, None),
    ("plain", False, False, False, 0, False, False),
    ("fused", True, False, False, 0, False, False),
    ("fused+compiled", True, True, False, 0, False, False),
    ("fused+compiled-layers", True, True, True, 0, False, False),
    ("fused+compiled-layers+padded", True, True, True, row_padding.PAD_FROM, False, False),
    ("fused+compiled-layers+padded2", True, True, True, 2, False, False),
    ("fused+compiled-layers+padded1", True, True, True, 1, False, False),
    ("fused+compiled-layers+padded+few-row", True, True, True, row_padding.PAD_FROM, True, False),
    ("fused+compiled-layers+padded+few-row+recurrence", True, True, True, row_padding.PAD_FROM,
     True, True),
)  # fmt: skip
WARM_BATCH_TOKENS = 32  # a short first batch before the timed ones (`_one_process_batches`)


def warm_tokens(args) -> int:
    """A warm-up decode's tokens: `WARM_BATCH_TOKENS`, or `--tokens` where that is fewer
    (what a warm-up pays for, traces and kernels, comes with the first tokens)."""
    return min(WARM_BATCH_TOKENS, args.tokens)


# What runs unless --variants names others: the product as it is. The sweep over the fast
# path's steps (`--variants plain,fused,...`) is a development tool, several minutes at 27B.
DEFAULT_VARIANTS = ("defaults",)


def set_variant(
    shard,
    compile_on: bool | None,
    layers_on: bool | None,
    pad_from: int | None,
    few_row: bool | None,
    recurrence_kernel: bool | None = None,
) -> None:
    """`shard` steps with a variant's fast path (`ModelShard.use_fast_path`): None leaves a
    part at the backend's default (whole compiled layers: as `compile_on`), `pad_from` 0: no
    padding; all None puts the default back."""
    default = DecodeFastPath.for_device()
    compile_on = default.compiled_steps if compile_on is None else compile_on
    shard.use_fast_path(
        DecodeFastPath(
            compiled_steps=compile_on,
            compiled_layers=compile_on if layers_on is None else layers_on,
            compiled_batches=compile_on,
            pad_rows_from=default.pad_rows_from if pad_from is None else (pad_from or None),
            few_row_kernel=default.few_row_kernel if few_row is None else few_row,
            recurrence_kernel=(
                default.recurrence_kernel if recurrence_kernel is None else recurrence_kernel
            ),
        )
    )


async def single_process(args, path: Path, prompt: tuple[int, ...], report: dict) -> None:
    """The one-process figures for each variant of the fast path (the last is the default on
    CUDA and is what the node phases run); `single` holds the last one's."""
    single: dict[str, Any] = {"variants": {}}
    report["single"] = single
    worker = MLXWorker()
    shard = None
    for name in args.variants:
        _, fuse_on, compile_on, layers_on, pad_from, few_row, recurrence = next(
            v for v in VARIANTS if v[0] == name
        )
        if shard is None or fuse_on != single.get("fused"):
            shard = runner = None
            await worker.run(free_memory)
            t0 = time.perf_counter()
            shard = await worker.run(load_shard, path, for_decoding=fuse_on)
            single["fused"] = fuse_on
            single["load_s"] = time.perf_counter() - t0
            single["weights"] = await worker.run(weight_bytes, shard)
            single["logits_check"] = await worker.run(logits_check, shard, prompt)
            print(f"  loaded in {single['load_s']:.1f} s; {single['logits_check']}", flush=True)
            if not single["logits_check"]["finite"]:
                raise RuntimeError("the random model's logits are not finite")
            if "bandwidth" not in single:
                bw_bytes = 1 << 30 if args.shape == "qwen3_5_27b" else 64 << 20
                single["bandwidth"] = await worker.run(copy_bandwidth, bw_bytes)
        await worker.run(set_variant, shard, compile_on, layers_on, pad_from, few_row, recurrence)
        runner = ShardRunner(shard)
        row: dict[str, Any] = {}
        row["steps"] = await worker.run(
            step_times, runner, prompt, args.step_iters, args.step_warmup, 0.7
        )
        row["breakdown"] = await worker.run(
            breakdown, shard, prompt, args.step_iters // 2, args.step_warmup
        )
        row["profile"] = await worker.run(build_profile, shard, prompt)
        pipeline = LocalPipeline([runner], worker, max_context=load_model_config(path).max_context)
        engine = GenerationEngine(pipeline)
        await warm_up(engine, prompt)
        row["mtp_off"] = await engine_decode(engine, prompt, args.tokens, args.repeats, mtp=False)
        row["mtp_on"] = {}
        last = name == args.variants[-1]
        for alpha in args.alphas if last else [0.7]:
            previous = install_oracle(alpha, seed=3)
            try:
                on = await engine_decode(engine, prompt, args.tokens, args.repeats, mtp=True)
            finally:
                remove_oracle(previous)
            on["over_off"] = on["median_tps"] / row["mtp_off"]["median_tps"]
            row["mtp_on"][str(alpha)] = on
        row["mtp_depths"] = {}
        for depth in args.mtp_depths:  # deeper drafts at alpha 0.7, each position drawn alike
            previous = install_oracle(0.7, seed=3)
            try:  # each step shape pays one-time costs first (kernels built, compiled traces)
                await engine_decode(engine, prompt, warm_tokens(args), 1, True, depth)
                on = await engine_decode(engine, prompt, args.tokens, args.repeats, True, depth)
            finally:
                remove_oracle(previous)
            on["over_off"] = on["median_tps"] / row["mtp_off"]["median_tps"]
            row["mtp_depths"][str(depth)] = on
            print(
                f"  {name}: MTP depth {depth}, a=0.7: {on['median_tps']:.1f} tok/s "
                f"({on['over_off']:.2f}x off)",
                flush=True,
            )
        if last and args.concurrent > 1:  # batching in one process, without the hops
            row.update(await _one_process_batches(args, worker, engine, prompt))
        single["variants"][name] = row
        st = row["steps"]
        print(
            f"  {name}: plain step {st['plain']['median_ms']:.2f} ms, verify "
            f"{st['verify']['median_ms']:.2f} ms ({st['verify_over_plain']:.2f}x); engine off "
            f"{row['mtp_off']['median_tps']:.1f}, on a=0.7 "
            f"{row['mtp_on']['0.7']['median_tps']:.1f} tok/s",
            flush=True,
        )
        del engine, pipeline
    single.update(single["variants"][args.variants[-1]])
    del shard, runner
    await worker.run(set_variant, None, None, None, None)
    await worker.run(free_memory)
    worker.close()


async def interleaved_variants(args, path: Path, prompt: tuple[int, ...], report: dict) -> None:
    """The fast path's variants (`--variants`, all with projections fused) side by side in
    `--interleave` rounds on one loaded shard, their order reversed every other round: each
    round measures the backbone at 1 and 2 positions, `ShardRunner.run`'s plain and verify
    steps, and the engine's MTP off and on (alpha 0.7, `--tokens` each). The host's speed
    drifts by a quarter within minutes (BENCHMARKS.md), which a variant measured after
    another takes for its own; so the figures to read are each round's ratio to the first
    variant, medians over the rounds."""
    chosen = [next(v for v in VARIANTS if v[0] == name) for name in args.variants]
    worker = MLXWorker()
    shard = await worker.run(load_shard, path, for_decoding=True)
    config = load_model_config(path)
    engine = GenerationEngine(
        LocalPipeline([ShardRunner(shard)], worker, max_context=config.max_context)
    )
    rows: dict[str, list[dict[str, float]]] = {v[0]: [] for v in chosen}
    report["interleaved"] = {"rounds": rows}
    for _, _, *switches in chosen:  # each variant's traces and kernels built, untimed
        await worker.run(set_variant, shard, *switches)
        await warm_up(engine, prompt)
        await worker.run(breakdown, shard, prompt, 2, 1)
    for r in range(args.interleave):
        for name, _, *switches in chosen if r % 2 == 0 else chosen[::-1]:
            await worker.run(set_variant, shard, *switches)
            parts = await worker.run(breakdown, shard, prompt, args.step_iters // 2, 3)
            steps = await worker.run(
                step_times, ShardRunner(shard), prompt, args.step_iters, 3, 0.7
            )
            off = await engine_decode(engine, prompt, args.tokens, 1, mtp=False)
            previous = install_oracle(0.7, seed=3)
            try:
                on = await engine_decode(engine, prompt, args.tokens, 1, mtp=True)
            finally:
                remove_oracle(previous)
            row = {
                "backbone_1tok_ms": parts["backbone_1tok"]["total_ms"],
                "backbone_2tok_ms": parts["backbone_2tok"]["total_ms"],
                "plain_ms": steps["plain"]["median_ms"],
                "verify_ms": steps["verify"]["median_ms"],
                "mtp_off_tps": off["median_tps"],
                "mtp_on_tps": on["median_tps"],
            }
            rows[name].append(row)
            print(f"  round {r + 1} {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()))
    base = rows[chosen[0][0]]
    summary = {}
    for name, runs in rows.items():
        summary[name] = {
            key: {
                "median": median([run[key] for run in runs]),
                "over_first": median([r[key] / b[key] for r, b in zip(runs, base, strict=True)]),
            }
            for key in runs[0]
        }
        summary[name]["verify_over_plain"] = median(
            [run["verify_ms"] / run["plain_ms"] for run in runs]
        )
    report["interleaved"]["summary"] = summary
    await worker.run(set_variant, shard, None, None, None, None)
    del engine, shard
    await worker.run(free_memory)
    worker.close()


async def _batch_at_alpha(
    worker: MLXWorker,
    engine: GenerationEngine,
    prompt: tuple[int, ...],
    tokens: int,
    requests: int,
    batch_compiled: bool,
) -> dict:
    """`concurrent_decode` with the oracle accepting at 0.7 and the batch path chosen."""
    (runner,) = engine.pipeline.runners
    default = runner.shard.fast_path
    chosen = dataclasses.replace(default, compiled_batches=batch_compiled)
    await worker.run(runner.shard.use_fast_path, chosen)
    previous = install_oracle(0.7, seed=3)
    try:
        return await concurrent_decode(engine, prompt, tokens, requests)
    finally:
        remove_oracle(previous)
        await worker.run(runner.shard.use_fast_path, default)


async def _one_process_batches(
    args, worker: MLXWorker, engine: GenerationEngine, prompt: tuple[int, ...]
) -> dict:
    """`--concurrent` requests at once in one process, with the batch's recurrence compiled
    per batch shape (the CUDA default) and as plain ops, alternated so that neither gains from
    going second. The first batch of each shape pays one-time costs (kernels built, buffers
    allocated: 45 tok/s against 140-193 warm in BENCHMARKS.md), so each path first
    decodes a short batch whose figure is kept apart as `first_batch`."""
    keys = {True: "concurrent_compiled", False: "concurrent"}
    first = {
        on: await _batch_at_alpha(worker, engine, prompt, warm_tokens(args), args.concurrent, on)
        for on in keys
    }
    runs: dict[bool, list[dict]] = {on: [] for on in keys}
    for on in (True, False, True, False):
        runs[on].append(
            await _batch_at_alpha(worker, engine, prompt, args.tokens, args.concurrent, on)
        )
        print(
            f"  one process, {args.concurrent} concurrent MTP on (batch recurrence compiled: "
            f"{on}): {runs[on][-1]['aggregate_tps']:.1f} tok/s",
            flush=True,
        )
    return {
        keys[on]: {
            "requests": args.concurrent,
            "runs": runs[on],
            "aggregate_tps": median([r["aggregate_tps"] for r in runs[on]]),
            "first_batch": first[on],
        }
        for on in keys
    }


def build_profile(shard: ModelShard, prompt: tuple[int, ...], steps: int = 20) -> dict:
    """Where building a one-token backbone step spends host time: cProfile over `steps`
    builds (each evaluated outside the profile), the top functions by own time."""
    import cProfile
    import pstats

    cache = RequestCache.for_layers(shard.linear_flags)
    cache.begin_step(0, len(prompt))
    mx.eval(shard(shard.embed(mx.array(prompt)[None]), [Segment(cache, len(prompt), len(prompt))]))
    profiler = cProfile.Profile()
    build = 0.0
    for i in range(steps + 2):
        tokens = mx.array([[7 + i]])
        t0 = time.perf_counter()
        if i >= 2:
            profiler.enable()
        cache.begin_step(0, 1)
        h = shard(shard.embed(tokens), [Segment(cache, 1, 1)])
        if i >= 2:
            profiler.disable()
            build += time.perf_counter() - t0
        mx.eval(h, cache.arrays())
    stats = pstats.Stats(profiler)
    rows = []
    for (file, line, fn), (_, calls, own, cumulative, _) in stats.stats.items():
        where = fn if file == "~" else f"{Path(file).name}:{line}({fn})"
        rows.append((own, cumulative, calls, where))
    rows.sort(reverse=True)
    return {
        "build_ms_profiled": build / steps * 1e3,
        "top_own_ms": [
            {"where": w, "own_ms": o / steps * 1e3, "cum_ms": c / steps * 1e3, "calls": n / steps}
            for o, c, n, w in rows[:15]
        ],
    }


async def warm_up(engine: GenerationEngine, prompt: tuple[int, ...]) -> None:
    for mtp in (False, True):
        await engine.generate(GenerationRequest(prompt, 16, RequestOptions(mtp=mtp)))


async def concurrent_decode(
    engine: GenerationEngine, prompt: tuple[int, ...], tokens: int, requests: int
) -> dict:
    """`requests` greedy MTP-on requests at once (prompts differing in their first token):
    the sum of their decode tokens/s while all of them run (they start together and decode
    the same number of tokens)."""
    vocab_prompts = [(prompt[0] + i, *prompt[1:]) for i in range(requests)]
    outs = await asyncio.gather(
        *(
            engine.generate(GenerationRequest(p, tokens, RequestOptions(mtp=True)))
            for p in vocab_prompts
        )
    )
    return {
        "requests": requests,
        "decode_tps": [o.generation_tps for o in outs],
        "aggregate_tps": sum(o.generation_tps for o in outs),
    }
