"""One `cluster bench` run against a coordinator's URL: scenarios in, a report dict out.

For each scenario: snapshot the nodes' counters (`/api/cluster`), run its requests, snapshot
again, check every request against what was asked (prompt length and generated count, from
the server's usage), then summarize (`metrics`) and break the time down per node (`nodes`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cluster.bench import metrics, nodes
from cluster.bench.client import BenchError, Client, RequestRecord, run_scenario
from cluster.bench.workload import PromptSource, Scenario

WARMUP_PROMPT_TOKENS = 16
WARMUP_MAX_TOKENS = 4


@dataclass(frozen=True, slots=True)
class BenchPlan:
    """What to run: the scenarios, and the model whose tokenizer makes the prompts."""

    model_dir: Path
    max_context: int
    scenarios: tuple[Scenario, ...]
    seed: int = 0

    def __post_init__(self) -> None:
        for scenario in self.scenarios:
            needed = scenario.prompt_tokens + scenario.max_tokens
            if needed > self.max_context:
                raise BenchError(
                    f"a {scenario.prompt_tokens}-token prompt plus {scenario.max_tokens} "
                    f"generated tokens needs {needed} positions; the model's context is "
                    f"{self.max_context} tokens"
                )

    @property
    def total_requests(self) -> int:
        return sum(s.requests for s in self.scenarios)


async def run_benchmark(
    url: str,
    plan: BenchPlan,
    prompts: PromptSource,
    *,
    on_request_done: Callable[[], None] = lambda: None,
) -> dict[str, Any]:
    """Run every scenario of `plan` against the coordinator at `url`."""
    probe = Client(url, model="")
    try:
        cluster = await probe.get_json("/api/cluster")
        served = await probe.get_json("/v1/models")
    finally:
        await probe.close()
    model_id = _served_model(served, plan.model_dir)
    client = Client(url, model_id)
    try:
        warmup = Scenario(WARMUP_PROMPT_TOKENS, WARMUP_MAX_TOKENS, 1, True, True, concurrency=1)
        await _run_checked(client, warmup, [prompts.take(WARMUP_PROMPT_TOKENS)], plan.seed)
        results = []
        for scenario in plan.scenarios:
            batch = [prompts.take(scenario.prompt_tokens) for _ in range(scenario.requests)]
            before = nodes.snapshot(await client.get_json("/api/cluster"))
            records, wall = await _run_checked(client, scenario, batch, plan.seed, on_request_done)
            after = nodes.snapshot(await client.get_json("/api/cluster"))
            results.append(
                {
                    "name": scenario.name,
                    "settings": scenario.settings(),
                    "metrics": metrics.summarize(records, wall),
                    "nodes": nodes.breakdown(before, after, wall),
                    "requests": [_request_row(r) for r in records],
                }
            )
    finally:
        await client.close()
    return {
        "url": url,
        "model": model_id,
        "hardware": nodes.hardware(cluster),
        "scenarios": results,
    }


async def _run_checked(
    client: Client,
    scenario: Scenario,
    batch: list[tuple[int, ...]],
    seed: int,
    on_done: Callable[[], None] = lambda: None,
) -> tuple[list[RequestRecord], float]:
    """Run, then hold every request to what was asked; a server that refuses them all stops
    the bench with its own message."""
    records, wall = await run_scenario(client, scenario, batch, seed=seed, on_done=on_done)
    for record in records:
        if record.ok and record.prompt_tokens != scenario.prompt_tokens:
            record.error = (
                f"the server counted {record.prompt_tokens} prompt tokens, "
                f"{scenario.prompt_tokens} were sent"
            )
        elif record.ok and record.completion_tokens != scenario.max_tokens:
            record.error = (
                f"the server generated {record.completion_tokens} tokens, "
                f"{scenario.max_tokens} were asked (ignore_eos)"
            )
    if records and not any(r.ok for r in records):
        raise BenchError(f"every request of {scenario.name} failed: {records[0].error}")
    return records, wall


def _served_model(served: dict[str, Any], model_dir: Path) -> str:
    """The coordinator's model id; it must be the model whose tokenizer makes the prompts."""
    try:
        model_id = served["data"][0]["id"]
    except (KeyError, IndexError, TypeError):
        raise BenchError(f"the server's /v1/models answer names no model: {served}") from None
    if model_id != model_dir.name:
        raise BenchError(
            f"the coordinator serves {model_id!r}, but the prompts would come from the "
            f"tokenizer of {model_dir}; pass --model with the served model's directory"
        )
    return model_id


def _request_row(record: RequestRecord) -> dict[str, Any]:
    return {
        "sent_s": record.sent,
        "prompt_tokens": record.prompt_tokens,
        "completion_tokens": record.completion_tokens,
        "drafted": record.drafted,
        "accepted": record.accepted,
        "ttft_s": record.ttft,
        "latency_s": record.latency,
        "chunks": len(record.itl) + (1 if record.ok else 0),
        "error": record.error,
    }
