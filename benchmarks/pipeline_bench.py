"""Decode speed over 1, 2 and 3 local node processes against one process (issue 3).

    python -m benchmarks.pipeline_bench [--json OUT] [--rounds 3] [--max-tokens 96]

Six node daemons start on loopback (`python -m cluster node ... --no-advertise`): one
pipeline of 1 node, one of 2 and one of 3 (even layer splits), all loaded at once, plus the
in-process engine (`open_local_engine`). Each round decodes every prompt on every pipeline
with MTP on and off, the order shuffled (sampled, temperature 0.7, a fixed seed per prompt,
stop tokens ignored), then runs mlx-lm's own pipeline on the ring backend over 2 processes
(`cluster.bench.ring_baseline`) on the same prompts and seeds, twice: launched by
`mlx.launch`, and with the same ranks and environment started directly (mlx.launch's output
relay spins on a core, which a 2-core machine feels; see `run_ring`).

Reported: median decode tokens/s, each pipeline over the in-process engine (medians of
paired ratios), our 2 nodes over mlx-lm's 2-rank ring, whether every pipeline emitted the
same tokens as the in-process engine, the one-way cost of a hop from `benchmarks.hop`
(a decode-size `StepBatch` on a gRPC stream, codec included), and the per-message overhead
the decode step times imply: a step over n nodes sends n + 1 messages (driver -> head,
n - 1 hops, tail -> driver), so (step time over n nodes - step time in process) / (n + 1).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.common import (
    CODE_PROMPTS,
    SAMPLED_TEMPERATURE,
    LocalNodes,
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
from benchmarks import hop
from cluster.bench.ring_baseline import run_ring
from cluster.config import load_model_config
from cluster.decode.engine import GenerationEngine, GenerationRequest
from cluster.decode.local_engine import open_local_engine
from cluster.messages import RequestOptions, SamplingParams
from cluster.model.shard import even_ranges
from cluster.transport import wire
from cluster.transport.node_client import open_remote_engine

PIPELINES = ("local", "1 node", "2 nodes", "3 nodes")
LAUNCHERS = ("mlx.launch", "direct")  # see cluster.bench.ring_baseline.run_ring
HOP_SHAPES = ((1, 2, 256), (1, 2, 5120))  # a decode step [y, d]: the bundled model; 27B


@dataclass(frozen=True, slots=True)
class Sample:
    pipeline: str
    mtp: bool
    round: int
    prompt: int
    decode_tps: float
    tokens: tuple[int, ...]
    drafted: int
    accepted: int


async def decode(engine: GenerationEngine, ids, max_tokens: int, temp: float, seed: int, mtp: bool):
    options = RequestOptions(SamplingParams(temperature=temp, seed=seed), mtp=mtp)
    return await engine.generate(GenerationRequest(ids, max_tokens, options))


async def measure(args, model_dir: Path, nodes: LocalNodes) -> tuple[list[Sample], list[dict]]:
    tokenizer = load_tokenizer(model_dir)
    prompts = [encode(tokenizer, p) for p in CODE_PROMPTS[: args.prompts]]
    num_layers = load_model_config(model_dir).num_layers
    addresses = nodes.addresses
    engines: dict[str, GenerationEngine] = {}
    async with contextlib.AsyncExitStack() as stack:
        local = await open_local_engine(model_dir, mtp=True)
        stack.callback(local.close)
        engines["local"] = local.engine
        used = 0
        for n in (1, 2, 3):
            remote = await open_remote_engine(
                model_dir,
                addresses[used : used + n],
                token=nodes.token,
                ranges=even_ranges(num_layers, n),
            )
            stack.push_async_callback(remote.close)
            engines[PIPELINES[n]] = remote.engine
            used += n
        variants = [(p, mtp) for p in PIPELINES for mtp in (True, False)]
        for name, mtp in variants:  # warm up every path
            await decode(engines[name], prompts[0], 16, args.temperature, 0, mtp)
        samples: list[Sample] = []
        rings: list[dict] = []
        rng = random.Random(2)
        for rnd in range(args.rounds):
            for p, ids in enumerate(prompts):
                order = list(variants)
                rng.shuffle(order)
                for name, mtp in order:
                    seed = 1000 * rnd + p
                    out = await decode(
                        engines[name], ids, args.max_tokens, args.temperature, seed, mtp
                    )
                    samples.append(
                        Sample(
                            name,
                            mtp,
                            rnd,
                            p,
                            out.generation_tps,
                            out.tokens,
                            out.drafted,
                            out.accepted,
                        )
                    )
            print(f"  round {rnd}: pipelines done", flush=True)
            if args.no_ring:
                continue
            for launcher in rng.sample(LAUNCHERS, len(LAUNCHERS)):
                rings.append(await asyncio.to_thread(ring_round, args, model_dir, rnd, launcher))
        return samples, rings


def ring_round(args, model_dir: Path, rnd: int, launcher: str) -> dict:
    for attempt in range(args.ring_attempts):
        try:
            report = run_ring(
                model_dir,
                ranks=2,
                max_tokens=args.max_tokens,
                prompts=args.prompts,
                temperature=args.temperature,
                seed_base=1000 * rnd,
                launcher=launcher,
            )
            tps = report["median_tps"]
            print(f"  round {rnd}: mlx-lm ring ({launcher}) {tps:.1f} tokens/s", flush=True)
            return report | {"round": rnd, "attempt": attempt}
        except (RuntimeError, subprocess.TimeoutExpired) as error:
            text = str(error)
            print(
                f"  round {rnd}: mlx-lm ring ({launcher}) failed (attempt {attempt}): "
                f"{_first_error_line(text)}",
                flush=True,
            )
            last = {"round": rnd, "launcher": launcher, "error": _trim(text)}
    return last


def _first_error_line(text: str) -> str:
    for line in text.splitlines():
        if "Error" in line or "lost" in line:
            return line.strip()
    return text.splitlines()[0] if text else ""


def _trim(text: str) -> str:
    """The error text without the ring's thousand repeats of the same send failure."""
    lines, seen = [], set()
    for line in text.splitlines():
        if line in seen and line.startswith("[ring]"):
            continue
        seen.add(line)
        lines.append(line)
    return "\n".join(lines)[-3000:]


def hop_cost(args) -> list[dict]:
    tuned = hop.Setup("tuned", wire.grpc_server_options(), wire.grpc_channel_options())
    rows = asyncio.run(
        hop.measure([tuned], ["proto"], HOP_SHAPES, args.hop_rounds, args.hop_iters, 100)
    )
    return [asdict(r) for r in rows]


def summarize(samples: list[Sample], rings: list[dict]) -> dict:
    def series(name: str, mtp: bool) -> list[Sample]:
        return sorted(
            (s for s in samples if s.pipeline == name and s.mtp == mtp),
            key=lambda s: (s.round, s.prompt),
        )

    out: dict = {
        "tps": {},
        "over_local": {},
        "over_local_iqr": {},
        "same_tokens": {},
        "acceptance": {},
        "message_overhead_us": {},
    }
    for mtp in (True, False):
        key = "mtp-on" if mtp else "mtp-off"
        local = series("local", mtp)
        local_tps = [s.decode_tps for s in local]
        for name in PIPELINES:
            rows = series(name, mtp)
            tps = [s.decode_tps for s in rows]
            out["tps"][f"{name}, {key}"] = median(tps)
            ratios = paired_ratios(tps, local_tps)
            out["over_local"][f"{name}, {key}"] = median(ratios)
            out["over_local_iqr"][f"{name}, {key}"] = spread(ratios)
            out["same_tokens"][f"{name}, {key}"] = all(
                a.tokens == b.tokens for a, b in zip(rows, local, strict=True)
            )
            drafted = sum(s.drafted for s in rows)
            out["acceptance"][f"{name}, {key}"] = (
                sum(s.accepted for s in rows) / drafted if drafted else 0.0
            )
            if name != "local" and not mtp:
                n = PIPELINES.index(name)
                extra = [1 / a - 1 / b for a, b in zip(tps, local_tps, strict=True)]
                out["message_overhead_us"][name] = median(extra) / (n + 1) * 1e6
    for launcher in LAUNCHERS:
        by_round = {
            r["round"]: r["median_tps"]
            for r in rings
            if "median_tps" in r and r["launcher"] == launcher
        }
        if not by_round:
            continue
        ring = {"tps": median(by_round.values()), "rounds": len(by_round)}
        for key, mtp in (("mtp-on", True), ("mtp-off", False)):
            two = series("2 nodes", mtp)
            ring[f"2 nodes over it, {key}"] = median(
                median(s.decode_tps for s in two if s.round == rnd) / tps
                for rnd, tps in by_round.items()
            )
        out[f"mlx-lm ring ({launcher})"] = ring
    out["ring_failures"] = [r for r in rings if "error" in r]
    return out


def print_report(summary: dict, hops: list[dict], args) -> None:
    print(
        f"\ndecode tokens/s, {args.max_tokens} tokens, {args.prompts} prompts x "
        f"{args.rounds} rounds, temperature {args.temperature} (medians; ratios are medians "
        "of paired ratios, IQR in brackets)"
    )
    print(
        f"{'pipeline':<10} {'MTP':<4} {'tokens/s':>9} {'over local':>20} {'accept':>7} "
        f"{'same tokens':>11}"
    )
    for name in PIPELINES:
        for key in ("mtp-on", "mtp-off"):
            k = f"{name}, {key}"
            lo, hi = summary["over_local_iqr"][k]
            print(
                f"{name:<10} {key[4:]:<4} {summary['tps'][k]:>9.1f} "
                f"{summary['over_local'][k]:>7.2f} [{lo:.2f}-{hi:.2f}] "
                f"{summary['acceptance'][k]:>7.1%} {summary['same_tokens'][k]!s:>11}"
            )
    for name, us in summary["message_overhead_us"].items():
        print(f"implied overhead per message, {name}, MTP off: {us:.0f} us")
    for row in hops:
        print(
            f"hop (benchmarks.hop, proto stream) {row['shape']}: {row['median_us']:.0f} us "
            f"one way (p90 {row['p90_us']:.0f})"
        )
    for launcher in LAUNCHERS:
        ring = summary.get(f"mlx-lm ring ({launcher})")
        if ring:
            print(
                f"mlx-lm ring pipeline, 2 ranks ({launcher}): {ring['tps']:.1f} tokens/s; our "
                f"2 nodes over it: MTP on {ring['2 nodes over it, mtp-on']:.2f}x, "
                f"MTP off {ring['2 nodes over it, mtp-off']:.2f}x"
            )
    for failure in summary["ring_failures"]:
        print(
            f"mlx-lm ring ({failure['launcher']}) failed in round {failure['round']}: "
            f"{_first_error_line(failure['error'])}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser("pipeline_bench", __doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--temperature", type=float, default=SAMPLED_TEMPERATURE)
    parser.add_argument("--no-ring", action="store_true", help="skip mlx-lm's ring pipeline")
    parser.add_argument("--ring-attempts", type=int, default=2)
    parser.add_argument("--hop-rounds", type=int, default=3)
    parser.add_argument("--hop-iters", type=int, default=300)
    args = parser.parse_args(argv)
    model_dir = args.model or default_model()
    started = time.perf_counter()
    with LocalNodes(6) as nodes:
        samples, rings = asyncio.run(measure(args, model_dir, nodes))
    hops = hop_cost(args)
    summary = summarize(samples, rings)
    print_report(summary, hops, args)
    print(f"({time.perf_counter() - started:.0f} s)")
    write_json(
        args.json,
        {
            "benchmark": "pipeline_bench",
            "command": "python -m benchmarks.pipeline_bench "
            + " ".join(sys.argv[1:] if argv is None else argv),
            "machine": machine(),
            "model": str(model_dir),
            "settings": vars(args)
            | {"model": str(model_dir), "prompts": list(CODE_PROMPTS[: args.prompts])},
            "summary": summary,
            "hop": hops,
            "ring": rings,
            "samples": [asdict(s) | {"tokens": len(s.tokens)} for s in samples],
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
