"""Decode speed of the engine with MTP and without, against mlx-lm, in one run (issue 2).

    python -m benchmarks.engine_bench [--json OUT] [--rounds 3] [--max-tokens 96]

Part 1, end to end. Three variants decode the same code prompts, greedy and sampled
(temperature 0.7, fixed seeds), in interleaved rounds (the order shuffled each time):

  mtp-on   the in-process engine (`open_local_engine`), MTP drafting one token per step
  mtp-off  the same engine, the request's `mtp` option off
  mlx-lm   mlx-lm's `stream_generate` on the same model directory

Decode tokens/s excludes the prefill: tokens after the first over the time after the first
(the engine's `GenerationOutput.generation_tps` is this; for mlx-lm the same quantity is
taken from the time stamps of its responses, since its own `generation_tps` counts the first
token but not its time). Stop tokens are ignored so that every run decodes exactly
--max-tokens tokens. Ratios are medians of per-(round, prompt, mode) ratios. Each run also
records tokens per CPU-second of the process (all its threads), which a busy shared machine
disturbs less than wall time; mlx-lm overlaps graph building with compute on a second
thread, which wall time rewards and CPU time does not, so the two can differ for mlx-lm.

Part 2, step by step. On a machine whose background load swings by 2x within seconds, whole
runs are too coarse to interleave; so the cost of one decode step of each kind is also
timed call by call, interleaved (`benchmarks.stepping`): mlx-lm's forward of 1 token and
of 2 tokens on a warm cache, and the engine's shard stepping a request plainly or with MTP
(layers, lm_head, sampling, verification and the MTP draft). With acceptance a, MTP emits
1 + a tokens per step, so its speedup is (1 + a) / (MTP step / plain step); this prediction
is printed beside the end-to-end ratio.

Part 3, when `cluster.model.convert` exists: MTP acceptance of the model converted to 8 and 4
bits, on the same prompts and seeds.
"""

from __future__ import annotations

import asyncio
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx

from benchmarks.common import (
    CODE_PROMPTS,
    SAMPLED_TEMPERATURE,
    bench_parser,
    default_model,
    encode,
    load_tokenizer,
    machine,
    median,
    paired_ratios,
    spread,
    write_json,
)
from benchmarks.stepping import LMForward, SteppedRequests, bare_runner, interleaved
from cluster.decode.engine import GenerationEngine, GenerationRequest
from cluster.decode.local_engine import open_local_engine
from cluster.messages import RequestOptions, SamplingParams

VARIANTS = ("mtp-on", "mtp-off", "mlx-lm")
MODES = {"greedy": 0.0, "sampled": SAMPLED_TEMPERATURE}
RATIOS = (("mtp-on", "mtp-off"), ("mtp-off", "mlx-lm"), ("mtp-on", "mlx-lm"))


@dataclass(frozen=True, slots=True)
class Sample:
    variant: str
    mode: str
    round: int
    prompt: int
    tokens: int
    decode_tps: float  # tokens after the first / wall time after the first
    cpu_tps: float  # the same tokens / process CPU time after the first
    drafted: int = 0
    accepted: int = 0
    reported_tps: float = 0.0  # what the library itself reports


class _Clock:
    """Wall and process CPU time stamps of the first and the last token of a run."""

    def __init__(self) -> None:
        self.first: tuple[float, float] | None = None
        self.last = (0.0, 0.0)
        self.tokens = 0

    def tick(self, n: int) -> None:
        now = (time.perf_counter(), time.process_time())
        if self.first is None:
            self.first = now
            n -= 1  # the first token is the prefill's
        self.last = now
        self.tokens += n

    def rates(self) -> tuple[float, float]:
        wall, cpu = (b - a for a, b in zip(self.first, self.last, strict=True))
        return (self.tokens / wall if wall else 0.0), (self.tokens / cpu if cpu else 0.0)


# ---- part 1: whole runs ----


async def engine_decode(
    engine: GenerationEngine, ids, max_tokens: int, temp: float, seed: int, mtp: bool
) -> Sample:
    options = RequestOptions(SamplingParams(temperature=temp, seed=seed), mtp=mtp)
    clock, chunk = _Clock(), None
    async for chunk in engine.stream(GenerationRequest(ids, max_tokens, options)):
        clock.tick(len(chunk.tokens))
    wall, cpu = clock.rates()
    variant = "mtp-on" if mtp else "mtp-off"
    return Sample(variant, "", 0, 0, clock.tokens + 1, wall, cpu, chunk.drafted, chunk.accepted)


def mlx_lm_decode(model, tokenizer, ids, max_tokens: int, temp: float, seed: int) -> Sample:
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    mx.random.seed(seed)
    clock, last = _Clock(), None
    for response in stream_generate(
        model, tokenizer, list(ids), max_tokens=max_tokens, sampler=make_sampler(temp)
    ):
        clock.tick(1)
        last = response
    wall, cpu = clock.rates()
    return Sample("mlx-lm", "", 0, 0, clock.tokens + 1, wall, cpu, reported_tps=last.generation_tps)


async def measure_runs(args, model_dir: Path, lm_model, lm_tokenizer, prompts) -> list[Sample]:
    local = await open_local_engine(model_dir, mtp=True)
    try:

        async def run(variant: str, ids, temp: float, seed: int, max_tokens: int) -> Sample:
            if variant == "mlx-lm":
                return mlx_lm_decode(lm_model, lm_tokenizer, ids, max_tokens, temp, seed)
            return await engine_decode(
                local.engine, ids, max_tokens, temp, seed, variant == "mtp-on"
            )

        for variant in VARIANTS:  # warm up every path
            await run(variant, prompts[0], SAMPLED_TEMPERATURE, 0, 16)
        samples: list[Sample] = []
        rng = random.Random(1)
        for rnd in range(args.rounds):
            for p, ids in enumerate(prompts):
                for mode, temp in MODES.items():
                    order = list(VARIANTS)
                    rng.shuffle(order)
                    for variant in order:
                        s = await run(variant, ids, temp, 1000 * rnd + p, args.max_tokens)
                        samples.append(Sample(variant, mode, rnd, p, *astuple_tail(s)))
            print(f"  round {rnd} done", flush=True)
        return samples
    finally:
        local.close()


def astuple_tail(s: Sample) -> tuple:
    return (s.tokens, s.decode_tps, s.cpu_tps, s.drafted, s.accepted, s.reported_tps)


def summarize_runs(samples: list[Sample]) -> dict:
    out = {}
    for mode in MODES:
        by = {
            v: sorted(
                (s for s in samples if s.variant == v and s.mode == mode),
                key=lambda s: (s.round, s.prompt),
            )
            for v in VARIANTS
        }
        drafted = sum(s.drafted for s in by["mtp-on"])
        accepted = sum(s.accepted for s in by["mtp-on"])
        row = {
            "acceptance": accepted / drafted if drafted else 0.0,
            "drafted": drafted,
            "samples": len(by["mtp-on"]),
        }
        for clock in ("decode_tps", "cpu_tps"):
            tps = {v: [getattr(s, clock) for s in by[v]] for v in VARIANTS}
            ratios = {f"{a}/{b}": paired_ratios(tps[a], tps[b]) for a, b in RATIOS}
            row[clock] = {
                "median": {v: median(tps[v]) for v in VARIANTS},
                "ratios": {k: median(r) for k, r in ratios.items()},
                "ratios_iqr": {k: spread(r) for k, r in ratios.items()},
            }
        out[mode] = row
    return out


# ---- part 2: single steps, interleaved call by call ----


def step_costs(model_dir: Path, lm_model, ids: tuple[int, ...], iters: int) -> dict:
    """Median time of one decode step of each kind, the kinds interleaved call by call."""
    runner = bare_runner(model_dir)
    kinds = {
        "mlx-lm forward, 1 token": LMForward(lm_model, ids, tokens=1),
        "mlx-lm forward, 2 tokens": LMForward(lm_model, ids, tokens=2),
    }
    for mode, temp in MODES.items():
        sampling = SamplingParams(temperature=temp)
        kinds[f"engine plain step, {mode}"] = SteppedRequests(
            runner, ids, sampling=sampling, name=f"p-{mode}"
        )
        kinds[f"engine MTP step, {mode}"] = SteppedRequests(
            runner, ids, depth=1, sampling=sampling, name=f"m-{mode}"
        )
    times = interleaved(kinds, iters, warmup=5, seed=0)
    ms = {k: median(v) * 1e3 for k, v in times.items()}
    one = ms["mlx-lm forward, 1 token"]
    ratios = {"mlx-lm 2 tokens / 1 token": ms["mlx-lm forward, 2 tokens"] / one}
    for mode in MODES:
        plain, mtp = ms[f"engine plain step, {mode}"], ms[f"engine MTP step, {mode}"]
        ratios[f"engine MTP step / plain step, {mode}"] = mtp / plain
        ratios[f"engine plain step / mlx-lm 1 token, {mode}"] = plain / one
    return {"iters": iters, "median_ms": ms, "ratios": ratios}


# ---- part 3: acceptance of quantized conversions ----


async def quantized_acceptance(args, model_dir: Path, prompts) -> dict:
    try:
        from cluster.model.convert import convert
    except ImportError as error:
        return {"skipped": f"cluster.model.convert is not importable: {error}"}
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        dirs = {"bf16": model_dir}
        for bits in (8, 4):
            dirs[f"q{bits}"] = convert(model_dir, Path(tmp) / f"q{bits}", q_bits=bits)
        for name, path in dirs.items():
            local = await open_local_engine(path, mtp=True)
            try:
                row = {}
                for mode, temp in MODES.items():
                    runs = [
                        await engine_decode(local.engine, ids, args.quant_max_tokens, temp, p, True)
                        for p, ids in enumerate(prompts)
                    ]
                    drafted = sum(r.drafted for r in runs)
                    row[mode] = {
                        "acceptance": sum(r.accepted for r in runs) / drafted if drafted else 0,
                        "drafted": drafted,
                    }
                results[name] = row
            finally:
                local.close()
            print(f"  acceptance of {name} done", flush=True)
    return results


# ---- report ----


def predicted(summary: dict, steps: dict) -> dict:
    """MTP's speedup as acceptance and the step costs predict it: (1 + a) / cost ratio."""
    return {
        mode: (1 + summary[mode]["acceptance"])
        / steps["ratios"][f"engine MTP step / plain step, {mode}"]
        for mode in MODES
    }


def print_report(summary: dict, steps: dict, quant: dict, args) -> None:
    print(
        f"\n1. decode tokens/s, {args.max_tokens} tokens, {args.prompts} prompts x "
        f"{args.rounds} rounds (medians; ratios: medians of paired ratios, IQR in brackets)"
    )
    for clock, title in (("decode_tps", "wall clock"), ("cpu_tps", "per CPU-second")):
        print(f"  {title}")
        print(
            f"  {'mode':<8} {'mtp-on':>8} {'mtp-off':>8} {'mlx-lm':>8}  "
            + " ".join(f"{a + '/' + b:>18}" for a, b in RATIOS)
        )
        for mode, row in summary.items():
            t, r, q = (row[clock][k] for k in ("median", "ratios", "ratios_iqr"))
            cells = [f"{r[k]:.2f} [{q[k][0]:.2f}-{q[k][1]:.2f}]" for k in r]
            print(
                f"  {mode:<8} {t['mtp-on']:>8.1f} {t['mtp-off']:>8.1f} {t['mlx-lm']:>8.1f}  "
                + " ".join(f"{c:>18}" for c in cells)
            )
    print(
        "  acceptance: "
        + ", ".join(
            f"{m} {row['acceptance']:.1%} of {row['drafted']}" for m, row in summary.items()
        )
    )
    print(f"\n2. one decode step, interleaved call by call ({steps['iters']} each, medians)")
    for kind, ms in steps["median_ms"].items():
        print(f"  {kind:<34} {ms:7.2f} ms")
    for name, ratio in steps["ratios"].items():
        print(f"  {name:<44} {ratio:.2f}x")
    for mode, speedup in predicted(summary, steps).items():
        print(f"  MTP speedup predicted by (1 + acceptance) / step cost, {mode}: {speedup:.2f}x")
    if "skipped" in quant:
        print(f"\n3. quantized acceptance: skipped ({quant['skipped']})")
        return
    print(
        f"\n3. MTP acceptance by weights ({args.prompts} prompts, {args.quant_max_tokens} tokens)"
    )
    for name, row in quant.items():
        print(
            f"  {name:<5} greedy {row['greedy']['acceptance']:.1%}   "
            f"sampled {row['sampled']['acceptance']:.1%}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser("engine_bench", __doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=len(CODE_PROMPTS))
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--step-iters", type=int, default=100)
    parser.add_argument("--quant-max-tokens", type=int, default=64)
    parser.add_argument("--no-quantized", action="store_true", help="skip part 3")
    args = parser.parse_args(argv)
    model_dir = args.model or default_model()
    started = time.perf_counter()

    from mlx_lm import load

    tokenizer = load_tokenizer(model_dir)
    prompts = [encode(tokenizer, p) for p in CODE_PROMPTS[: args.prompts]]
    lm_model, lm_tokenizer = load(str(model_dir))
    lm_tokenizer.eos_token_ids = set()  # decode exactly max_tokens, like the engine
    samples = asyncio.run(measure_runs(args, model_dir, lm_model, lm_tokenizer, prompts))
    summary = summarize_runs(samples)
    steps = step_costs(model_dir, lm_model, prompts[0], args.step_iters)
    print("  steps done", flush=True)
    quant = (
        {"skipped": "--no-quantized"}
        if args.no_quantized
        else asyncio.run(quantized_acceptance(args, model_dir, prompts))
    )
    print_report(summary, steps, quant, args)
    print(f"({time.perf_counter() - started:.0f} s)")
    write_json(
        args.json,
        {
            "benchmark": "engine_bench",
            "command": "python -m benchmarks.engine_bench "
            + " ".join(sys.argv[1:] if argv is None else argv),
            "machine": machine(),
            "model": str(model_dir),
            "settings": {
                "rounds": args.rounds,
                "prompts": list(CODE_PROMPTS[: args.prompts]),
                "max_tokens": args.max_tokens,
                "modes": MODES,
                "step_iters": args.step_iters,
                "quant_max_tokens": args.quant_max_tokens,
            },
            "summary": summary,
            "step_costs": steps,
            "predicted_mtp_speedup": predicted(summary, steps),
            "quantized_acceptance": quant,
            "samples": [asdict(s) for s in samples],
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
