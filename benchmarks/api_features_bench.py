"""What logprobs and JSON constraints cost a decode, MTP on (issue 12).

    python -m benchmarks.api_features_bench [--json OUT] [--rounds 5] [--max-tokens 64]

Four variants decode the bundled chat prompt with the in-process engine, sampled at the
model card's temperature with fixed seeds, in interleaved rounds (order shuffled each round):

  plain     no extras
  logprobs  `logprobs` with the 20 likeliest alternatives at every token
  json      a JSON schema (one long string field, so every variant decodes about as far):
            llguidance's masks from the engine, applied at the tail before sampling and
            verifying the MTP draft
  json+lp   both

Reported: decode tokens/s (after the first token), its median ratio to `plain` over the same
(round, seed), MTP acceptance, and for `json` the engine's time computing masks per step.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path
from typing import Any

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
from cluster.decode.engine import GenerationEngine, GenerationRequest
from cluster.decode.local_engine import open_local_engine
from cluster.messages import RequestOptions, SamplingParams
from coordinator.response_format import JsonConstraint, JsonGrammars
from coordinator.text_stream import stop_token_ids

VARIANTS = ("plain", "logprobs", "json", "json+lp")
LONG_TEXT_SCHEMA = {
    "type": "object",
    "properties": {"source": {"type": "string", "minLength": 2000}},
    "required": ["source"],
}


class TimedConstraint:
    """A JSON constraint that keeps the time its mask calls take."""

    def __init__(self, inner: JsonConstraint) -> None:
        self.inner = inner
        self.mask_s: list[float] = []

    def masks(self, drafts: tuple[int, ...]) -> tuple[bytes, ...]:
        start = time.perf_counter()
        out = self.inner.masks(drafts)
        self.mask_s.append(time.perf_counter() - start)
        return out

    def advance(self, tokens: tuple[int, ...]) -> None:
        self.inner.advance(tokens)


async def measure(args: argparse.Namespace, model_dir: Path) -> list[dict[str, Any]]:
    tokenizer = load_tokenizer(model_dir)
    prompt = encode(tokenizer, CODE_PROMPTS[-1])
    stops = stop_token_ids(tokenizer)
    grammars = JsonGrammars(tokenizer, stops)
    local = await open_local_engine(model_dir)
    engine: GenerationEngine = local.engine
    order = random.Random(0)
    samples = []
    try:
        for round_ in range(args.rounds + 1):  # round 0 warms up
            variants = list(VARIANTS)
            order.shuffle(variants)
            for variant in variants:
                constrained = variant.startswith("json")
                with_lp = variant in ("logprobs", "json+lp")
                sampling = SamplingParams(temperature=SAMPLED_TEMPERATURE, seed=round_)
                options = RequestOptions(sampling, logprobs=with_lp, top_logprobs=20 * with_lp)
                constraint = (
                    TimedConstraint(grammars.constraint(LONG_TEXT_SCHEMA)) if constrained else None
                )
                # Stop tokens ignored (the schema cannot end early anyway): equal lengths.
                request = GenerationRequest(
                    prompt, args.max_tokens, options, frozenset(), constraint=constraint
                )
                out = await engine.generate(request)
                if round_:
                    samples.append(
                        {
                            "round": round_,
                            "variant": variant,
                            "tokens": len(out.tokens),
                            "tps": out.generation_tps,
                            "acceptance": out.accepted / out.drafted if out.drafted else 0.0,
                            "mask_ms": median(constraint.mask_s) * 1e3 if constraint else None,
                        }
                    )
    finally:
        local.close()
    return samples


def summarize(samples: list[dict[str, Any]]) -> dict[str, Any]:
    by = {v: sorted((s for s in samples if s["variant"] == v), key=lambda s: s["round"])
          for v in VARIANTS}  # fmt: skip
    plain = [s["tps"] for s in by["plain"]]
    out = {}
    for variant, runs in by.items():
        tps = [s["tps"] for s in runs]
        ratios = paired_ratios(tps, plain)
        masks = [s["mask_ms"] for s in runs if s["mask_ms"] is not None]
        out[variant] = {
            "tokens_per_s": median(tps),
            "ratio_to_plain": median(ratios),
            "ratio_quartiles": spread(ratios),
            "acceptance": median(s["acceptance"] for s in runs),
            "tokens": median(s["tokens"] for s in runs),
            "mask_ms_per_step": median(masks) if masks else None,
        }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser("api_features_bench", __doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    model_dir = args.model or default_model()
    samples = asyncio.run(measure(args, model_dir))
    summary = summarize(samples)
    print(f"{'variant':<10} {'tok/s':>8} {'x plain':>8} {'quartiles':>13} {'accept':>7} "
          f"{'mask ms/step':>13}")  # fmt: skip
    for variant, row in summary.items():
        low, high = row["ratio_quartiles"]
        mask = f"{row['mask_ms_per_step']:.3f}" if row["mask_ms_per_step"] is not None else "-"
        print(
            f"{variant:<10} {row['tokens_per_s']:>8.1f} {row['ratio_to_plain']:>8.2f} "
            f"{low:>6.2f}-{high:<6.2f} {row['acceptance']:>7.0%} {mask:>13}"
        )
    write_json(
        args.json,
        {
            "benchmark": "api_features_bench",
            "command": "python -m benchmarks.api_features_bench "
            + " ".join(sys.argv[1:] if argv is None else argv),
            "machine": machine(),
            "model": str(model_dir),
            "settings": {"rounds": args.rounds, "max_tokens": args.max_tokens},
            "summary": summary,
            "samples": samples,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
