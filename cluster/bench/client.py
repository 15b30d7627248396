"""The bench's HTTP client: streaming `/v1/completions`, timed chunk by chunk.

Token counts come from the server's own usage (`stream_options.include_usage`), never from
counting chunks or re-tokenizing text; MTP drafts come from its
`completion_tokens_details` (accepted / rejected prediction tokens). Timing follows
`vllm bench serve`: the clock starts when the request is sent, TTFT ends at the first chunk
that carries text, every later text chunk adds one inter-token latency, and the latency ends
at the last text chunk.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from cluster.bench.workload import SAMPLED_TEMPERATURE, Scenario

REQUEST_TIMEOUT_S = 600.0


class BenchError(RuntimeError):
    """The server could not be reached or refused the benchmark's requests."""


@dataclass(slots=True)
class RequestRecord:
    """One request as the client saw it. Times in seconds; `sent` from the scenario's start."""

    sent: float
    prompt_tokens: int = 0  # the server's usage
    cached_tokens: int = 0  # of the prompt, taken from the server's conversation cache
    completion_tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


class Client:
    """One aiohttp session against a coordinator's OpenAI API."""

    def __init__(
        self,
        url: str,
        model: str,
        api_key: str | None = None,
        mtp_depth: int | str | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.model = model
        self.api_key = api_key
        self.mtp_depth = mtp_depth  # drafts per step with MTP on; None: the server's default
        timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S, sock_connect=10)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._session = aiohttp.ClientSession(
            timeout=timeout, connector=aiohttp.TCPConnector(limit=0), headers=headers
        )

    async def close(self) -> None:
        await self._session.close()

    async def get_json(self, path: str) -> dict[str, Any]:
        try:
            async with self._session.get(f"{self.url}{path}") as response:
                if response.status in (401, 403):
                    raise BenchError(
                        f"{self.url}{path} wants an API key (--api-key or CLUSTER_API_KEY): "
                        f"HTTP {response.status}"
                    )
                return await response.json(content_type=None)
        except (aiohttp.ClientError, OSError, TimeoutError, json.JSONDecodeError) as error:
            reason = str(error) or type(error).__name__
            raise BenchError(f"cannot reach {self.url}{path}: {reason}") from None

    async def complete(
        self, prompt: Sequence[int], scenario: Scenario, seed: int, start: float
    ) -> RequestRecord:
        """Send one streaming completion; a refusal or a broken stream is the record's error."""
        body = {"prompt": list(prompt)}
        return await self._stream("/v1/completions", body, scenario, seed, start)

    async def chat(
        self, messages: list[dict[str, str]], scenario: Scenario, seed: int, start: float
    ) -> RequestRecord:
        """`complete` for a chat: the server renders the messages with its chat template."""
        return await self._stream(
            "/v1/chat/completions", {"messages": messages}, scenario, seed, start
        )

    async def _stream(
        self, path: str, prompt: dict[str, Any], scenario: Scenario, seed: int, start: float
    ) -> RequestRecord:
        record = RequestRecord(sent=time.perf_counter() - start)
        body = {
            "model": self.model,
            **prompt,
            "max_tokens": scenario.max_tokens,
            "ignore_eos": True,
            "mtp": scenario.mtp,
            "temperature": SAMPLED_TEMPERATURE if scenario.sampled else 0.0,
            "seed": seed,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if scenario.mtp and self.mtp_depth is not None:
            body["mtp_depth"] = self.mtp_depth
        sent = time.perf_counter()
        try:
            async with self._session.post(f"{self.url}{path}", json=body) as response:
                if response.status != 200:
                    message = _error_message(await response.text())
                    record.error = f"HTTP {response.status}: {message}"
                    return record
                await self._read_stream(response, record, sent)
        except (aiohttp.ClientError, OSError, TimeoutError) as error:
            record.error = f"{type(error).__name__}: {error}"
        return record

    async def _read_stream(
        self, response: aiohttp.ClientResponse, record: RequestRecord, sent: float
    ) -> None:
        last: float | None = None
        async for raw in response.content:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                record.error = f"the stream failed: {event['error'].get('message')}"
                return
            now = time.perf_counter()
            if event.get("choices") and _has_text(event["choices"][0]):
                if last is None:
                    record.ttft = now - sent
                else:
                    record.itl.append(now - last)
                last = now
            if usage := event.get("usage"):
                record.prompt_tokens = usage["prompt_tokens"]
                cached = usage.get("prompt_tokens_details") or {}
                record.cached_tokens = cached.get("cached_tokens") or 0
                record.completion_tokens = usage["completion_tokens"]
                details = usage.get("completion_tokens_details") or {}
                record.accepted = details.get("accepted_prediction_tokens", 0)
                record.drafted = record.accepted + details.get("rejected_prediction_tokens", 0)
        if last is None:
            record.error = "the stream ended without any text"
            return
        record.latency = last - sent


async def run_scenario(
    client: Client,
    scenario: Scenario,
    prompts: list[tuple[int, ...]],
    *,
    seed: int,
    on_done: Callable[[], None] = lambda: None,
) -> tuple[list[RequestRecord], float]:
    """Run the scenario's requests; return their records (in order) and the wall time.

    Closed loop: `concurrency` workers each send their next request when the last one ends.
    Open loop: requests leave at Poisson arrival times (exponential gaps, mean 1 / rate,
    drawn from `seed`), however many are still in flight.
    """
    records: list[RequestRecord | None] = [None] * len(prompts)
    start = time.perf_counter()

    async def one(i: int) -> None:
        records[i] = await client.complete(prompts[i], scenario, seed + i, start)
        on_done()

    if scenario.rate is None:
        pending = iter(range(len(prompts)))

        async def worker() -> None:
            for i in pending:
                await one(i)

        await asyncio.gather(*(worker() for _ in range(scenario.concurrency or 1)))
    else:
        rng = random.Random(seed)
        tasks = []
        for i in range(len(prompts)):
            tasks.append(asyncio.create_task(one(i)))
            if i + 1 < len(prompts):
                await asyncio.sleep(rng.expovariate(scenario.rate))
        await asyncio.gather(*tasks)
    wall = time.perf_counter() - start
    return [r for r in records if r is not None], wall


def _has_text(choice: dict[str, Any]) -> bool:
    """Whether a streamed choice carries text: a completion's, or a chat reply's (its answer
    or its reasoning)."""
    delta = choice.get("delta") or {}
    return bool(choice.get("text") or delta.get("content") or delta.get("reasoning_content"))


def _error_message(text: str) -> str:
    try:
        return json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return text[:500]
