"""One `cluster bench` run against a coordinator's URL: scenarios in, a report dict out.

For each scenario: snapshot the nodes' counters (`/api/cluster`), run its requests, snapshot
again, check every request against what was asked (prompt length and generated count, from
the server's usage), then summarize (`metrics`) and break the time down per node (`nodes`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from cluster.bench import metrics, nodes
from cluster.bench.client import BenchError, Client, RequestRecord, run_scenario
from cluster.bench.workload import PromptSource, Scenario

WARMUP_PROMPT_TOKENS = 16
WARMUP_MAX_TOKENS = 4
COUNTERS_WAIT_S = 15.0  # many heartbeats (1 s apart): a loaded machine answers late
COUNTERS_POLL_S = 0.1
FOLLOW_UP_TOKENS = 16  # the new part of a conversation's next turn
SHARED_PREFIX_CONVERSATIONS = 4  # chats that open with one system prompt
CHAT_SLACK_TOKENS = 64  # what a chat template and re-tokenized text may add to a prompt


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
    api_key: str | None = None,
    mtp_depth: int | str | None = None,
) -> dict[str, Any]:
    """Run every scenario of `plan` against the coordinator at `url`."""
    probe = Client(url, model="", api_key=api_key)
    try:
        cluster = await probe.get_json("/api/cluster")
        served = await probe.get_json("/v1/models")
    finally:
        await probe.close()
    model_id = _served_model(served, plan.model_dir)
    client = Client(url, model_id, api_key, mtp_depth)
    try:
        warmup = Scenario(WARMUP_PROMPT_TOKENS, WARMUP_MAX_TOKENS, 1, True, True, concurrency=1)
        await _run_checked(client, warmup, [prompts.take(WARMUP_PROMPT_TOKENS)], plan.seed)
        after = await counters_since(client, time.monotonic())
        results = []
        for scenario in plan.scenarios:
            batch = [prompts.take(scenario.prompt_tokens) for _ in range(scenario.requests)]
            before = after  # read after the nodes went idle: valid at the scenario's start
            records, wall = await _run_checked(client, scenario, batch, plan.seed, on_request_done)
            after = await counters_since(client, time.monotonic())
            results.append(  # TTFT here is uncached: no two prompts share a prefix
                {
                    "name": scenario.name,
                    "settings": scenario.settings(),
                    "metrics": metrics.summarize(records, wall),
                    "nodes": nodes.breakdown(before, after, wall),
                    "requests": [_request_row(r) for r in records],
                }
            )
        # Each of these reports its own failure: the scenarios above stand without them.
        cached, cached_error = await _or_error(_cached_ttft(client, plan, prompts))
        shared, shared_error = await _or_error(_shared_prefix_ttft(client, plan, prompts))
    finally:
        await client.close()
    return {
        "url": url,
        "model": model_id,
        "hardware": nodes.hardware(cluster),
        "scenarios": results,
        "cached_ttft": cached,
        "shared_prefix_ttft": shared,
        "errors": {
            name: error
            for name, error in (("cached_ttft", cached_error), ("shared_prefix_ttft", shared_error))
            if error
        },
    }


async def _or_error(part: Awaitable[list[dict[str, Any]]]) -> tuple[list[dict[str, Any]], str]:
    """A part's rows and no error, or no rows and why it failed."""
    try:
        return await part, ""
    except BenchError as error:
        return [], str(error)


async def _cached_ttft(
    client: Client, plan: BenchPlan, prompts: PromptSource
) -> list[dict[str, Any]]:
    """Per prompt length, TTFT of a prompt and of its follow-up turn: the same prompt plus
    `FOLLOW_UP_TOKENS` more, whose prefix the server's conversation cache may hold.

    The cached figure is None when the server reports no cached tokens (no conversation cache,
    or it missed); `cached_tokens` says how much of the follow-up it did not prefill.
    """
    first = plan.scenarios[0]
    rows = []
    for length in sorted({s.prompt_tokens for s in plan.scenarios}):
        scenario = Scenario(length, WARMUP_MAX_TOKENS, 1, first.sampled, first.mtp, concurrency=1)
        if length + FOLLOW_UP_TOKENS + WARMUP_MAX_TOKENS > plan.max_context:
            continue
        turn = prompts.take(length + FOLLOW_UP_TOKENS)
        (opening,), _ = await run_scenario(client, scenario, [turn[:length]], seed=plan.seed)
        follow = replace(scenario, prompt_tokens=length + FOLLOW_UP_TOKENS)
        (second,), _ = await run_scenario(client, follow, [turn], seed=plan.seed)
        if not (opening.ok and second.ok):
            raise BenchError(f"the cached-TTFT requests failed: {opening.error or second.error}")
        rows.append(
            {
                "prompt_tokens": length,
                "follow_up_tokens": length + FOLLOW_UP_TOKENS,
                "uncached_ttft_ms": opening.ttft * 1000,
                "cached_ttft_ms": second.ttft * 1000 if second.cached_tokens else None,
                "cached_tokens": second.cached_tokens,
            }
        )
    return rows


async def _shared_prefix_ttft(
    client: Client, plan: BenchPlan, prompts: PromptSource
) -> list[dict[str, Any]]:
    """`SHARED_PREFIX_CONVERSATIONS` chats, one after another, that open with the same system
    prompt (the plan's longest prompt length) and go on with a question of their own: the
    first prefills it all, the later ones only what follows the system prompt when the
    server's conversation cache keeps it. Chats, not token ids, so that the server's chat
    template marks where the system prompt ends."""
    first = plan.scenarios[0]
    length = max(s.prompt_tokens for s in plan.scenarios)
    if length + FOLLOW_UP_TOKENS + CHAT_SLACK_TOKENS + WARMUP_MAX_TOKENS > plan.max_context:
        return []
    scenario = Scenario(length, WARMUP_MAX_TOKENS, 1, first.sampled, first.mtp, concurrency=1)
    system = {"role": "system", "content": prompts.text(length)}
    start = time.perf_counter()
    rows = []
    for i in range(SHARED_PREFIX_CONVERSATIONS):
        question = {"role": "user", "content": prompts.text(FOLLOW_UP_TOKENS)}
        record = await client.chat([system, question], scenario, plan.seed + i, start)
        if not record.ok:
            raise BenchError(f"the shared-prefix requests failed: {record.error}")
        rows.append(
            {
                "conversation": i,
                "system_tokens": length,
                "prompt_tokens": record.prompt_tokens,
                "cached_tokens": record.cached_tokens,
                "ttft_ms": record.ttft * 1000,
            }
        )
    return rows


async def counters_since(client: Client, since: float) -> nodes.NodeSnapshot:
    """The nodes' counters as read by a heartbeat asked after `since` (monotonic time).

    The coordinator reads every node's counters once per heartbeat, so `/api/cluster` may
    show counters a second old; waiting for a reading asked for after the scenario ended (the
    nodes idle since) makes the counters' difference cover exactly the scenario. The ages
    are taken from before the page was asked for, so a slow answer errs toward waiting.
    """
    deadline = time.monotonic() + COUNTERS_WAIT_S
    while True:
        asked = time.monotonic()
        cluster = await client.get_json("/api/cluster")
        placed = nodes.pipeline_nodes(cluster)
        if all(asked - n["last_heartbeat_s"] > since for n in placed) or asked > deadline:
            return nodes.snapshot(cluster)
        await asyncio.sleep(COUNTERS_POLL_S)


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
        "cached_tokens": record.cached_tokens,
        "drafted": record.drafted,
        "accepted": record.accepted,
        "ttft_s": record.ttft,
        "latency_s": record.latency,
        "chunks": len(record.itl) + (1 if record.ok else 0),
        "error": record.error,
    }
