"""The generation engine: one request's loop of pipeline steps, local or across nodes.

The engine knows nothing of where the layers run: it submits steps to a `Pipeline` and reads
the tail's results. A request is a prompt prefill (chunked; all chunks are submitted at once,
so on a multi-node pipeline chunk k+1 enters the head while chunk k is further down), then
decode steps. With MTP, each decode step feeds `[y, d1..dk]`: the last emitted token and the
tail's drafts of the next ones (k is the request's MTP depth, fixed or the tail's choice); the
result says how many positions stay, and the difference travels on the next step as its
rollback signal.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from cluster.decode.pipeline import Pipeline
from cluster.messages import RequestError, RequestOptions, StepRequest, StepResult


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    prompt: tuple[int, ...]
    max_tokens: int
    options: RequestOptions = field(default_factory=RequestOptions)
    stop_tokens: frozenset[int] = frozenset()
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    def __post_init__(self) -> None:
        if not self.prompt:
            raise RequestError("the prompt is empty")
        if self.max_tokens < 1:
            raise RequestError(f"max_tokens must be >= 1, got {self.max_tokens}")


@dataclass(frozen=True, slots=True)
class GenerationChunk:
    tokens: tuple[int, ...]  # newly emitted tokens
    finish_reason: str | None  # "stop" | "length" | None
    drafted: int  # cumulative
    accepted: int  # cumulative
    logprobs: tuple[float, ...] | None = None  # of `tokens`, when the request asked for them
    # Per token of `tokens`, the likeliest (token, logprob) pairs, when asked for.
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] | None = None


@dataclass(frozen=True, slots=True)
class GenerationOutput:
    tokens: tuple[int, ...]
    finish_reason: str
    prompt_tokens: int
    drafted: int
    accepted: int
    generation_tps: float  # tokens/s after the first token
    time_to_first_token_s: float


class GenerationEngine:
    def __init__(self, pipeline: Pipeline, *, prefill_chunk: int = 512):
        self.pipeline = pipeline
        self.prefill_chunk = prefill_chunk

    @property
    def max_context(self) -> int:
        return self.pipeline.max_context

    async def stream(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        """Yield tokens as the pipeline emits them. Closing the generator early cancels the
        request; its state is released on every shard in all cases."""
        if len(request.prompt) + request.max_tokens > self.max_context:
            raise RequestError(
                f"prompt ({len(request.prompt)} tokens) + max_tokens ({request.max_tokens}) "
                f"exceeds the context of {self.max_context} tokens"
            )
        # Each run has its own id on the shards: nodes refuse a released id, and a caller may
        # well run the same request twice.
        rid = f"{request.request_id}.{uuid.uuid4().hex[:8]}"
        try:
            step, result = await self._prefill(rid, request)
            produced = drafted = accepted = 0
            while True:
                drafted += result.drafted
                accepted += result.accepted
                tokens, finish = _cut(result.tokens, request, produced)
                produced += len(tokens)
                logprobs = result.logprobs[: len(tokens)] if result.logprobs else None
                top = result.top_logprobs[: len(tokens)] if result.top_logprobs else None
                yield GenerationChunk(tokens, finish, drafted, accepted, logprobs, top)
                if finish:
                    return
                drafts = result.drafts if request.options.mtp else ()
                # A step emits at most 1 + len(drafts) tokens: no draft past max_tokens.
                drafts = drafts[: max(request.max_tokens - produced - 1, 0)]
                step = self._next_step(step, result, drafts)
                result = await self.pipeline.submit(step)
        finally:
            await asyncio.shield(self.pipeline.release(rid))

    async def generate(
        self,
        request: GenerationRequest,
        on_chunk: Callable[[GenerationChunk], None] | None = None,
    ) -> GenerationOutput:
        """Run a request to its end; `on_chunk` sees each chunk as it comes."""
        start = end = time.perf_counter()
        first = None
        tokens: list[int] = []
        chunk = None
        async for chunk in self.stream(request):
            end = time.perf_counter()  # not after the release that closing the stream does
            if first is None:
                first = end
            tokens += chunk.tokens
            if on_chunk is not None:
                on_chunk(chunk)
        assert chunk is not None and chunk.finish_reason is not None and first is not None
        after_first = max(len(tokens) - 1, 0)
        return GenerationOutput(
            tokens=tuple(tokens),
            finish_reason=chunk.finish_reason,
            prompt_tokens=len(request.prompt),
            drafted=chunk.drafted,
            accepted=chunk.accepted,
            generation_tps=after_first / (end - first) if end > first else 0.0,
            time_to_first_token_s=first - start,
        )

    async def _prefill(
        self, rid: str, request: GenerationRequest
    ) -> tuple[StepRequest, StepResult]:
        prompt, size = request.prompt, self.prefill_chunk
        steps = [
            StepRequest(
                rid,
                prompt[i : i + size],
                position=i,
                sample=i + size >= len(prompt),
                options=request.options if i == 0 else None,
            )
            for i in range(0, len(prompt), size)
        ]
        # Submitted together: a later chunk can enter the head while an earlier one runs on.
        pending = [asyncio.ensure_future(self.pipeline.submit(s)) for s in steps]
        try:
            results = await asyncio.gather(*pending)
        except BaseException:
            for future in pending:
                future.cancel()
            raise
        return steps[-1], results[-1]

    @staticmethod
    def _next_step(step: StepRequest, result: StepResult, drafts: tuple[int, ...]) -> StepRequest:
        return StepRequest(
            step.request_id,
            (result.tokens[-1], *drafts),
            position=step.position + result.keep,
            draft_len=len(drafts),
            rollback=len(step.tokens) - result.keep,
        )


def _cut(
    tokens: tuple[int, ...], request: GenerationRequest, produced: int
) -> tuple[tuple[int, ...], str | None]:
    """The emitted tokens up to a stop token (not included) or max_tokens, and why it ended."""
    for i, token in enumerate(tokens):
        if token in request.stop_tokens:
            return tokens[:i], "stop"
        if produced + i + 1 >= request.max_tokens:
            return tokens[: i + 1], "length"
    return tokens, None
