"""Timings taken on the MLX worker thread: a step, its parts, a matmul by rows, a sync."""

from __future__ import annotations

import dataclasses
import gc
import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from benchmarks.common import median, spread
from benchmarks.oracle_node import install_oracle, remove_oracle
from cluster.config import ModelConfig
from cluster.decode.runner import ShardRunner
from cluster.messages import RequestOptions, StepRequest
from cluster.model import few_row_matmul, tensor_core_matmul
from cluster.model import shard as model_shard
from cluster.model.cache import RequestCache
from cluster.model.layers import Segment
from cluster.model.shard import ModelShard


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
    default = shard.fast_path
    for kernel in (False, True) if few_row_matmul.available() else (False,):
        shard.use_fast_path(dataclasses.replace(default, few_row_kernel=kernel))
        label = "kernel_" if kernel else ""
        for m in (1, 2, 3, 4, 8, 16, 32):
            x = mx.random.normal((1, m, shard.hidden_size)).astype(mx.bfloat16)
            out[f"{label}chain_M{m}_ms"] = _timed(lambda x=x: chain(x), iters, 3) / len(layers)
            out[f"{label}independent_M{m}_ms"] = _timed(
                lambda x=x: [layer.mlp(x) for layer in layers], iters, 3
            ) / len(layers)
    shard.use_fast_path(default)
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


def _timed(fn: Callable[[], Any], iters: int, warmup: int) -> float:
    times = []
    for _ in range(warmup + iters):
        t0 = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t0)
    return median(times[warmup:]) * 1e3


def free_memory() -> None:
    """What the last phase left behind: Python's garbage, then MLX's buffer cache."""
    gc.collect()
    mx.clear_cache()
