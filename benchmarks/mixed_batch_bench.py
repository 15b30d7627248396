"""What a decode batch costs when some of its requests draft and the rest do not, with its
steps run as they are and padded to one length (`cluster.model.even_steps`).

    python -m benchmarks.mixed_batch_bench [--json OUT] [--model DIR | --shape qwen3_5_27b
        [--bits 4]] [--batch 8] [--iters 40]

The adaptive depth's probes and requests of different depths put such batches in every busy
cluster. Four kinds of --batch live requests (`benchmarks.stepping`), interleaved call by
call on one process: all plain (MTP off), one request at depth 1 beside plain ones (on a
shard that runs mixed steps as they are, and on one that pads them), and all at depth 1.
Median step time, and each over the plain batch. The two shards hold the same weights
(twice the memory: at 27B 4-bit, about 32 GB).
"""

from __future__ import annotations

import dataclasses
import sys
import time

from benchmarks.common import (
    CODE_PROMPTS,
    bench_parser,
    default_model,
    machine,
    median,
    write_json,
)
from benchmarks.stepping import SteppedRequests, bare_runner, interleaved, prompt_ids
from cluster.model.fast_path import DecodeFastPath


def measure(model_dir, batch: int, iters: int) -> dict:
    """The kinds' median step seconds, each over the plain batch's."""
    device = DecodeFastPath.for_device()
    as_they_are = bare_runner(model_dir, dataclasses.replace(device, even_steps=False))
    padded = bare_runner(model_dir, dataclasses.replace(device, even_steps=True))
    ids = prompt_ids(model_dir, CODE_PROMPTS[0])
    one_drafting = (1, *[None] * (batch - 1))
    kinds = {
        "plain": SteppedRequests(as_they_are, ids, size=batch, name="plain"),
        "one drafting": SteppedRequests(as_they_are, ids, size=batch, depth=one_drafting, name="m"),
        "one drafting, padded": SteppedRequests(
            padded, ids, size=batch, depth=one_drafting, name="p"
        ),
        "all drafting": SteppedRequests(as_they_are, ids, size=batch, depth=1, name="all"),
    }
    times = interleaved(kinds, iters, warmup=5, seed=3)
    plain = median(times["plain"])
    return {
        kind: {"step_ms": median(t) * 1e3, "over_plain": median(t) / plain}
        for kind, t in times.items()
    }


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser("mixed_batch_bench", __doc__)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--iters", type=int, default=40)
    parser.add_argument("--shape", default=None, help="a real model's shape, random weights")
    parser.add_argument("--bits", type=int, default=4, help="with --shape; 16: bf16")
    args = parser.parse_args(argv)
    if args.batch < 2:
        parser.error("--batch must be at least 2")
    started = time.perf_counter()
    checkpoint = None
    model_dir = args.model or default_model()
    if args.shape:
        from benchmarks import random_checkpoint

        model_dir = args.model or random_checkpoint.default_dir(args.shape, args.bits)
        checkpoint = random_checkpoint.write_checkpoint(model_dir, args.shape, args.bits, 64, 0)
    kinds = measure(model_dir, args.batch, args.iters)
    print(f"a batch of {args.batch} decode steps (medians; x: over the plain batch)")
    for kind, row in kinds.items():
        print(f"{kind:>22} {row['step_ms']:8.2f} ms {row['over_plain']:6.2f}x")
    write_json(
        args.json,
        {
            "benchmark": "mixed_batch_bench",
            "command": "python -m benchmarks.mixed_batch_bench "
            + " ".join(sys.argv[1:] if argv is None else argv),
            "machine": machine(),
            "model": str(model_dir),
            "checkpoint": checkpoint,
            "batch": args.batch,
            "iters": args.iters,
            "kinds": kinds,
            "seconds": time.perf_counter() - started,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
