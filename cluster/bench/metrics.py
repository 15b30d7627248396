"""A scenario's figures, with the names and definitions of `vllm bench serve`.

Over the requests that succeeded, with duration the scenario's wall time:

  request_throughput      completed requests / duration                       (req/s)
  output_throughput       sum of completion tokens / duration                 (aggregate tok/s)
  total_token_throughput  sum of prompt + completion tokens / duration
  ttft                    first text chunk - request sent                     (ms)
  tpot                    (latency - ttft) / (completion tokens - 1), for requests of more
                          than one token                                      (ms)
  itl                     every gap between two text chunks, pooled over requests (ms)
  e2el                    last text chunk - request sent                      (ms)

each as mean, median (= p50), p90 and p99 (numpy's linear-interpolation percentiles, as vLLM).
Beyond vLLM's set:

  prefill_throughput      sum of prompt tokens / sum of TTFTs: the prompt rate a request
                          sees, waiting in line included (tok/s)
  per_stream_throughput   mean over requests of (completion tokens - 1) / (latency - ttft):
                          the decode rate one user sees, 1 / TPOT per request (tok/s)
  acceptance_rate         accepted / drafted MTP tokens, summed over requests (None when
                          nothing was drafted, e.g. MTP off)
  auto_depth_mean         drafts chosen / steps decided: the mean MTP depth the tail chose
                          per step over the scenario (`auto`'s choice, or the fixed depth),
                          from the tail's counters (`chosen_depth`; None without MTP steps)
  auto_depth0_share       steps decided at depth 0 / steps decided: how often it did not draft

A chunk may carry several tokens (an accepted MTP draft arrives with its correction), so ITL
is per chunk, as vLLM's is under speculative decoding; TPOT is per token.

A baseline run (mlx-lm in one process, or its ring pipeline: `baselines`) has no requests;
`timing` gives it TTFT, decode tokens/s (tokens after the first over the time after the
first) and prefill tokens/s (prompt tokens / TTFT) from its tokens' arrival times.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from cluster.bench.client import RequestRecord

PERCENTILES = (90, 99)  # and the median, which is p50
LATENCIES = ("ttft", "tpot", "itl", "e2el")


def summarize(records: Sequence[RequestRecord], duration_s: float) -> dict[str, Any]:
    """The scenario's figures from its request records (see the module's definitions)."""
    done = [r for r in records if r.ok]
    prompt = sum(r.prompt_tokens for r in done)
    output = sum(r.completion_tokens for r in done)
    samples = {
        "ttft": [r.ttft for r in done],
        "tpot": [
            (r.latency - r.ttft) / (r.completion_tokens - 1)
            for r in done
            if r.completion_tokens > 1
        ],
        "itl": [gap for r in done for gap in r.itl],
        "e2el": [r.latency for r in done],
    }
    out: dict[str, Any] = {
        "completed": len(done),
        "failed": len(records) - len(done),
        "duration_s": duration_s,
        "total_input_tokens": prompt,
        "total_output_tokens": output,
        "request_throughput": len(done) / duration_s,
        "output_throughput": output / duration_s,
        "total_token_throughput": (prompt + output) / duration_s,
    }
    for name in LATENCIES:
        out |= _distribution(name, samples[name])
    ttft_total = sum(samples["ttft"])
    out["prefill_throughput"] = prompt / ttft_total if ttft_total > 0 else None
    rates = [
        (r.completion_tokens - 1) / (r.latency - r.ttft)
        for r in done
        if r.completion_tokens > 1 and r.latency > r.ttft
    ]
    out["per_stream_throughput"] = float(np.mean(rates)) if rates else None
    drafted = sum(r.drafted for r in done)
    out["mtp_drafted"] = drafted
    out["mtp_accepted"] = sum(r.accepted for r in done)
    out["acceptance_rate"] = out["mtp_accepted"] / drafted if drafted else None
    return out


def chosen_depth(steps: int, plain: int, drafts: int) -> dict[str, float | None]:
    """`auto_depth_mean` and `auto_depth0_share` from the differences of the tail's counters
    over a scenario: `steps` whose depth it chose, `plain` of them at depth 0, `drafts` chosen
    over them. None where no step was decided (MTP off, or a node too old to count)."""
    if steps <= 0:
        return {"auto_depth_mean": None, "auto_depth0_share": None}
    return {"auto_depth_mean": drafts / steps, "auto_depth0_share": plain / steps}


def _distribution(name: str, seconds: Sequence[float]) -> dict[str, float | None]:
    """mean/median/pNN of `name` in milliseconds; None when there is no sample."""
    if not seconds:
        keys = [f"mean_{name}_ms", f"median_{name}_ms"]
        return dict.fromkeys(keys + [f"p{p}_{name}_ms" for p in PERCENTILES])
    ms = np.asarray(seconds, dtype=np.float64) * 1000.0
    out = {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms))}
    for p in PERCENTILES:
        out[f"p{p}_{name}_ms"] = float(np.percentile(ms, p))
    return out


def timing(prompt_tokens: int, started: float, stamps: Sequence[float]) -> dict[str, float]:
    """TTFT, decode and prefill tokens/s from the arrival times of the generated tokens."""
    ttft = stamps[0] - started
    decode = (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else 0.0
    return {
        "generated": len(stamps),
        "ttft_ms": ttft * 1000,
        "decode_tps": decode,
        "prefill_tps": prompt_tokens / ttft if ttft > 0 else 0.0,
    }
