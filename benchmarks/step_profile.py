"""Where one decode step's time goes: the layers against the tail, with and without MTP, and
what a batch of requests costs against one (the batching ceiling).

    python -m benchmarks.step_profile [--json OUT] [--iters 30] [--batch 8] [--model DIR]
        [--temperature 0.7] [--top-k K] [--top-p P] [--min-p M] [--no-mlx-lm]
        [--compiled-batches]

A bare whole-model runner (`benchmarks.stepping`) steps live requests by hand (sampled at
temperature 0.7 unless the sampling options say otherwise), for 4 kinds interleaved call by
call: 1 request and --batch requests, MTP off and on. For each step it times the whole
`ShardRunner.run`, the decoder layers (evaluated on their own, which adds one sync the real
step does not have) and the tail's `launch` and `conclude` (lm_head, sampling, verification,
the MTP head and its draft). Medians, in ms and relative to one request without MTP. mlx-lm's
forward over 1 and --batch sequences runs in the same turns (unless --no-mlx-lm: it loads the
model a second time): the hardware's own batching ceiling (--batch / its cost ratio), beside
the engine's. `--compiled-batches` adds the batch kinds again with their GatedDeltaNet
recurrence compiled (`DecodeFastPath.compiled_batches`), interleaved with the rest, to
decide that switch by measurement on each backend.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

import mlx.core as mx

from benchmarks.common import (
    CODE_PROMPTS,
    SAMPLED_TEMPERATURE,
    bench_parser,
    default_model,
    machine,
    median,
    write_json,
)
from benchmarks.stepping import (
    LMForward,
    SteppedRequests,
    bare_runner,
    interleaved,
    prompt_ids,
)
from cluster.messages import SamplingParams

SAMPLING = SamplingParams(temperature=SAMPLED_TEMPERATURE)


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


def profile(
    model_dir: Path,
    batch: int,
    iters: int,
    compiled_batches: bool = False,
    sampling: SamplingParams = SAMPLING,
    with_mlx_lm: bool = True,
) -> dict:
    runner = bare_runner(model_dir)
    parts: dict[str, float] = {}
    runner.shard = _TimedShard(runner.shard, parts)
    runner.tail.launch = _timed_tail(runner.tail.launch, parts)
    runner.tail.conclude = _timed_tail(runner.tail.conclude, parts)
    ids = prompt_ids(model_dir, CODE_PROMPTS[0])
    # dict.fromkeys: --batch 1 names the one-request kinds once (each kind is its own requests)
    plans = list(dict.fromkeys((size, mtp, False) for size in (1, batch) for mtp in (False, True)))
    if compiled_batches:
        plans += [(batch, mtp, True) for mtp in (False, True)]
    samples: dict[tuple, list[dict[str, float]]] = {plan: [] for plan in plans}

    def engine_step(plan: tuple[int, bool, bool]):
        size, mtp, _ = plan
        stepped = SteppedRequests(
            runner, ids, size=size, depth=1 if mtp else None,
            sampling=sampling, name="-".join(map(str, plan)),
        )  # fmt: skip

        def step() -> float:
            parts.clear()
            parts["step"] = stepped()
            samples[plan].append(dict(parts))
            return parts["step"]

        return step

    kinds: dict = {plan: engine_step(plan) for plan in plans}
    sizes = sorted({1, batch})
    if with_mlx_lm:  # a second copy of the weights: at 27B bf16, more than an 80 GB GPU holds
        from mlx_lm import load

        lm_model = load(str(model_dir))[0]
        kinds |= {("mlx-lm", size): LMForward(lm_model, ids, size=size) for size in sizes}

    default = runner.shard.fast_path
    fast_paths = {on: dataclasses.replace(default, compiled_batches=on) for on in (False, True)}

    def switch_recurrence(kind: tuple) -> None:
        chosen = fast_paths[kind[2]] if kind[0] != "mlx-lm" else default
        if runner.shard.fast_path is not chosen:
            runner.shard.use_fast_path(chosen)

    warmup = 3
    times = interleaved(kinds, iters, warmup, seed=6, before=switch_recurrence)
    runner.shard.use_fast_path(default)
    rows = []
    for (size, mtp, batch_compiled), calls in samples.items():
        ms = {
            f"{name}_ms": median(call[name] for call in calls[warmup:]) * 1e3 for name in calls[0]
        }
        rows.append({"requests": size, "mtp": mtp, "compiled_batch": batch_compiled, **ms})
    plain1 = next(r for r in rows if r["requests"] == 1 and not r["mtp"])
    for row in rows:
        row["step_over_plain1"] = row["step_ms"] / plain1["step_ms"]
        row["layers_over_plain1"] = row["layers_ms"] / plain1["layers_ms"]
        row["tail_over_plain1"] = row["tail_ms"] / plain1["tail_ms"]
        row["tail_share"] = row["tail_ms"] / (row["layers_ms"] + row["tail_ms"])
    ceilings = {}
    if with_mlx_lm:
        mlx_lm = {size: median(times[("mlx-lm", size)]) * 1e3 for size in sizes}
        ceilings["mlx-lm forward"] = batch * mlx_lm[1] / mlx_lm[batch]
    for row in rows:
        if row["requests"] == batch and not row["compiled_batch"]:
            name = f"engine {'MTP' if row['mtp'] else 'plain'} step"
            ceilings[name] = batch / (row["step_ms"] / _one_of(rows, row["mtp"])["step_ms"])
    return {
        "batch": batch,
        "iters": iters,
        "sampling": dataclasses.asdict(sampling),
        "rows": rows,
        "mlx_lm_forward_ms": mlx_lm if with_mlx_lm else None,
        "batching_ceiling": ceilings,
    }


def _described(sampling: SamplingParams) -> str:
    fields = dataclasses.asdict(sampling) | {"seed": None}
    defaults = dataclasses.asdict(SamplingParams())
    return ", ".join(f"{k} {v}" for k, v in fields.items() if v != defaults[k]) or "greedy"


def _one_of(rows: list[dict], mtp: bool) -> dict:
    return next(r for r in rows if r["requests"] == 1 and r["mtp"] == mtp)


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser("step_profile", __doc__)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument(
        "--compiled-batches",
        action="store_true",
        help="also time the batch with its GatedDeltaNet recurrence compiled",
    )
    parser.add_argument("--temperature", type=float, default=SAMPLED_TEMPERATURE)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument(
        "--no-mlx-lm", action="store_true", help="skip mlx-lm's forward (a second copy of weights)"
    )
    args = parser.parse_args(argv)
    model_dir = args.model or default_model()
    sampling = SamplingParams(args.temperature, args.top_p, args.top_k, args.min_p)
    report = profile(
        model_dir, args.batch, args.iters, args.compiled_batches, sampling, not args.no_mlx_lm
    )
    print(f"one decode step, {_described(sampling)} (medians; x: over 1 request without MTP)")
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
    if lm := report["mlx_lm_forward_ms"]:
        print(f"mlx-lm forward: {lm[1]:.2f} ms at 1 sequence, {lm[args.batch]:.2f} at {args.batch}")
    print(
        f"the aggregate speedup {args.batch} requests allow ({args.batch} / the batch's cost "
        "over one): "
        + ", ".join(f"{name} {c:.2f}x" for name, c in report["batching_ceiling"].items())
    )
    write_json(
        args.json,
        {
            "benchmark": "step_profile",
            "command": "python -m benchmarks.step_profile "
            + " ".join(sys.argv[1:] if argv is None else argv),
            "machine": machine(),
            "model": str(model_dir),
            **report,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
