"""Time to first token of a conversation's next turn, with and without the conversation cache.

Three node daemons on loopback, one pipeline over them, two engines on it: one with the prefix
index (the coordinator's default), one without. For each history length, a first turn of that
many prompt tokens is answered by the cached engine (the nodes keep snapshots at the end of the
prompt and of the answer); then the next turn (history, answer, a new question) is timed on
both engines, interleaved in shuffled order per round. A fresh question per round keeps every
round's second turn new to the cache except for its history. Greedy; the tokens of both
engines are compared (the cache must not change them).

    python -m benchmarks.prefix_cache_bench --json prefix_cache.json
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from pathlib import Path

from benchmarks.common import (
    CODE_PROMPTS,
    LocalNodes,
    bench_parser,
    default_model,
    load_tokenizer,
    machine,
    median,
    paired_ratios,
    spread,
    write_json,
)
from cluster.decode.engine import GenerationEngine, GenerationRequest
from cluster.decode.prefix_index import PrefixIndex
from cluster.decode.remote_pipeline import PipelineSettings, load_pipeline
from cluster.messages import RequestOptions

QUESTIONS = ("\n\nclass Queue:\n", "\n\ndef parse(text):\n", "\n\nimport json\n", "\n\n# Tests\n")


def history(tokenizer, length: int) -> tuple[int, ...]:
    """`length` prompt tokens of Python source (the bundled model's own kind of text)."""
    text = "\n\n".join(p for p in CODE_PROMPTS if not p.startswith("CHAT:"))
    ids = tuple(tokenizer.encode(text))
    return (ids * (length // len(ids) + 1))[:length]


async def measure(args, model_dir: Path, nodes: LocalNodes) -> list[dict]:
    tokenizer = load_tokenizer(model_dir)
    pipeline = await load_pipeline(model_dir, nodes.addresses, PipelineSettings(nodes.token))
    samples = []
    try:
        index = PrefixIndex()
        engines = {
            "cache": GenerationEngine(pipeline, prefix_index=index),
            "no cache": GenerationEngine(pipeline),
        }
        options = RequestOptions(mtp=not args.no_mtp)
        order = random.Random(0)
        for length in args.history:
            first = history(tokenizer, length)
            answer = await engines["cache"].generate(
                GenerationRequest(first, args.answer_tokens, options)
            )
            for rnd in range(args.rounds):
                question = tuple(tokenizer.encode(QUESTIONS[rnd % len(QUESTIONS)] + f"# {rnd}\n"))
                prompt = first + answer.tokens + question
                request = GenerationRequest(prompt, args.max_tokens, options)
                variants = list(engines)
                order.shuffle(variants)
                outputs = {}
                for name in variants:
                    outputs[name] = await engines[name].generate(request)
                same = outputs["cache"].tokens == outputs["no cache"].tokens
                for name, out in outputs.items():
                    samples.append(
                        {
                            "history": length,
                            "round": rnd,
                            "variant": name,
                            "prompt_tokens": len(prompt),
                            "cached_tokens": out.cached_tokens,
                            "ttft_s": out.time_to_first_token_s,
                            "same_tokens": same,
                        }
                    )
    finally:
        await pipeline.close()
    return samples


def summarize(samples: list[dict], lengths: list[int]) -> list[dict]:
    rows = []
    for length in lengths:

        def series(variant: str, length: int = length) -> list[dict]:
            return [s for s in samples if s["history"] == length and s["variant"] == variant]

        cached, plain = series("cache"), series("no cache")
        ratios = paired_ratios([s["ttft_s"] for s in plain], [s["ttft_s"] for s in cached])
        rows.append(
            {
                "history": length,
                "prompt_tokens": median(s["prompt_tokens"] for s in cached),
                "cached_tokens": median(s["cached_tokens"] for s in cached),
                "ttft_ms_cache": 1000 * median(s["ttft_s"] for s in cached),
                "ttft_ms_no_cache": 1000 * median(s["ttft_s"] for s in plain),
                "speedup": median(ratios),
                "speedup_iqr": spread(ratios),
                "same_tokens": all(s["same_tokens"] for s in cached),
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser("prefix_cache_bench", __doc__)
    parser.add_argument("--history", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--answer-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-mtp", action="store_true")
    args = parser.parse_args(argv)
    model_dir = args.model or default_model()
    started = time.perf_counter()
    with LocalNodes(3) as nodes:
        samples = asyncio.run(measure(args, model_dir, nodes))
    rows = summarize(samples, args.history)
    print("history | prompt | cached | TTFT cache ms | TTFT no cache ms | speedup [IQR] | same")
    for r in rows:
        low, high = r["speedup_iqr"]
        print(
            f"{r['history']:7d} | {r['prompt_tokens']:6.0f} | {r['cached_tokens']:6.0f} | "
            f"{r['ttft_ms_cache']:13.1f} | {r['ttft_ms_no_cache']:16.1f} | "
            f"{r['speedup']:.1f}x [{low:.1f}-{high:.1f}] | {'yes' if r['same_tokens'] else 'NO'}"
        )
    print(f"({time.perf_counter() - started:.0f} s)")
    write_json(
        args.json,
        {
            "benchmark": "prefix_cache_bench",
            "command": "python -m benchmarks.prefix_cache_bench "
            + " ".join(sys.argv[1:] if argv is None else argv),
            "machine": machine(),
            "model": str(model_dir),
            "settings": vars(args) | {"model": str(model_dir)},
            "summary": rows,
            "samples": samples,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
