"""Where one decode step's time goes: the layers against the tail, with and without MTP.

    python -m cluster.bench.step_profile [--json OUT] [--iters 30] [--batch 8] [--model DIR]
                                         [--compiled-batches]

A bare whole-model `ShardRunner` steps live requests by hand (sampled, temperature 0.7), for
4 kinds interleaved call by call: 1 request and --batch requests, MTP off and on. For each
step it times the whole `ShardRunner.run` (nothing built ahead), the decoder layers (evaluated
on their own, which adds one sync the real step does not have) and the tail's `launch` and
`conclude` (lm_head, sampling, verification, the MTP head and its draft). Medians, in ms and
relative to one request without MTP. `--compiled-batches` adds the batch kinds again with their
GatedDeltaNet recurrence compiled (`cluster.model.compiled.batches_enabled`), interleaved
with the rest, to decide that switch by measurement on each backend.
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

import mlx.core as mx

from cluster.bench.common import (
    bench_parser,
    default_model,
    load_tokenizer,
    machine,
    median,
    write_json,
)
from cluster.bench.http_bench import TEXT_PROMPTS, _Batch
from cluster.config import load_model_config
from cluster.decode.runner import ShardRunner
from cluster.model import compiled
from cluster.model.loading import load_shard
from cluster.model.shard import ShardSpec


class _TimedShard:
    """The runner's shard, its forward evaluated and timed; everything else passes through."""

    def __init__(self, shard, times: dict[str, float]):
        self._shard, self._times = shard, times

    def __call__(self, x, segments):
        t0 = time.perf_counter()
        out = self._shard(x, segments)
        mx.eval(out)
        self._times["layers"] = time.perf_counter() - t0
        return out

    def __getattr__(self, name: str):
        return getattr(self._shard, name)


def _timed_tail(part, times: dict[str, float]):
    """A part of the tail's work (`Tail.launch`, `Tail.conclude`), its time added to "tail"."""

    def timed(*args):
        t0 = time.perf_counter()
        out = part(*args)
        times["tail"] = times.get("tail", 0.0) + time.perf_counter() - t0
        return out

    return timed


def profile(model_dir: Path, batch: int, iters: int, compiled_batches: bool = False) -> dict:
    runner = ShardRunner(
        load_shard(
            model_dir,
            ShardSpec.whole(load_model_config(model_dir).num_layers),
            for_decoding=True,
        ),
        lookahead=False,  # each step's own time, its tail not overlapped with the next step
    )
    parts: dict[str, float] = {}
    runner.shard = _TimedShard(runner.shard, parts)
    runner.tail.launch = _timed_tail(runner.tail.launch, parts)
    runner.tail.conclude = _timed_tail(runner.tail.conclude, parts)
    ids = tuple(load_tokenizer(model_dir).encode(TEXT_PROMPTS[0]))
    # dict.fromkeys: --batch 1 names the one-request kinds once (each kind is its own requests)
    plans = list(dict.fromkeys((size, mtp, False) for size in (1, batch) for mtp in (False, True)))
    if compiled_batches:
        plans += [(batch, mtp, True) for mtp in (False, True)]
    kinds = {
        plan: _Batch(runner, ids, plan[0], plan[1], "-".join(map(str, plan))) for plan in plans
    }
    samples: dict[tuple[int, bool, bool], dict[str, list[float]]] = {k: {} for k in kinds}
    rng = random.Random(6)
    for i in range(iters + 3):
        order = list(kinds)
        rng.shuffle(order)
        for kind in order:
            parts.clear()
            compiled.set_batches_enabled(kind[2])
            parts["step"] = kinds[kind]()
            if i >= 3:
                for name, value in parts.items():
                    samples[kind].setdefault(name, []).append(value)
    compiled.set_batches_enabled(None)
    rows = []
    for (size, mtp, batch_compiled), by_part in samples.items():
        ms = {f"{name}_ms": median(v) * 1e3 for name, v in by_part.items()}
        rows.append({"requests": size, "mtp": mtp, "compiled_batch": batch_compiled, **ms})
    plain1 = next(r for r in rows if r["requests"] == 1 and not r["mtp"])
    for row in rows:
        row["step_over_plain1"] = row["step_ms"] / plain1["step_ms"]
        row["layers_over_plain1"] = row["layers_ms"] / plain1["layers_ms"]
        row["tail_over_plain1"] = row["tail_ms"] / plain1["tail_ms"]
        row["tail_share"] = row["tail_ms"] / (row["layers_ms"] + row["tail_ms"])
    return {"batch": batch, "iters": iters, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser("step_profile", __doc__)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument(
        "--compiled-batches",
        action="store_true",
        help="also time the batch with its GatedDeltaNet recurrence compiled",
    )
    args = parser.parse_args(argv)
    model_dir = args.model or default_model()
    report = profile(model_dir, args.batch, args.iters, args.compiled_batches)
    print("one decode step, sampled 0.7 (medians; x: relative to 1 request without MTP)")
    print(
        f"{'requests':>8} {'MTP':>4} {'compiled':>8} {'step ms':>8} {'step':>7} "
        f"{'layers':>7} {'tail':>7} {'tail share':>10}"
    )
    for r in report["rows"]:
        print(
            f"{r['requests']:>8} {('on' if r['mtp'] else 'off'):>4} "
            f"{('yes' if r['compiled_batch'] else ''):>8} {r['step_ms']:>8.2f} "
            f"{r['step_over_plain1']:>6.2f}x {r['layers_over_plain1']:>6.2f}x "
            f"{r['tail_over_plain1']:>6.2f}x {r['tail_share']:>10.0%}"
        )
    write_json(
        args.json,
        {
            "benchmark": "step_profile",
            "command": "python -m cluster.bench.step_profile "
            + " ".join(sys.argv[1:] if argv is None else argv),
            "machine": machine(),
            "model": str(model_dir),
            **report,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
