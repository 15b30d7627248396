"""GPU figures at a real model's shape with random weights: one process, N nodes, mlx-lm.

    python -m cluster.bench.gpu_bench --shape qwen3_5_27b --bits 4 --json $OUT/gpu.json
    python -m cluster.bench.gpu_bench --shape tiny --json /tmp/gpu-tiny.json   # CPU smoke run

1. Writes a random-weight checkpoint of the shape (Qwen3.5-27B: 64 layers, hidden 5120, vocab
   248320, untied lm_head, one MTP layer; `cluster.bench.random_checkpoint`). The logits of a
   prompt are checked to be finite.
2. In this process, on one MLX worker thread: the copy bandwidth; `ShardRunner.run` over the
   whole model for a plain one-token step and for a verify step `[y, d]` (MTP head included),
   medians of synchronised steps after warm-up, and a breakdown (graph building vs evaluation of
   the backbone, lm_head, MTP head); then decode tokens/s through the engine with MTP off, and
   on with the acceptance oracle of `cluster.bench.oracle_node` (each draft accepted with
   probability alpha: random weights make real acceptance meaningless, the oracle keeps every
   real cost: MTP head, 2-token step, snapshots, rollbacks); then mlx-lm's `stream_generate` on
   the same directory.
3. 2 and 3 local node processes on the same device (`python -m cluster.bench.oracle_node`),
   driven through `node.client.open_remote_engine`: decode tokens/s with MTP off and on, as
   ratios to the single-process engine of the same run.
4. mlx-lm's own pipeline (`model.model.pipeline(group)`) under `mlx.launch --backend ring` with
   2 ranks on 127.0.0.1; if it fails as is, the exact error is recorded and it runs again with
   its send/recv/all_gather on the CPU stream (the ring backend's own implementation).

`--interleave N` measures the fast path's `--variants` side by side instead, in N rounds on one
loaded shard with their order reversed every other round (the host drifts within minutes);
`--diagnose` measures where a step loses time, the primitives of its graph among them.

Decode tokens/s is tokens after the first over the time after the first (the engine's
`generation_tps`; for mlx-lm the same quantity from its responses' time stamps). Greedy; stop
tokens ignored, so every run decodes exactly --tokens tokens. Phases that would not finish
before --deadline-s are skipped and say so; the JSON is rewritten after every phase.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import random
import re
import secrets
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from cluster.bench.common import bench_parser, free_port, machine, median, spread, write_json
from cluster.bench.nodes import NodeSnapshot
from cluster.bench.nodes import breakdown as node_breakdown
from cluster.bench.oracle_node import add_node_options, install_oracle, remove_oracle
from cluster.bench.random_checkpoint import SHAPES, bench_prompt, default_dir, write_checkpoint
from cluster.bench.split_step import idle_steps, split_steps
from cluster.config import ModelConfig, load_model_config
from cluster.decode.engine import GenerationEngine, GenerationRequest
from cluster.decode.pipeline import LocalPipeline
from cluster.decode.runner import ShardRunner
from cluster.decode.worker import MLXWorker
from cluster.messages import MtpDepth, RequestOptions, StepRequest, parse_mtp_depth
from cluster.model import (
    compiled,
    few_row_matmul,
    gated_delta_kernel,
    row_padding,
    tensor_core_matmul,
)
from cluster.model import shard as model_shard
from cluster.model.cache import RequestCache
from cluster.model.layers import Segment
from cluster.model.loading import load_shard
from cluster.model.shard import ModelShard
from cluster.wire import step_phases_ms

REPO = Path(__file__).resolve().parents[2]


# ---- measurements on the MLX worker thread -------------------------------------------------


def _ms(values: list[float]) -> dict:
    lo, hi = spread(values)
    return {"median_ms": median(values) * 1e3, "q1_ms": lo * 1e3, "q3_ms": hi * 1e3}


def copy_bandwidth(nbytes: int, iters: int = 10) -> dict:
    """Device copy bandwidth (bytes read + written per second) of a bf16 elementwise op."""
    x = mx.random.uniform(shape=(nbytes // 2,)).astype(mx.bfloat16)
    mx.eval(x)
    times = []
    for _ in range(iters + 2):
        t0 = time.perf_counter()
        mx.eval(x * 1.5)
        times.append(time.perf_counter() - t0)
    t = median(times[2:])
    return {"bytes": nbytes, "ms": t * 1e3, "gb_per_s": 2 * nbytes / t / 1e9}


def weight_bytes(shard: ModelShard) -> dict:
    def size(module: nn.Module) -> int:
        return sum(v.nbytes for _, v in tree_flatten(module.parameters()))

    return {
        "layers": sum(size(layer) for layer in shard.layers),
        "lm_head": size(shard.lm_head),
        "embed_tokens": size(shard.embed_tokens),
        "mtp_head": size(shard.mtp) if shard.has_mtp else 0,
        "total": size(shard),
    }


def logits_check(shard: ModelShard, prompt: tuple[int, ...]) -> dict:
    cache = RequestCache.for_layers(shard.linear_flags)
    cache.begin_step(0, len(prompt))
    hidden = shard(shard.embed(mx.array(prompt)[None]), [Segment(cache, len(prompt), len(prompt))])
    logits = shard.logits(shard.norm(hidden[:, -1])).astype(mx.float32)
    mx.eval(hidden, logits)
    last = hidden[0, -1].astype(mx.float32)
    return {
        "finite": bool(mx.isfinite(logits).all().item() and mx.isfinite(hidden).all().item()),
        "hidden_rms": float(mx.sqrt(mx.mean(last * last)).item()),
        "logits_std": float(mx.std(logits).item()),
    }


def step_times(
    runner: ShardRunner, prompt: tuple[int, ...], iters: int, warmup: int, alpha: float
) -> dict:
    """`ShardRunner.run` over the whole model: plain one-token steps (MTP off) and verify
    steps [y, d] with the tail's own drafts (MTP on, the oracle deciding at `alpha`)."""
    out: dict[str, Any] = {}
    lookahead, runner.lookahead = runner.lookahead, False  # a step's own time, not overlapped
    try:
        _plain_and_verify_steps(runner, prompt, iters, warmup, alpha, out)
    finally:
        runner.lookahead = lookahead
    out["verify_over_plain"] = out["verify"]["median_ms"] / out["plain"]["median_ms"]
    return out


def _plain_and_verify_steps(
    runner: ShardRunner, prompt: tuple[int, ...], iters: int, warmup: int, alpha: float, out: dict
) -> None:
    res = runner.run([StepRequest("plain", prompt, 0, options=RequestOptions(mtp=False))])
    y, position = res.results[0].tokens[-1], len(prompt)
    times = []
    for _ in range(warmup + iters):
        t0 = time.perf_counter()
        r = runner.run([StepRequest("plain", (y,), position)]).results[0]
        times.append(time.perf_counter() - t0)
        y, position = r.tokens[-1], position + r.keep
    runner.release("plain")
    out["plain"] = _ms(times[warmup:])

    previous = install_oracle(alpha, seed=1)
    try:
        res = runner.run([StepRequest("verify", prompt, 0, options=RequestOptions(mtp=True))])
        r = res.results[0]
        y, draft, position, rollback = r.tokens[-1], r.drafts[0], len(prompt), 0
        times, accepted = [], 0
        for k in range(warmup + iters):
            step = StepRequest("verify", (y, draft), position, draft_len=1, rollback=rollback)
            t0 = time.perf_counter()
            r = runner.run([step]).results[0]
            times.append(time.perf_counter() - t0)
            accepted += r.accepted if k >= warmup else 0
            y, draft = r.tokens[-1], r.drafts[0]
            position, rollback = position + r.keep, 2 - r.keep
        runner.release("verify")
    finally:
        remove_oracle(previous)
    out["verify"] = _ms(times[warmup:])
    out["verify_acceptance"] = accepted / iters


def breakdown(shard: ModelShard, prompt: tuple[int, ...], iters: int, warmup: int) -> dict:
    """Where a step's time goes: building the backbone's graph (Python) vs evaluating it, for
    1 and 2 positions; lm_head + argmax of one row; the MTP head over one pair + its lm_head."""
    rng = random.Random(2)
    vocab = shard.embed_tokens.weight.shape[0]
    cache = RequestCache.for_layers(shard.linear_flags)
    cache.begin_step(0, len(prompt))
    x = shard.embed(mx.array(prompt)[None])
    last = shard(x, [Segment(cache, len(prompt), len(prompt))])[:, -1:]
    mx.eval(last, cache.arrays())
    out: dict[str, Any] = {}
    for length in (1, 2):
        build, total = [], []
        for _ in range(warmup + iters):
            tokens = mx.array([rng.randrange(vocab) for _ in range(length)])[None]
            t0 = time.perf_counter()
            cache.begin_step(0, length)
            h = shard(shard.embed(tokens), [Segment(cache, length, 1)])
            t1 = time.perf_counter()
            mx.eval(h, cache.arrays())
            t2 = time.perf_counter()
            build.append(t1 - t0)
            total.append(t2 - t0)
        out[f"backbone_{length}tok"] = {
            "build_ms": median(build[warmup:]) * 1e3,
            "total_ms": median(total[warmup:]) * 1e3,
        }
    out["lm_head_argmax_ms"] = _timed(
        lambda: mx.argmax(shard.logits(shard.norm(last[:, -1])), axis=-1), iters, warmup
    )
    if shard.has_mtp:
        mtp_cache = RequestCache.for_layers([False] * len(shard.mtp.layers))

        def mtp_step() -> mx.array:
            mtp_cache.begin_step(0, 1)
            token = mx.array([[rng.randrange(vocab)]])
            h = shard.mtp(shard.embed(token), last, [Segment(mtp_cache, 1, 1)])
            return [mx.argmax(shard.logits(h[:, -1]), axis=-1), *mtp_cache.arrays()]

        out["mtp_head_ms"] = _timed(mtp_step, iters, warmup)
    return out


def backbone_shapes(shard: ModelShard, prompt: tuple[int, ...], iters: int, warmup: int) -> dict:
    """The backbone's step time by (positions, confirmed): (2, 2) runs the GatedDeltaNet
    recurrence in one piece, (2, 1) splits it at the draft as a verify step does."""
    rng = random.Random(4)
    vocab = shard.embed_tokens.weight.shape[0]
    cache = RequestCache.for_layers(shard.linear_flags)
    cache.begin_step(0, len(prompt))
    mx.eval(shard(shard.embed(mx.array(prompt)[None]), [Segment(cache, len(prompt), len(prompt))]))
    out = {}
    for length, confirmed in ((1, 1), (2, 2), (2, 1), (4, 4), (8, 8)):
        times = []
        for _ in range(warmup + iters):
            tokens = mx.array([rng.randrange(vocab) for _ in range(length)])[None]
            t0 = time.perf_counter()
            cache.begin_step(0, length)
            h = shard(shard.embed(tokens), [Segment(cache, length, confirmed)])
            mx.eval(h, cache.arrays())
            times.append(time.perf_counter() - t0)
        out[f"{length}x{confirmed}"] = median(times[warmup:]) * 1e3
    return out


def graph_primitives(shard: ModelShard, prompt: tuple[int, ...]) -> dict[str, int]:
    """The primitives in the graph of a backbone step of one request, one position and a
    verify step's two (one of them a draft), under the switches set now: the graph built whole
    (no `async_eval` partway) and counted in `mx.export_to_dot`'s output. MLX dispatches each
    of them on the host at every step, a few microseconds each on CUDA."""
    cache = RequestCache.for_layers(shard.linear_flags)
    cache.begin_step(0, len(prompt))
    mx.eval(shard(shard.embed(mx.array(prompt)[None]), [Segment(cache, len(prompt), len(prompt))]))
    counts = {}
    every, model_shard.ASYNC_EVAL_EVERY = model_shard.ASYNC_EVAL_EVERY, len(shard.layers) + 1
    try:
        with tempfile.TemporaryDirectory() as tmp:
            dot = Path(tmp) / "step.dot"
            for length in (1, 2):
                cache.begin_step(0, length)
                h = shard(shard.embed(mx.array([[7] * length])), [Segment(cache, length, 1)])
                outputs = [h, *cache.arrays()]
                mx.export_to_dot(str(dot), *outputs)
                counts[f"{length}x1"] = dot.read_text().count("shape=rectangle")  # primitives
                mx.eval(outputs)
    finally:
        model_shard.ASYNC_EVAL_EVERY = every
    return counts


def qmm_micro(
    config: ModelConfig, group_size: int, bits: int, copies: int = 8, iters: int = 20
) -> dict:
    """The quantized matmul by rows M and output size N, MLX's (`mlx_*`) and, where they run,
    the few-row kernel (`kernel_*`, `cluster.model.few_row_matmul`) and from 4 rows at 4 bits
    the tensor-core one (`tensor_core_*`, `cluster.model.tensor_core_matmul`): ms per call and
    weight GB/s over `copies` distinct weights, so that they do not sit in L2, as independent calls
    (throughput: `mlp_chain` has the latency of a chain). The kernel's largest error against
    MLX relative to the output's largest value, and whether each of its rows equals the
    one-row call bit for bit. Shapes (N, K) of the model's projections, and N = 16384 (MLX
    CUDA's bound for its one-row kernel on sm90) when the MLP is wider than that."""
    t = config.text
    qkv = 2 * t.linear_num_key_heads * t.linear_key_head_dim
    qkv += t.linear_num_value_heads * t.linear_value_head_dim
    shapes = {
        "mlp_up": (t.intermediate_size, t.hidden_size),
        "mlp_down": (t.hidden_size, t.intermediate_size),
        "gdn_qkv": (qkv, t.hidden_size),
    }
    if t.intermediate_size > 16384:
        shapes["n16384"] = (16384, t.hidden_size)
    out: dict[str, Any] = {}
    for name, (n, k) in shapes.items():
        weights = [
            mx.quantize(
                (0.02 * mx.random.normal((n, k))).astype(mx.bfloat16),
                group_size=group_size,
                bits=bits,
            )
            for _ in range(copies)
        ]
        mx.eval(weights)
        out[f"{name} {n}x{k}"] = _qmm_row(weights, k, group_size, bits, iters)
        mx.clear_cache()
    return out


def _qmm_row(weights: list, k: int, group_size: int, bits: int, iters: int) -> dict:
    nbytes = sum(a.nbytes for a in weights[0])
    kernel = few_row_matmul.available() and bits in few_row_matmul.BITS

    def mlx(x: mx.array, w: tuple) -> mx.array:
        return mx.quantized_matmul(x, *w, transpose=True, group_size=group_size, bits=bits)

    def ours(x: mx.array, w: tuple) -> mx.array:
        return few_row_matmul.few_row_quantized_matmul(x, *w, group_size=group_size, bits=bits)

    def tensor_cores(x: mx.array, w: tuple) -> mx.array:
        return tensor_core_matmul.tensor_core_quantized_matmul(x, *w, group_size=group_size)

    row: dict[str, Any] = {}
    for m in (1, 2, 3, 4, 8, 16, 32):
        x = mx.random.normal((m, k)).astype(mx.bfloat16)
        variants = [("mlx", mlx)]
        if kernel:
            variants.append(("kernel", ours))
            if tensor_core_matmul.takes(m, k, bits):
                variants.append(("tensor_core", tensor_cores))
        for label, fn in variants:
            t = _timed(lambda x=x, fn=fn: [fn(x, w) for w in weights], iters, 3) / len(weights)
            row[f"{label}_M{m}_ms"] = t
            row[f"{label}_M{m}_gb_per_s"] = nbytes / t / 1e6
        if kernel:
            reference, got = mlx(x, weights[0]), ours(x, weights[0])
            alone = mx.concatenate([ours(x[i : i + 1], weights[0]) for i in range(m)])
            scale = mx.abs(reference).max()
            row[f"kernel_M{m}_rel_err"] = (mx.abs(got - reference).max() / scale).item()
            row[f"kernel_M{m}_rows_alone_equal"] = mx.array_equal(got, alone).item()
    return row


def mlp_chain(shard: ModelShard, iters: int = 15) -> dict:
    """The shard's MLPs by rows M (ms per layer), run as a model runs them, each layer's input
    the previous one's output, and as independent calls on one input; with MLX's quantized
    matmul, and with the project's kernels (`kernel_*`: the few-row kernel for 1-3 rows, the
    tensor-core one from 4 rows at 4 bits) where they run. Independent calls may
    overlap on the device (MLX CUDA records a step as a graph), so `qmm_micro`'s cost per
    call is throughput; the chain's is the latency a step pays."""
    layers = shard.layers[: min(32, len(shard.layers))]

    def chain(x: mx.array) -> mx.array:
        for layer in layers:
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return x

    out: dict[str, Any] = {}
    for kernel in (False, True) if few_row_matmul.available() else (False,):
        few_row_matmul.set_enabled(kernel)  # the layers are `FewRowQuantizedLinear`s on CUDA
        label = "kernel_" if kernel else ""
        for m in (1, 2, 3, 4, 8, 16, 32):
            x = mx.random.normal((1, m, shard.hidden_size)).astype(mx.bfloat16)
            out[f"{label}chain_M{m}_ms"] = _timed(lambda x=x: chain(x), iters, 3) / len(layers)
            out[f"{label}independent_M{m}_ms"] = _timed(
                lambda x=x: [layer.mlp(x) for layer in layers], iters, 3
            ) / len(layers)
    few_row_matmul.set_enabled(None)
    return out


def sync_latency(iters: int = 50) -> float:
    """A trivial graph's evaluation: the fixed cost of one synchronising eval."""
    a = mx.zeros((16,))
    mx.eval(a)
    return _timed(lambda: a + 1, iters, 5)


def mlx_lm_forward(path: Path, prompt: tuple[int, ...], iters: int, warmup: int) -> dict:
    """mlx-lm's own forward of 1, 2 and 4 tokens on a warm cache (its recurrence unsplit)."""
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    model, _ = load(str(path))
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array(prompt)[None], cache=cache))
    out = {}
    for n in (1, 2, 4):
        x = mx.array(prompt[:n])[None]
        out[f"{n}tok_ms"] = _timed(lambda x=x: model(x, cache=cache)[:, -1], iters, warmup)
    return out


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
        await worker.run(_set_variant, None, None, pad_from, few_row, recurrence)
        diag[key] = await worker.run(backbone_shapes, shard, prompt, 30, 5)
        primitives = diag[key.replace("_ms", "_primitives")] = await worker.run(
            graph_primitives, shard, prompt
        )
        print(f"  {key} {json.dumps(diag[key])}; primitives {json.dumps(primitives)}", flush=True)
    await worker.run(_set_variant, None, None, None, None)
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
        with _recorded(diag, "mlx_lm_error"):
            diag["mlx_lm_forward"] = await worker.run(mlx_lm_forward, path, prompt, 30, 5)
            print(f"  mlx-lm forward {json.dumps(diag['mlx_lm_forward'])}", flush=True)
        await worker.run(free_memory)
    worker.close()
    if "local" in args.skip:
        return
    from cluster.local import even_ranges, open_local_engine

    for parts in (1, 3):
        local = await open_local_engine(path, ranges=even_ranges(config.num_layers, parts))
        try:
            await _warm_up(local.engine, prompt)
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


def _timed(fn: Callable[[], Any], iters: int, warmup: int) -> float:
    times = []
    for _ in range(warmup + iters):
        t0 = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t0)
    return median(times[warmup:]) * 1e3


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


def free_memory() -> None:
    gc.collect()
    mx.clear_cache()


# ---- the engine: one process, N node processes ---------------------------------------------


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


def _set_variant(
    compile_on: bool | None,
    layers_on: bool | None,
    pad_from: int | None,
    few_row: bool | None,
    recurrence_kernel: bool | None = None,
) -> None:
    """A variant's switches; None leaves (or puts back) a switch at the backend's default."""
    compiled.set_enabled(compile_on)
    compiled.set_layers_enabled(layers_on)
    few_row_matmul.set_enabled(few_row)
    gated_delta_kernel.set_enabled(recurrence_kernel)
    if pad_from is None:
        row_padding.set_enabled(None)
    else:
        row_padding.set_enabled(pad_from > 0, from_rows=max(pad_from, 1))


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
        await worker.run(_set_variant, compile_on, layers_on, pad_from, few_row, recurrence)
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
        await _warm_up(engine, prompt)
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
    await worker.run(_set_variant, None, None, None, None)
    await worker.run(free_memory)
    worker.close()


async def interleaved_variants(args, path: Path, prompt: tuple[int, ...], report: dict) -> None:
    """The fast path's variants (`--variants`, all with projections fused) side by side in
    `--interleave` rounds on one loaded shard, their order reversed every other round: each
    round measures the backbone at 1 and 2 positions, `ShardRunner.run`'s plain and verify
    steps, and the engine's MTP off and on (alpha 0.7, `--tokens` each). The host's speed
    drifts by a quarter within minutes (BENCHMARKS.md, run V), which a variant measured after
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
        await worker.run(_set_variant, *switches)
        await _warm_up(engine, prompt)
        await worker.run(breakdown, shard, prompt, 2, 1)
    for r in range(args.interleave):
        for name, _, *switches in chosen if r % 2 == 0 else chosen[::-1]:
            await worker.run(_set_variant, *switches)
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
    del engine, shard
    await worker.run(_set_variant, None, None, None, None)
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
    await worker.run(compiled.set_batches_enabled, batch_compiled)
    previous = install_oracle(0.7, seed=3)
    try:
        return await concurrent_decode(engine, prompt, tokens, requests)
    finally:
        remove_oracle(previous)
        await worker.run(compiled.set_batches_enabled, None)


async def _one_process_batches(
    args, worker: MLXWorker, engine: GenerationEngine, prompt: tuple[int, ...]
) -> dict:
    """`--concurrent` requests at once in one process, with the batch's recurrence compiled
    per batch shape (the CUDA default) and as plain ops, alternated so that neither gains from
    going second. The first batch of each shape pays one-time costs (kernels built, buffers
    allocated: 45 tok/s against 140-193 warm in BENCHMARKS.md, issue 10), so each path first
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


async def _warm_up(engine: GenerationEngine, prompt: tuple[int, ...]) -> None:
    for mtp in (False, True):
        await engine.generate(GenerationRequest(prompt, 16, RequestOptions(mtp=mtp)))


@contextlib.asynccontextmanager
async def node_processes(
    args, nodes: int, log: list[str], node_options: str = ""
) -> AsyncIterator[tuple[list[str], str]]:
    """`nodes` oracle node processes on loopback (node i on GPU i % --gpus), with the
    `cluster node` settings `node_options` (a `--node-sets` entry); yields their addresses
    and token, and stops them on the way out."""
    token = secrets.token_hex(16)
    ports = [free_port() for _ in range(nodes)]
    procs: list[asyncio.subprocess.Process] = []
    readers: list[asyncio.Task] = []
    try:
        for i, port in enumerate(ports):
            env = dict(os.environ)
            if args.gpus > 1:  # one node per GPU, round robin
                env["CUDA_VISIBLE_DEVICES"] = str(i % args.gpus)
            proc = await asyncio.create_subprocess_exec(
                *[sys.executable, "-m", "cluster.bench.oracle_node", "--host", "127.0.0.1"],
                *["--port", str(port), "--token", token, "--accept-rate", str(args.node_alpha)],
                *["--node-id", f"bench-{i}", "--cache-limit-gb", "2"],
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
    from node.client import open_remote_engine

    async with node_processes(args, nodes, log) as (addresses, token):
        t0 = time.perf_counter()
        remote = await open_remote_engine(path, addresses, token=token)
        row: dict[str, Any] = {"nodes": nodes, "load_s": time.perf_counter() - t0}
        try:
            await _warm_up(remote.engine, prompt)
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


# ---- side by side: one process, mlx-lm and the nodes, round by round ------------------------


@contextlib.contextmanager
def _oracle(alpha: float, seed: int = 3):
    """This process's drafts accepted with probability `alpha` (the nodes have their own)."""
    previous = install_oracle(alpha, seed=seed)
    try:
        yield
    finally:
        remove_oracle(previous)


async def paired(args, path: Path, prompt: tuple[int, ...], report: dict, log: list[str]) -> None:
    """Ours in one process, mlx-lm's `stream_generate` and ours over `--paired-nodes` node
    processes (node i on GPU i % --gpus), all loaded at once and measured in turn, round after
    round: each ratio comes from runs seconds apart and the figure is the median of a ratio's
    rounds. On a host whose speed drifts between phases (the same engine measured 45.9 and
    37.1 tok/s minutes apart, BENCHMARKS.md run U), ratios of figures taken in separate phases
    are noise; these are not. Then `--concurrent` requests at once in one process and over the
    nodes, with the head's micro-batches and with one batch (`micro_batches=1`), alternated.
    Everything runs at the per-backend defaults (what `cluster` runs)."""
    from node.client import open_remote_engine

    out: dict[str, Any] = {"nodes": args.paired_nodes, "rounds": []}
    report["paired"] = out
    worker = MLXWorker()
    try:
        shard = await worker.run(load_shard, path, for_decoding=True)
        runner = ShardRunner(shard)
        local = GenerationEngine(
            LocalPipeline([runner], worker, max_context=load_model_config(path).max_context)
        )
        lm = await worker.run(mlx_lm_load, path)
        await worker.run(mlx_lm_run, *lm, prompt, 16)
        await _warm_up(local, prompt)
        # One set of node processes per `--node-sets` entry and `--driver-streams` kind (the
        # first is the one reported as "the nodes"), all loaded at once and alternated in each
        # round.
        node_sets = args.node_sets if args.paired_nodes else []
        settings = [(opts, streams) for opts in node_sets for streams in args.driver_streams]
        # The first set stays for the concurrent requests; the others are stopped before them,
        # since every set's shards take GPU memory (two sets, the one process and mlx-lm ran a
        # 27B 4-bit GPU out of memory there).
        async with contextlib.AsyncExitStack() as first_set:
            async with contextlib.AsyncExitStack() as other_sets:
                started = [
                    await (first_set if k == 0 else other_sets).enter_async_context(
                        node_processes(args, args.paired_nodes, log, opts)
                    )
                    for k, (opts, _) in enumerate(settings)
                ]
                remotes: dict[str, Any] = {}
                try:
                    for (opts, streams), (addresses, token) in zip(settings, started, strict=True):
                        remote = await open_remote_engine(
                            path, addresses, token=token, links=streams == "tcp"
                        )
                        remotes[_set_name(opts, streams, args.driver_streams)] = remote
                        await _warm_up(remote.engine, prompt)
                    for i in range(args.rounds):
                        row = await _paired_round(args, worker, runner, local, remotes, prompt, lm)
                        out["rounds"].append(row)
                        print(
                            f"  round {i + 1}: "
                            + ", ".join(f"{k} {v:.1f}" for k, v in row.items() if _is_number(v)),
                            flush=True,
                        )
                finally:
                    for remote in remotes.values():
                        await remote.close()
            if args.concurrent > 1:
                addresses, token = started[0] if started else ([], "")
                out["concurrent"] = await _paired_concurrency(
                    args, path, addresses, token, local, prompt
                )
    finally:
        worker.close()
    rounds = out["rounds"]
    ratios = {
        "one_process_off_over_mlx_lm": ("local_off", "mlx_lm"),
        "one_process_on_over_mlx_lm": ("local_on", "mlx_lm"),
        "one_process_on_over_off": ("local_on", "local_off"),
        "one_process_lookahead_on_over_off": ("local_off", "local_off_no_lookahead"),
        "one_process_no_lookahead_over_mlx_lm": ("local_off_no_lookahead", "mlx_lm"),
        "one_process_mtp_ahead_over_waiting": ("local_on_mtp_ahead", "local_on_mtp_waits"),
    }
    if args.paired_nodes:
        ratios |= {
            "nodes_off_over_one_process": ("nodes_off", "local_off"),
            "nodes_on_over_mlx_lm": ("nodes_on", "mlx_lm"),
            "nodes_on_over_off": ("nodes_on", "nodes_off"),
        }
    out["ratios"] = {name: median([r[a] / r[b] for r in rounds]) for name, (a, b) in ratios.items()}
    for name, key in (
        ("one_process_engine_over_its_steps", "local_engine_over_steps"),
        ("one_process_engine_over_steps_no_lookahead", "local_engine_over_steps_no_lookahead"),
        ("one_process_on_engine_over_its_steps", "local_engine_over_steps_on"),
    ):
        out["ratios"][name] = median([r[key] for r in rounds])
    # Each node's step against its layers' share (an even split) of the one-process step.
    out["node_step_over_share"] = [
        median([r["node_step_ms"][k] * args.paired_nodes / r["local_step_ms"] for r in rounds])
        for k in range(args.paired_nodes)
    ]
    if not args.paired_nodes:
        return
    # The goal's ratio over every alternated pair of every round.
    out["ratios"]["nodes_off_over_one_process"] = median(
        [pair for r in rounds for pair in r["nodes_off_pairs"]]
    )
    # A token over the nodes, MTP off: the nodes' steps, and the rest (the hops, the driver).
    token_ms = [1000 / r["nodes_off"] for r in rounds]
    steps_ms = [sum(r["node_step_ms"]) for r in rounds]
    out["nodes_off_token_ms"] = {
        "token": median(token_ms),
        "node_steps": median(steps_ms),
        "outside_steps": median([t - n for t, n in zip(token_ms, steps_ms, strict=True)]),
        "one_process_step": median([r["local_step_ms"] for r in rounds]),
    }
    out["node_steps_ahead"] = rounds[-1]["node_steps_ahead"]
    out["node_phases_ms"] = [
        {
            name: median([r["node_phases_ms"][k].get(name, 0.0) for r in rounds])
            for name in rounds[0]["node_phases_ms"][k]
        }
        for k in range(args.paired_nodes)
    ]
    if "by_set" in rounds[0]:  # every node set's own ratio and steps, side by side
        out["by_set"] = {
            name: {
                "nodes_off_over_one_process": median(
                    [pair for r in rounds for pair in r["by_set"][name]["nodes_off_pairs"]]
                ),
                "node_step_over_share": [
                    median(
                        [
                            r["by_set"][name]["node_step_ms"][k]
                            * args.paired_nodes
                            / r["local_step_ms"]
                            for r in rounds
                        ]
                    )
                    for k in range(args.paired_nodes)
                ],
                "node_steps_ahead": rounds[-1]["by_set"][name]["node_steps_ahead"],
            }
            for name in rounds[0]["by_set"]
        }


def _set_name(node_options: str, streams: str, kinds: list[str]) -> str:
    """A node set's name: its node options, and its driver's streams where they vary."""
    name = node_options.strip() or "default"
    return name if len(kinds) == 1 else f"{name}, driver over {streams}"


async def _node_steps(remote: Any) -> dict[str, list]:
    """Each node's step phases and step (ms) over its last decode, and its decode steps built
    ahead so far, used and undone."""
    infos = [await c.info() for c in remote.pipeline.clients]
    phases = [step_phases_ms(info) for info in infos]
    return {
        "node_phases_ms": phases,
        "node_step_ms": [
            sum(p[name] for name in ("handoff", "decode", "layers", "encode")) for p in phases
        ],
        "node_steps_ahead": [[i.steps_ahead_used, i.steps_ahead_undone] for i in infos],
    }


async def _paired_round(
    args,
    worker: MLXWorker,
    runner: ShardRunner,
    local: GenerationEngine,
    remotes: dict[str, Any],
    prompt: tuple[int, ...],
    lm: tuple[nn.Module, Any],
) -> dict[str, Any]:
    """One decode of each, tokens/s: one process MTP off and on, mlx-lm, the nodes MTP off and
    on; with the one-process step and each node's step (ms) of the MTP-off runs. With more
    than one node set (`remotes`, the first reported as "the nodes"), each set's MTP-off runs
    too, under "by_set"."""
    row: dict[str, Any] = {}
    cost = runner.step_cost
    # MTP off without steps built ahead (`ShardRunner.lookahead`): each step's own time,
    # which the node steps are set against, and what building ahead buys.
    lookahead, runner.lookahead = runner.lookahead, False
    seconds, batches = cost.total_seconds, cost.total_batches
    try:
        off = await engine_decode(local, prompt, args.tokens, 1, False)
    finally:
        runner.lookahead = lookahead
    row["local_off_no_lookahead"] = off["median_tps"]
    row["local_step_ms"] = (cost.total_seconds - seconds) / (cost.total_batches - batches) * 1e3
    row["local_engine_over_steps_no_lookahead"] = off["engine_over_steps"]
    # MTP off in one process and over the nodes, alternated `--off-pairs` times: the goal's
    # own ratio, from runs seconds apart however fast the host happens to be.
    # With several node sets, their order turns from one alternation to the next.
    names = list(remotes)
    local_off, over_steps = [], []
    nodes_off: dict[str, list[float]] = {name: [] for name in names}
    for k in range(args.off_pairs):
        off = await engine_decode(local, prompt, args.tokens, 1, False)
        local_off.append(off["median_tps"])
        over_steps.append(off["engine_over_steps"])
        turn = k % max(len(names), 1)
        for name in names[turn:] + names[:turn]:
            decoded = await engine_decode(remotes[name].engine, prompt, args.tokens, 1, False)
            nodes_off[name].append(decoded["median_tps"])
    row["local_off"] = median(local_off)
    row["local_engine_over_steps"] = median(over_steps)
    by_set = {}
    for name, runs in nodes_off.items():
        by_set[name] = {
            "nodes_off": median(runs),
            "nodes_off_pairs": [n / o for n, o in zip(runs, local_off, strict=True)],
            # Where each node's decode steps of the last MTP-off run went (`pb.StepPhases`),
            # and its step: from the MLX thread's handoff to its output encoded.
            **await _node_steps(remotes[name]),
        }
    if names:
        row.update(by_set[names[0]])
    if len(names) > 1:
        row["by_set"] = by_set
    with _oracle(0.7):
        # MTP on with steps built before the verdict is read and without (`mtp_lookahead`);
        # the backend's default of the two is `local_on`.
        default = runner.mtp_lookahead
        try:
            for ahead in (True, False):
                runner.mtp_lookahead = ahead
                on = await engine_decode(local, prompt, args.tokens, 1, True)
                row["local_on_mtp_ahead" if ahead else "local_on_mtp_waits"] = on["median_tps"]
                if ahead == default:
                    row["local_on"] = on["median_tps"]
                    row["local_engine_over_steps_on"] = on["engine_over_steps"]
        finally:
            runner.mtp_lookahead = default
    row["mlx_lm"] = (await worker.run(mlx_lm_run, *lm, prompt, args.tokens))["tps"]
    if not names:
        return row
    nodes = remotes[names[0]].engine
    row["nodes_on"] = (await engine_decode(nodes, prompt, args.tokens, 1, True))["median_tps"]
    return row


async def _paired_concurrency(
    args,
    path: Path,
    addresses: list[str],
    token: str,
    local: GenerationEngine,
    prompt: tuple[int, ...],
) -> dict[str, Any]:
    """`--concurrent` MTP-on requests at once: in one process, then over the nodes with one
    micro-batch per node (the default) and with a single batch, alternated twice. The nodes
    reload their shards for each setting (LoadShardRequest.micro_batches), so each timed
    batch follows a short untimed one (traces and kernels of the new shard)."""
    from node.client import open_remote_engine

    out: dict[str, Any] = {"requests": args.concurrent}
    with _oracle(0.7):
        await concurrent_decode(local, prompt, warm_tokens(args), args.concurrent)
        out["one_process"], over_one = [], []
        for _ in range(2):  # each batch against one request decoded just before it
            one = await engine_decode(local, prompt, args.tokens, 1, True)
            batch = await concurrent_decode(local, prompt, args.tokens, args.concurrent)
            out["one_process"].append(batch["aggregate_tps"])
            over_one.append(batch["aggregate_tps"] / one["median_tps"])
        out["one_process_over_one_request"] = median(over_one)
        out["one_process_runs_over_one_request"] = over_one
        # The batch with MTP steps built before their verdicts and waiting for them, in turn.
        runner = local.pipeline.runners[0]
        default, ahead_over_waiting = runner.mtp_lookahead, []
        try:
            for _ in range(2):
                tps = {}
                for ahead in (True, False):
                    runner.mtp_lookahead = ahead
                    await concurrent_decode(local, prompt, warm_tokens(args), args.concurrent)
                    batch = await concurrent_decode(local, prompt, args.tokens, args.concurrent)
                    tps[ahead] = batch["aggregate_tps"]
                ahead_over_waiting.append(tps[True] / tps[False])
        finally:
            runner.mtp_lookahead = default
        out["one_process_mtp_ahead_over_waiting"] = median(ahead_over_waiting)
    if not addresses:
        return out
    settings = {"micro_batched": None, "one_batch": 1}
    runs: dict[str, list[float]] = {name: [] for name in settings}
    loads: dict[str, list[dict[str, Any]]] = {name: [] for name in settings}
    for name in [*settings, *settings]:
        remote = await open_remote_engine(
            path, addresses, token=token, micro_batches=settings[name]
        )
        try:
            await concurrent_decode(remote.engine, prompt, warm_tokens(args), args.concurrent)
            one_decode = engine_decode(remote.engine, prompt, args.tokens, 1, True)
            one_load = await _node_load(remote, one_decode)
            one = one_load.pop("result")
            many = concurrent_decode(remote.engine, prompt, args.tokens, args.concurrent)
            load = await _node_load(remote, many)
            batch = load.pop("result")
        finally:
            await remote.close()
        runs[name].append(batch["aggregate_tps"] / one["median_tps"])
        loads[name].append({"one_request": one_load, "concurrent": load})
        per_node = zip(
            one_load["step_ms"],
            load["step_ms"],
            one_load["busy_share"],
            load["busy_share"],
            strict=True,
        )
        print(
            f"  {args.paired_nodes} nodes, {args.concurrent} concurrent MTP on ({name}): "
            f"{batch['aggregate_tps']:.1f} tok/s, {runs[name][-1]:.2f}x one request; per node "
            "(one request / concurrent) "
            + ", ".join(
                f"step {a:.2f} / {b:.2f} ms, busy {c:.0%} / {d:.0%}" for a, b, c, d in per_node
            ),
            flush=True,
        )
    out["nodes_over_one_request"] = {name: median(r) for name, r in runs.items()}
    out["nodes_runs_over_one_request"] = runs
    out["node_load"] = loads
    return out


async def _node_load(remote: Any, decode: Awaitable[dict[str, Any]]) -> dict[str, Any]:
    """Run `decode` (a coroutine) and say how busy each node was meanwhile, from its own
    counters (`cluster.bench.nodes.breakdown`): its step batches, their mean compute time
    (`step_ms`), their share of the wall time (`busy_share`; prefill included) and the step
    messages per batch (several requests' steps may form one batch). `result` is what
    `decode` returned."""
    clients = remote.pipeline.clients
    before = await _node_counters(clients)
    started = time.perf_counter()
    result = await decode
    wall = time.perf_counter() - started
    rows = node_breakdown(before, await _node_counters(clients), wall)
    return {
        "result": result,
        "wall_s": wall,
        "batches": [row["batches"] for row in rows],
        "step_ms": [row["step_ms"] or 0.0 for row in rows],
        "busy_share": [row["busy_share"] for row in rows],
        "messages_per_batch": [row["messages"] / max(row["batches"], 1) for row in rows],
    }


async def _node_counters(clients: list[Any]) -> NodeSnapshot:
    """The nodes' step counters, head first, as `node_breakdown` reads them."""
    snapshot: NodeSnapshot = {}
    for i, client in enumerate(clients):
        info = await client.info()
        snapshot[str(i)] = {
            "start": info.shard.start,
            "end": info.shard.end,
            "batches_total": info.batches_total,
            "busy_seconds_total": info.busy_seconds_total,
            "steps_total": info.steps_total,
        }
    return snapshot


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


# ---- mlx-lm's pipeline under mlx.launch ----------------------------------------------------

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
            *[sys.executable, "-m", "cluster.bench.gpu_bench", "--pipeline-worker"],
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


# ---- the run -------------------------------------------------------------------------------


@contextlib.contextmanager
def _recorded(report: dict, key: str):
    """Record a phase's failure in the report and go on with the next phase."""
    try:
        yield
    except Exception as error:
        report[key] = f"{type(error).__name__}: {error}\n" + traceback.format_exc()[-2000:]
        print(f"  FAILED: {report[key]}", flush=True)


class Deadline:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()

    def allows(self, name: str, need_s: float, report: dict) -> bool:
        if self.left() >= need_s:
            return True
        report.setdefault("skipped", []).append(
            f"{name}: {self.left():.0f} s left, {need_s} needed"
        )
        print(f"== {name}: skipped ({self.left():.0f} s left)", flush=True)
        return False


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
        "command": "python -m cluster.bench.gpu_bench " + " ".join(args.argv),
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
        with _recorded(report, "diagnose_error"):
            await diagnose(args, path, prompt, report)
        save()
        return report

    if "single" not in args.skip:
        print("== one process", flush=True)
        with _recorded(report, "single_error"):
            await single_process(args, path, prompt, report)
        save()
    if args.interleave and deadline.allows("variants interleaved", 60, report):
        print("== variants interleaved", flush=True)
        with _recorded(report, "interleaved_error"):
            await interleaved_variants(args, path, prompt, report)
        save()
    if "mlx_lm" not in args.skip and deadline.allows("mlx-lm stream_generate", 60, report):
        print("== mlx-lm stream_generate", flush=True)
        worker = MLXWorker()
        with _recorded(report, "mlx_lm_error"):
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
        with _recorded(report, "paired_error"):
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


def summarize(report: dict) -> None:
    """Ratios and the short table that ends the output."""
    single = report.get("single", {})
    off = single.get("mtp_off", {}).get("median_tps")
    on = single.get("mtp_on", {}).get("0.7", {}).get("median_tps")
    s: dict[str, Any] = {}
    lines = [
        f"\nGPU bench: {report['machine']['gpu']} | shape {report['shape']}, "
        f"{report['bits']}-bit, random weights | {report['machine']['date']}"
    ]
    ck = report.get("checkpoint", {})
    how = "reused" if ck.get("reused") else f"written in {ck.get('seconds', 0):.0f} s"
    lines.append(f"checkpoint {ck.get('bytes', 0) / 2**30:.2f} GiB ({how})")
    if "steps" in single:
        st, bd, bw, wb = (
            single["steps"],
            single["breakdown"],
            single["bandwidth"],
            single["weights"],
        )
        read = wb["layers"] + wb["lm_head"]
        floor = read / (bw["gb_per_s"] * 1e9) * 1e3
        s["plain_floor_ms"] = floor
        lines.append(
            f"copy bandwidth {bw['gb_per_s']:.0f} GB/s; plain step reads "
            f"{read / 1e9:.2f} GB -> floor {floor:.2f} ms"
        )
        lines.append(
            f"step (ShardRunner.run, whole model): plain {st['plain']['median_ms']:.2f} ms, "
            f"verify [y,d] {st['verify']['median_ms']:.2f} ms -> "
            f"{st['verify_over_plain']:.2f}x"
        )
        b1, b2 = bd["backbone_1tok"], bd["backbone_2tok"]
        lines.append(
            f"  backbone 1 tok {b1['total_ms']:.2f} ms (graph build {b1['build_ms']:.2f}), "
            f"2 tok {b2['total_ms']:.2f} ms (build {b2['build_ms']:.2f}); "
            f"lm_head+argmax {bd['lm_head_argmax_ms']:.2f} ms; "
            f"MTP head {bd.get('mtp_head_ms', float('nan')):.2f} ms"
        )
    interleaved = report.get("interleaved", {}).get("summary", {})
    for i, (name, v) in enumerate(interleaved.items()):
        s[f"interleaved {name}"] = v
        lines.append(
            f"interleaved [{name}]: plain {v['plain_ms']['median']:.2f} ms, verify/plain "
            f"{v['verify_over_plain']:.2f}x, MTP off {v['mtp_off_tps']['median']:.1f} tok/s, "
            f"on a=0.7 {v['mtp_on_tps']['median']:.1f}"
            + (
                ""
                if i == 0
                else "; over the first, medians of rounds: "
                + ", ".join(f"{k} {r['over_first']:.3f}x" for k, r in v.items() if type(r) is dict)
            )
        )
    for name, v in single.get("variants", {}).items():
        st, b1 = v["steps"], v["breakdown"]["backbone_1tok"]
        v_off, v_on = v["mtp_off"]["median_tps"], v["mtp_on"]["0.7"]["median_tps"]
        per_token = 1e3 / v_off
        s[f"variant {name}"] = {
            "plain_ms": st["plain"]["median_ms"],
            "verify_over_plain": st["verify_over_plain"],
            "engine_ms_per_token_over_step": per_token / st["plain"]["median_ms"],
            "engine_over_its_steps": v["mtp_off"].get("engine_over_steps"),
            "mtp_off_tps": v_off,
            "mtp_on_tps": v_on,
        }
        lines.append(
            f"[{name}] plain {st['plain']['median_ms']:.2f} ms (build {b1['build_ms']:.2f} of "
            f"{b1['total_ms']:.2f}), verify/plain {st['verify_over_plain']:.2f}x; engine off "
            f"{v_off:.1f} tok/s = {per_token:.2f} ms/token = "
            f"{per_token / st['plain']['median_ms']:.2f}x the step timed above, "
            f"{v['mtp_off'].get('engine_over_steps') or float('nan'):.3f}x its own steps; "
            f"on a=0.7 {v_on:.1f} "
            f"({v['mtp_on']['0.7'].get('engine_over_steps') or float('nan'):.3f}x its own steps)"
            + "".join(
                f"; depth {d} {r['median_tps']:.1f}" for d, r in v.get("mtp_depths", {}).items()
            )
        )
    if off:
        row = f"engine, 1 process: MTP off {off:.1f} tok/s"
        for alpha, r in single["mtp_on"].items():
            row += f" | on a={alpha} {r['median_tps']:.1f} ({r['over_off']:.2f}x)"
        lines.append(row)
        s["single_on_over_off_0.7"] = on / off if on else None
        for key in ("concurrent", "concurrent_compiled"):
            if on and key in single:
                c = single[key]
                s[f"single_{key}_over_one"] = c["aggregate_tps"] / on
                lines.append(
                    f"  {c['requests']} concurrent MTP on a=0.7 ({key}): "
                    f"{c['aggregate_tps']:.1f} tok/s, {c['aggregate_tps'] / on:.2f}x one request "
                    f"(the first batch: {c['first_batch']['aggregate_tps']:.1f} tok/s)"
                )
    lm = report.get("mlx_lm", {}).get("median_tps")
    if lm and off and on:
        s["single_off_over_mlx_lm"] = off / lm
        lines.append(
            f"mlx-lm stream_generate {lm:.1f} tok/s; ours MTP off / mlx-lm {off / lm:.2f}x, "
            f"MTP on a=0.7 / mlx-lm {on / lm:.2f}x"
        )
    for n, row in report.get("nodes", {}).items():
        if "error" in row or not (off and on):
            lines.append(f"{n} nodes: {row.get('error', 'no single-process figure')!s:.300}")
            continue
        a, b = row["mtp_off"]["median_tps"], row["mtp_on"]["median_tps"]
        s[f"nodes{n}_off_over_single"] = a / off
        s[f"nodes{n}_on_over_single"] = b / on
        s[f"nodes{n}_on_over_off"] = b / a
        lines.append(
            f"{n} nodes: off {a:.1f} tok/s ({a / off:.2f}x 1 proc), on a=0.7 {b:.1f} "
            f"({b / on:.2f}x 1 proc), on/off {b / a:.2f}x; node step ms "
            f"{[round(x, 2) for x in row['mtp_off']['node_step_ms']]}"
        )
        if lm:
            s[f"nodes{n}_on_over_mlx_lm"] = b / lm
            lines.append(f"  {n} nodes MTP on / mlx-lm one process {b / lm:.2f}x")
        if "steps" in single:
            # Each node's step against its layers' share of the one-process plain step.
            share = single["steps"]["plain"]["median_ms"] / int(n)
            shares = [x / share for x in row["mtp_off"]["node_step_ms"]]
            s[f"nodes{n}_step_over_share"] = shares
            lines.append(f"  node step / its share of the 1-process step {_fmt(shares)}")
        if "concurrent" in row:
            c = row["concurrent"]
            s[f"nodes{n}_concurrent_over_one"] = c["aggregate_tps"] / b
            lines.append(
                f"  {c['requests']} concurrent MTP on: {c['aggregate_tps']:.1f} tok/s, "
                f"{c['aggregate_tps'] / b:.2f}x one request (the first batch: "
                f"{c['first_batch']['aggregate_tps']:.1f} tok/s)"
            )
    for attempt in report.get("mlx_pipeline", []):
        how = "comm on CPU stream" if attempt["cpu_comm"] else "as is"
        if "median_tps" in attempt:
            ours = report.get("nodes", {}).get("2", {}).get("mtp_off", {}).get("median_tps")
            rel = f"; ours 2 nodes MTP off / it {ours / attempt['median_tps']:.2f}x" if ours else ""
            s[f"mlx_pipeline_{'cpu' if attempt['cpu_comm'] else 'gpu'}_tps"] = attempt["median_tps"]
            lines.append(
                f"mlx-lm pipeline ring 2 ranks ({how}): {attempt['median_tps']:.1f} tok/s{rel}"
            )
        else:
            lines.append(f"mlx-lm pipeline ring 2 ranks ({how}): FAILED: {attempt['error'][:300]}")
    paired_out = report.get("paired", {})
    if paired_out.get("ratios"):
        n = paired_out["nodes"]
        r = paired_out["ratios"]
        s["paired"] = {**r, "node_step_over_share": paired_out["node_step_over_share"]}
        lines.append(
            f"side by side, median of {len(paired_out['rounds'])} rounds' ratios: one process "
            f"MTP off / mlx-lm {r['one_process_off_over_mlx_lm']:.2f}x, MTP on a=0.7 / mlx-lm "
            f"{r['one_process_on_over_mlx_lm']:.2f}x (on/off {r['one_process_on_over_off']:.2f}x)"
            f"; engine MTP off / its own steps {r['one_process_engine_over_its_steps']:.3f}x"
        )
        lines.append(
            f"  steps built ahead: MTP off {r['one_process_lookahead_on_over_off']:.2f}x without "
            f"them; without them / mlx-lm {r['one_process_no_lookahead_over_mlx_lm']:.2f}x, "
            f"engine / its own steps {r['one_process_engine_over_steps_no_lookahead']:.3f}x; "
            f"MTP on built before the verdict / waiting for it "
            f"{r['one_process_mtp_ahead_over_waiting']:.2f}x; engine MTP on / its own steps "
            f"{r['one_process_on_engine_over_its_steps']:.3f}x"
        )
        if n:
            lines.append(
                f"  {n} nodes MTP off / one process {r['nodes_off_over_one_process']:.2f}x; "
                f"MTP on / mlx-lm {r['nodes_on_over_mlx_lm']:.2f}x (on/off "
                f"{r['nodes_on_over_off']:.2f}x); node step / its share of the one-process step "
                f"{_fmt(paired_out['node_step_over_share'])}"
            )
            t = paired_out["nodes_off_token_ms"]
            s["paired"]["nodes_off_token_ms"] = t
            lines.append(
                f"  a token over {n} nodes, MTP off: {t['token']:.2f} ms, the node steps "
                f"{t['node_steps']:.2f} and the rest {t['outside_steps']:.2f} (one process's step "
                f"{t['one_process_step']:.2f})"
            )
            for k, phases in enumerate(paired_out["node_phases_ms"]):
                parts = ", ".join(f"{name} {ms:.2f}" for name, ms in phases.items())
                used, undone = paired_out["node_steps_ahead"][k]
                lines.append(
                    f"  node {k} step phases, ms: {parts}; steps built ahead used {used}, "
                    f"undone {undone}"
                )
            for name, spun in paired_out.get("by_set", {}).items():
                s["paired"].setdefault("by_set", {})[name] = spun
                lines.append(
                    f"  node set {name}: MTP off / one process "
                    f"{spun['nodes_off_over_one_process']:.2f}x, node step / its share "
                    f"{_fmt(spun['node_step_over_share'])}, steps built ahead (used, undone) "
                    f"{spun['node_steps_ahead']}"
                )
        if c := paired_out.get("concurrent"):
            s["paired"]["concurrent_one_process_over_one_request"] = c[
                "one_process_over_one_request"
            ]
            lines.append(
                f"  {c['requests']} concurrent MTP on in one process: "
                f"{median(c['one_process']):.1f} tok/s, "
                f"{c['one_process_over_one_request']:.2f}x one request; MTP steps built "
                f"before their verdicts / waiting {c['one_process_mtp_ahead_over_waiting']:.2f}x"
            )
        if c and (over := c.get("nodes_over_one_request")):
            s["paired"]["concurrent_over_one_request"] = over
            lines.append(
                f"  {c['requests']} concurrent MTP on over {n} nodes / one request: "
                f"micro-batched {over['micro_batched']:.2f}x, one batch {over['one_batch']:.2f}x"
            )
    for skipped in report.get("skipped", []):
        lines.append(f"skipped {skipped}")
    report["summary"] = s
    print("\n".join(lines), flush=True)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _fmt(values: list[float]) -> str:
    return "[" + ", ".join(f"{v:.2f}x" for v in values) + "]"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = bench_parser("gpu_bench", __doc__, json=False, model=False)
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


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
