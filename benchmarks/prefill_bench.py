"""Long prompts: prefill tokens/s over one process and N nodes, by chunk size, side by side.

    python -m benchmarks.prefill_bench --shape qwen3_5_27b --gpus 2 --nodes 2 \
        --lengths 4096,16384 --chunks 512,1024,2048 --json prefill.json
    python -m benchmarks.prefill_bench --lengths 1024,4096 --nodes 2   # the bundled model, CPU

One process (every layer in this process) and N node processes on loopback (node i on GPU
i % --gpus) hold the same checkpoint at once: a real model's shape with random weights
(`--shape`), or a trained model (`--model`, the bundled one by default). Each round prefills
each length at each chunk size on both, in a shuffled order (the prompt's chunks are submitted
together, so over N nodes chunk k+1 runs on the head while chunk k runs further down), and
times the first token (`max_tokens` 1, MTP off, no conversation cache). The first prefill of
every (length, chunk) on each side builds that shape: it is reported apart (`cold_s`).

Then, on the nodes at the default chunk:
- decode at a long context against a short one: tokens/s of one request after a prompt of
  the longest length and after `--short` tokens (TPOT, MTP off);
- decode while a long prompt prefills, after the coordinator's warm-up of the nodes (MTP
  off) and its measurement of the chunks: at each of `--itl-chunks`, a fixed chunk or
  `paced` (the engine's pacer from the chunk measured, as the coordinator serves),
  `--streams` requests decode, then the longest prompt arrives; the running streams' gaps
  between tokens while it prefills, against their gaps before it (median and p99).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import time
from pathlib import Path
from typing import Any

import mlx.core as mx

from benchmarks.common import bench_parser, default_model, machine, median, write_json
from benchmarks.gpu_bench.node_processes import node_processes
from benchmarks.random_checkpoint import SHAPES, bench_prompt, default_dir, write_checkpoint
from cluster.config import load_model_config
from cluster.decode.engine import GenerationEngine, GenerationRequest
from cluster.decode.local_engine import open_local_engine
from cluster.decode.remote_pipeline import PipelineSettings, open_remote_engine
from cluster.decode.warmup import WarmupProgress, measure_chunks, plan_warmup, run_warmup
from cluster.messages import RequestOptions

MTP_OFF = RequestOptions(mtp=False)
PACED = "paced"


async def ttft(engine: GenerationEngine, prompt: tuple[int, ...], chunk: int) -> float:
    """Seconds to the first token of `prompt` cut in `chunk`-token chunks."""
    engine.prefill_chunk = chunk
    out = await engine.generate(GenerationRequest(prompt, 1, MTP_OFF))
    return out.time_to_first_token_s


async def decode_tps(engine: GenerationEngine, prompt: tuple[int, ...], tokens: int) -> float:
    out = await engine.generate(GenerationRequest(prompt, tokens, MTP_OFF))
    return out.generation_tps


async def gaps_while_prefilling(
    engine: GenerationEngine, vocab: int, long_prompt: tuple[int, ...], streams: int
) -> dict[str, Any]:
    """`streams` decoding requests; after each has emitted a few tokens the long prompt
    arrives. Their gaps between tokens before it and while it prefills."""
    stamps: list[list[float]] = [[] for _ in range(streams)]
    window: list[float] = []  # [arrival of the long prompt, its first token]
    started = asyncio.Event()

    async def stream(i: int) -> None:
        prompt = bench_prompt(vocab, 64, seed=100 + i)
        request = GenerationRequest(prompt, min(4096, engine.max_context - len(prompt)), MTP_OFF)
        agen = engine.stream(request)
        try:
            async for _ in agen:
                stamps[i].append(time.perf_counter())
                if len(window) == 2 and stamps[i][-1] > window[1] + 0.5:
                    return
                if all(len(s) >= 16 for s in stamps):
                    started.set()
        finally:
            await agen.aclose()

    tasks = [asyncio.create_task(stream(i)) for i in range(streams)]
    try:
        ready = asyncio.ensure_future(started.wait())
        await asyncio.wait([ready, *tasks], timeout=600, return_when="FIRST_COMPLETED")
        if not ready.done():
            ready.cancel()
            await asyncio.gather(*tasks)  # a stream that ended early says why here
            raise RuntimeError("the streams did not start decoding")
        window.append(time.perf_counter())
        out = await engine.generate(GenerationRequest(long_prompt, 1, MTP_OFF))
        window.append(window[0] + out.time_to_first_token_s)
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
    before, during = [], []
    for s in stamps:
        for a, b in itertools.pairwise(s):
            if b <= window[0]:
                before.append(b - a)
            elif a >= window[0] and a < window[1]:
                during.append(b - a)
    before.sort()
    during.sort()

    def p99(values: list[float]) -> float:
        return values[min(len(values) - 1, int(0.99 * len(values)))] if values else 0.0

    return {
        "streams": streams,
        "prompt_tokens": len(long_prompt),
        "prefill_s": window[1] - window[0],
        "itl_before_ms": {"p50": median(before) * 1e3, "p99": p99(before) * 1e3},
        "itl_during_ms": {"p50": median(during) * 1e3, "p99": p99(during) * 1e3},
        "during_p99_over_before_p50": p99(during) / median(before) if before else None,
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    report: dict[str, Any] = {"benchmark": "prefill_bench", "machine": machine(), "args": {
        k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()
    }}  # fmt: skip
    if args.shape:
        path = args.dir or default_dir(args.shape, args.bits)
        report["checkpoint"] = write_checkpoint(path, args.shape, args.bits, 64, 0)
    else:
        path = args.model or default_model()
    vocab = load_model_config(path).text.vocab_size
    prompts = {n: bench_prompt(vocab, n, seed=n) for n in args.lengths}
    local = await open_local_engine(path, mtp=False)
    args.node_alpha = 0.0  # the oracle nodes' acceptance: MTP is off throughout
    log: list[str] = []
    try:
        async with node_processes(args, args.nodes, log) as (addresses, token):
            remote = await open_remote_engine(path, addresses, PipelineSettings(token))
            engines = {"one process": local.engine, f"{args.nodes} nodes": remote.engine}
            try:
                if args.rounds:
                    report["prefill"] = await prefill_rounds(args, engines, prompts)
                nodes = remote.engine
                nodes.prefill_chunk = args.chunks[0] if args.default_chunk is None else (
                    args.default_chunk
                )  # fmt: skip
                longest = prompts[max(args.lengths)]
                short = bench_prompt(vocab, args.short, seed=1)
                await decode_tps(nodes, short, 8)
                report["tpot"] = {
                    "short_tokens": args.short,
                    "long_tokens": len(longest),
                    "short_tps": median([await decode_tps(nodes, short, 64) for _ in range(2)]),
                    "long_tps": median([await decode_tps(nodes, longest, 64) for _ in range(2)]),
                }
                tp = report["tpot"]
                tp["long_over_short"] = tp["long_tps"] / tp["short_tps"]
                print(f"decode tok/s: {tp}", flush=True)
                report["itl_while_prefilling"] = []
                # The coordinator's warm-up first, so no chunk meets a shape for the first
                # time while it is timed; then the chunk it would choose, measured as it does.
                steps = plan_warmup(
                    prefill_chunk=nodes.prefill_chunk,
                    max_running=args.streams + 1,
                    max_context=nodes.max_context,
                    mtp_depth=0,
                    has_mtp=False,
                )
                await run_warmup(
                    nodes.pipeline,
                    steps,
                    prefill_chunk=nodes.prefill_chunk,
                    vocab_size=vocab,
                    progress=WarmupProgress(),
                )
                choice = await measure_chunks(nodes.pipeline, nodes.prefill_chunk, vocab)
                report["chunk_choice"] = {
                    "decode_step_ms": choice.decode_step_s * 1e3,
                    "prefill_ms": {n: s * 1e3 for n, s in choice.prefill_s.items()},
                    "prefill_chunk": choice.prefill_chunk,
                    "interleave_chunk": choice.interleave_chunk,
                }
                print(choice.line(), flush=True)
                nodes.prefill_chunk = choice.prefill_chunk
                for chunk in args.itl_chunks:
                    # "paced": the engine's pacer, from the chunk measured; a number: fixed.
                    paced = chunk == PACED
                    nodes.interleave_chunk = choice.interleave_chunk if paced else int(chunk)
                    nodes.pacer.fallback_gap_s = choice.decode_step_s
                    nodes.pacer.adaptive = paced
                    row: dict[str, Any] = {"chunk": chunk, "first_chunk": nodes.interleave_chunk}
                    row.update(await gaps_while_prefilling(nodes, vocab, longest, args.streams))
                    row["last_chunk"] = nodes.interleave_chunk
                    row["pacer_changes"] = [
                        [c.before, c.after, round(c.ratio, 2)] for c in nodes.pacer.trace
                    ]
                    report["itl_while_prefilling"].append(row)
                    print(f"while prefilling: {row}", flush=True)
            finally:
                await remote.close()
    except Exception:
        print("\n".join(log[-40:]), flush=True)  # what the nodes said before the failure
        raise
    finally:
        local.close()
        report["node_log_tail"] = log[-20:]
    return report


async def prefill_rounds(
    args: argparse.Namespace, engines: dict[str, GenerationEngine], prompts: dict
) -> list[dict[str, Any]]:
    """Per (length, chunk): each engine's median prefill tokens/s and the nodes' ratio over
    one process within each round."""
    order = random.Random(7)
    cases = [(n, c) for n in args.lengths for c in args.chunks]
    times: dict[tuple[int, int, str], list[float]] = {}
    cold: dict[tuple[int, int, str], float] = {}
    for n, c in cases:  # each shape's first prefill builds it: kept apart, as `cold_s`
        for name, engine in engines.items():
            cold[(n, c, name)] = await ttft(engine, prompts[n], c)
    for rnd in range(args.rounds):
        for n, c in cases:
            names = list(engines)
            order.shuffle(names)
            for name in names:
                times.setdefault((n, c, name), []).append(await ttft(engines[name], prompts[n], c))
        print(f"round {rnd + 1}/{args.rounds} done", flush=True)
    rows = []
    one, many = list(engines)
    for n, c in cases:
        a, b = times[(n, c, one)], times[(n, c, many)]
        row = {
            "prompt_tokens": n,
            "chunk": c,
            f"{one} tok/s": n / median(a),
            f"{many} tok/s": n / median(b),
            "nodes_over_one": median([x / y for x, y in zip(a, b, strict=True)]),
            "cold_s": {name: cold[(n, c, name)] for name in engines},
        }
        rows.append(row)
        print(
            f"{n:>6} tokens, chunk {c:>5}: one process {row[f'{one} tok/s']:.0f} tok/s, "
            f"{many} {row[f'{many} tok/s']:.0f} tok/s ({row['nodes_over_one']:.2f}x)",
            flush=True,
        )
    return rows


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def _chunks(text: str) -> list[str]:
    chunks = text.split(",")
    for chunk in chunks:
        if chunk != PACED and not (chunk.isdigit() and int(chunk) > 0):
            raise argparse.ArgumentTypeError(f"a chunk is a size or {PACED!r}, got {chunk!r}")
    return chunks


def main(argv: list[str] | None = None) -> None:
    parser = bench_parser("prefill_bench", __doc__)
    parser.add_argument("--shape", choices=sorted(SHAPES), default=None)
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--dir", type=Path, default=None, help="checkpoint dir with --shape")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--gpus", type=int, default=1, help="node i on GPU i %% GPUS")
    parser.add_argument("--lengths", type=_ints, default=[1024, 4096])
    parser.add_argument("--chunks", type=_ints, default=[512, 1024, 2048])
    parser.add_argument("--default-chunk", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=2, help="0: no side-by-side prefill")
    parser.add_argument("--short", type=int, default=512, help="the short context of TPOT")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument(
        "--itl-chunks",
        type=_chunks,
        default=[PACED],
        help=f"the ITL measurement's chunks: sizes, or {PACED!r} (the engine's own pacing)",
    )
    parser.add_argument("--cache-limit-gb", type=float, default=8, help="MLX's buffer cache")
    args = parser.parse_args(argv)
    mx.set_cache_limit(int(args.cache_limit_gb * 2**30))
    started = time.perf_counter()
    report = asyncio.run(run(args))
    report["seconds"] = time.perf_counter() - started
    write_json(args.json, report)
    print(f"{report['seconds']:.0f} s", flush=True)


if __name__ == "__main__":
    main()
