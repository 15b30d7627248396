"""The generation engine: one request's loop of pipeline steps, local or across nodes.

The engine knows nothing of where the layers run: it submits steps to a `Pipeline` and reads
the tail's results. A request is a prompt prefill (chunked; all chunks are submitted at once,
so on a multi-node pipeline chunk k+1 enters the head while chunk k is further down; while
other requests decode, one at a time in the interleave chunk, which `InterleavePacer` keeps
from the running streams' gaps, until none does), then decode steps. With MTP, each decode
step feeds `[y, d1..dk]`: the last emitted token and the tail's drafts of the next ones (k is
the request's MTP depth, fixed or the tail's choice); the result says how many positions
stay, and the difference travels on the next step as its rollback signal.

With a `PrefixIndex` (the conversation cache), a prompt that extends a cached prefix starts
from that prefix's snapshot on every shard and prefills only the rest. New snapshots are kept
at the request's message boundaries (`GenerationRequest.boundaries`: prefill chunks are cut
there), else at the end of the prompt, and at the end of the answer.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import cast

from cluster.decode.interleave import InterleavePacer
from cluster.decode.pipeline import Pipeline
from cluster.decode.prefix_index import EVICTED, PrefixEntry, PrefixIndex, PrefixPipeline
from cluster.decode.token_mask import TokenConstraint
from cluster.messages import RequestError, RequestOptions, StepRequest, StepResult

# Each boundary snapshot holds a whole GatedDeltaNet state besides its KV, and cuts a prefill
# chunk: a request keeps at most this many, its first boundary and its last (`boundaries`).
MAX_BOUNDARY_SNAPSHOTS = 2
# A prompt's chunk where nothing measured a better one (the coordinator measures it after
# its warm-up: `cluster.decode.warmup.measure_chunks`).
DEFAULT_PREFILL_CHUNK = 512


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    prompt: tuple[int, ...]
    max_tokens: int
    options: RequestOptions = field(default_factory=RequestOptions)
    stop_tokens: frozenset[int] = frozenset()
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    # Which tokens may come next (e.g. a JSON schema); it goes on with the request.
    constraint: TokenConstraint | None = field(default=None, compare=False)
    # Positions in the prompt, ascending, where a part that other prompts repeat ends (the
    # chat template's message boundaries): with a conversation cache, the engine keeps its
    # snapshots there instead of at the prompt's end (MAX_BOUNDARY_SNAPSHOTS at most).
    boundaries: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.prompt:
            raise RequestError("the prompt is empty")
        if self.max_tokens < 1:
            raise RequestError(f"max_tokens must be >= 1, got {self.max_tokens}")
        points = (0, *self.boundaries, len(self.prompt) + 1)
        if any(a >= b for a, b in itertools.pairwise(points)):
            raise RequestError(
                f"boundaries must ascend within the prompt's {len(self.prompt)} tokens, got "
                f"{self.boundaries}"
            )


@dataclass(frozen=True, slots=True)
class GenerationChunk:
    tokens: tuple[int, ...]  # newly emitted tokens
    finish_reason: str | None  # "stop" | "length" | None
    drafted: int  # cumulative
    accepted: int  # cumulative
    logprobs: tuple[float, ...] | None = None  # of `tokens`, when the request asked for them
    # Per token of `tokens`, the likeliest (token, logprob) pairs, when asked for.
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] | None = None
    cached_tokens: int = 0  # prompt tokens taken from the conversation cache, not prefilled
    drafts: tuple[int, ...] = ()  # the MTP drafts the next step verifies (what a resume needs)


@dataclass(frozen=True, slots=True)
class ResumePoint:
    """Where a request stood when its pipeline failed: what it emitted, the drafts its next
    step was to verify, and the draft counts so far. `GenerationEngine.stream(request,
    resume=...)` re-prefills prompt + emitted on the engine's (new) pipeline and continues
    with exactly the tokens the request would have produced (greedy, or seeded sampling)."""

    emitted: tuple[int, ...] = ()
    drafts: tuple[int, ...] = ()
    drafted: int = 0
    accepted: int = 0


@dataclass(frozen=True, slots=True)
class GenerationOutput:
    tokens: tuple[int, ...]
    finish_reason: str
    prompt_tokens: int
    drafted: int
    accepted: int
    generation_tps: float  # tokens/s after the first token
    time_to_first_token_s: float
    cached_tokens: int = 0


class GenerationEngine:
    def __init__(
        self,
        pipeline: Pipeline,
        *,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        prefix_index: PrefixIndex | None = None,
    ):
        self.prefill_chunk = prefill_chunk
        # The chunk of a prompt that arrives while other requests decode: a decode step that
        # shares a batch with a chunk waits for it, so the pacer keeps it as long as the
        # running streams' gaps allow (from `interleave_chunk`, which the coordinator
        # measures after its warm-up: `cluster.decode.warmup.measure_chunks`).
        self.pacer = InterleavePacer(prefill_chunk, prefill_chunk)
        self._decoding = 0  # requests past their prefill, not yet ended
        self.prefix_index = prefix_index  # the pipeline must be a PrefixPipeline too
        self._background: set[asyncio.Task] = set()
        self.pipeline = pipeline

    @property
    def pipeline(self) -> Pipeline:
        return self._pipeline

    @pipeline.setter
    def pipeline(self, pipeline: Pipeline) -> None:
        """A new pipeline's shards hold no snapshots: the prefix index starts over."""
        self._pipeline = pipeline
        if self.prefix_index is not None:
            self.prefix_index.clear()
            cast(PrefixPipeline, pipeline).on_prefix_dropped = self._prefix_dropped

    @property
    def max_context(self) -> int:
        return self.pipeline.max_context

    @property
    def interleave_chunk(self) -> int:
        return min(self.pacer.size, self.prefill_chunk)

    @interleave_chunk.setter
    def interleave_chunk(self, size: int) -> None:
        """Start pacing from `size` tokens (at most the prefill chunk), learning afresh."""
        size = min(size, self.prefill_chunk)
        self.pacer = InterleavePacer(size, self.prefill_chunk, self.pacer.fallback_gap_s)

    async def stream(
        self, request: GenerationRequest, resume: ResumePoint | None = None
    ) -> AsyncIterator[GenerationChunk]:
        """Yield tokens as the pipeline emits them. Closing the generator early cancels the
        request; its state is released on every shard in all cases. With `resume`, the
        request continues after the tokens it emitted before (which are not yielded again)."""
        if len(request.prompt) + request.max_tokens > self.max_context:
            raise RequestError(
                f"prompt ({len(request.prompt)} tokens) + max_tokens ({request.max_tokens}) "
                f"exceeds the context of {self.max_context} tokens"
            )
        if resume is not None and resume.emitted:
            async for chunk in self._resumed(request, resume):
                yield chunk
            return
        rid = _run_id(request)
        index = self.prefix_index
        entry = None
        if index is not None:
            entry = index.lookup(request.prompt, request.options.mtp).entry
        saves = self._save_points(request, entry)
        fed = list(request.prompt)  # the tokens the shards' caches cover, once fed
        settled: tuple[StepRequest, StepResult] | None = None  # no step in flight
        decoding = False
        try:
            try:
                step, result = await self._prefill(rid, request, entry, saves)
            except RequestError:
                if entry is None:
                    raise
                # A shard lacks the snapshot (a drop still on its way): prefill it all.
                assert index is not None
                index.stats.fallbacks += 1
                index.stats.misses[EVICTED] += 1
                await asyncio.shield(self.pipeline.release(rid))
                self._drop_everywhere([entry.snapshot_id, *saves.values()])
                rid, entry = _run_id(request), None
                saves = self._save_points(request, None)
                step, result = await self._prefill(rid, request, None, saves)
            self.pacer.decoded(rid, time.perf_counter())
            cached = self._count_prefill(request, entry, saves)
            produced = drafted = accepted = 0
            decoding = True
            self._decoding += 1
            while True:
                fed += result.tokens
                settled = (step, result)
                drafted += result.drafted
                accepted += result.accepted
                tokens, finish, logprobs, top, drafts = _emission(result, request, produced)
                produced += len(tokens)
                yield GenerationChunk(
                    tokens, finish, drafted, accepted, logprobs, top, cached, drafts
                )
                if finish:
                    return
                step = _following_step(step, result, tokens, drafts, request)
                settled = None
                result = await self.pipeline.submit(step)
                self.pacer.decoded(rid, time.perf_counter())
        finally:
            self._decoding -= decoding
            self.pacer.finished(rid)
            await asyncio.shield(self._end(rid, request, settled, fed))

    async def _resumed(
        self, request: GenerationRequest, resume: ResumePoint
    ) -> AsyncIterator[GenerationChunk]:
        """`stream` from a resume point, on the pipeline of the moment, without the
        conversation cache (a replay is rare; it re-prefills prompt + emitted)."""
        pipeline = self.pipeline
        rid = _run_id(request)
        try:
            step, result = await self._replay_prefill(pipeline, rid, request, resume)
            produced, drafted, accepted = len(resume.emitted), resume.drafted, resume.accepted
            # A constraint went on with the tokens emitted before the loss: it stands there.
            while True:
                drafted += result.drafted
                accepted += result.accepted
                tokens, finish, logprobs, top, drafts = _emission(result, request, produced)
                produced += len(tokens)
                yield GenerationChunk(
                    tokens, finish, drafted, accepted, logprobs, top, drafts=drafts
                )
                if finish:
                    return
                step = _following_step(step, result, tokens, drafts, request)
                result = await pipeline.submit(step)
        finally:
            await asyncio.shield(pipeline.release(rid))

    async def _replay_prefill(
        self, pipeline: Pipeline, rid: str, request: GenerationRequest, resume: ResumePoint
    ) -> tuple[StepRequest, StepResult]:
        """Re-prefill prompt + emitted and take the step the request was about to take.

        Without pending drafts, that step samples the token after the emitted ones: a
        prefill of prompt + emitted ending in a sampled chunk is exactly it. With drafts, the
        next step was [last emitted, drafts]: the prefill stops before the last emitted token
        and passes it as `next_token`, so the tail drafts again (its random numbers are keyed
        by position) and the step [last, drafts] follows as it would have."""
        tokens = request.prompt + resume.emitted
        size = self.prefill_chunk
        with_drafts = bool(resume.drafts) and request.options.mtp
        fed = tokens[:-1] if with_drafts else tokens
        masks = ()
        if request.constraint is not None and not with_drafts:
            masks = request.constraint.masks(())
        steps = [
            StepRequest(
                rid,
                fed[i : i + size],
                position=i,
                sample=i + size >= len(fed) and not with_drafts,
                options=request.options if i == 0 else None,
                next_token=tokens[-1] if with_drafts and i + size >= len(fed) else None,
                token_masks=masks if i + size >= len(fed) else (),
            )
            for i in range(0, len(fed), size)
        ]
        results = await _submit_all(pipeline, steps)
        if not with_drafts:
            return steps[-1], results[-1]
        drafts = results[-1].drafts[: len(resume.drafts)]
        step = StepRequest(rid, (tokens[-1], *drafts), len(tokens) - 1, draft_len=len(drafts))
        if request.constraint is not None:
            step = replace(step, token_masks=request.constraint.masks(drafts))
        return step, await pipeline.submit(step)

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
            cached_tokens=chunk.cached_tokens,
        )

    async def _prefill(
        self,
        rid: str,
        request: GenerationRequest,
        entry: PrefixEntry | None,
        saves: dict[int, int],
    ) -> tuple[StepRequest, StepResult]:
        """The prompt from `entry`'s end (or from 0) in chunks, cut at the positions of
        `saves` (position -> snapshot id), where the chunk that ends keeps that snapshot.
        While other requests decode, in the interleave chunk and one at a time; the rest
        together, in whole chunks, as soon as none does."""
        start = entry.length if entry else 0
        # Each chunk once the one before it has come back: the chunks then hold one node at a
        # time, and a decode step meets at most one of them on its way through the pipeline.
        # Streaming through every node at once, they would make it wait behind one on every
        # node. (Each chunk sent right behind a round of the others' decode steps prefilled
        # 1.7x faster on the CPU, but made their p99 gap a third longer.)
        cut = _PromptCut(rid, request, entry, saves)
        while self._decoding:
            step = cut.step(start, self.interleave_chunk)
            self.pacer.sent(interleaved=True)
            try:
                result = await self.pipeline.submit(step)
            finally:
                self.pacer.returned(time.perf_counter(), interleaved=True)
            start = step.position + len(step.tokens)
            if start == len(request.prompt):
                return step, result
        steps = cut.steps(start, self.prefill_chunk)
        self.pacer.sent(interleaved=False)
        try:
            return steps[-1], (await _submit_all(self.pipeline, steps))[-1]
        finally:
            self.pacer.returned(time.perf_counter(), interleaved=False)

    # -- the conversation cache -------------------------------------------------------------

    def _save_points(self, request: GenerationRequest, entry: PrefixEntry | None) -> dict[int, int]:
        """Where the prefill keeps new snapshots (position -> snapshot id): the request's
        message boundaries after `entry`, at most its first and its last (a shared head, and
        the latest point a repeat or the next turn can start from); without boundaries, the
        prompt's end. Prefixes the index holds already are not taken again."""
        index = self.prefix_index
        if index is None:
            return {}
        prompt, mtp = request.prompt, request.options.mtp
        inside = [b for b in request.boundaries if b < len(prompt)]
        if len(inside) > MAX_BOUNDARY_SNAPSHOTS:
            inside = [*inside[: MAX_BOUNDARY_SNAPSHOTS - 1], inside[-1]]
        begin = entry.length if entry else 0
        # A prompt with boundaries needs no snapshot at its very end: its last boundary serves
        # a repeat (which must leave a token to compute) and the next turn alike.
        points = [b for b in inside if b > begin] if inside else [len(prompt)]
        return {p: index.new_id() for p in points if not index.holds(prompt[:p], mtp)}

    def _count_prefill(
        self, request: GenerationRequest, entry: PrefixEntry | None, saves: dict[int, int]
    ) -> int:
        """After a prefill: count a hit, index the snapshots it kept. The tokens not
        prefilled."""
        index = self.prefix_index
        if index is None:
            return 0
        for position, snapshot_id in sorted(saves.items()):
            kept = PrefixEntry.of(request.prompt[:position], snapshot_id, request.options.mtp)
            self._drop_everywhere(index.add(kept))
        if entry is None:
            return 0
        index.stats.hits += 1
        index.stats.cached_tokens += entry.length
        return entry.length

    async def _end(
        self,
        rid: str,
        request: GenerationRequest,
        settled: tuple[StepRequest, StepResult] | None,
        fed: list[int],
    ) -> None:
        """Release the request; where no step is in flight, keep its state as the snapshot
        of the conversation so far (prompt and answer, up to the last token fed)."""
        index = self.prefix_index
        if index is None or settled is None:
            await self.pipeline.release(rid)
            return
        step, result = settled
        positions = step.position + result.keep
        tokens = tuple(fed[:positions])
        if positions > len(fed) or index.holds(tokens, request.options.mtp):
            await self.pipeline.release(rid)
            return
        snapshot_id = index.new_id()
        pipeline = cast(PrefixPipeline, self.pipeline)
        if await pipeline.release_as_prefix(rid, snapshot_id, positions):
            entry = PrefixEntry.of(tokens, snapshot_id, request.options.mtp)
            self._drop_everywhere(index.add(entry))
        else:
            index.not_stored(tokens, request.options.mtp)

    def _prefix_dropped(self, snapshot_ids: list[int]) -> None:
        """A shard no longer holds these snapshots: they are usable nowhere."""
        self._drop_everywhere(snapshot_ids)

    def _drop_everywhere(self, snapshot_ids: list[int]) -> None:
        """Forget these snapshots and have every shard drop them."""
        ids = [i for i in snapshot_ids if i]
        if not ids:
            return
        if self.prefix_index is not None:
            self.prefix_index.forget(ids)
        pipeline = cast(PrefixPipeline, self.pipeline)
        self._spawn(pipeline.drop_prefixes(ids))

    def _spawn(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)


@dataclass(frozen=True, slots=True)
class _PromptCut:
    """A request's prompt as prefill steps of run `rid`, from the end of `entry` (a cached
    prefix) or from 0, cut at the positions of `saves` (position -> snapshot id, which the
    step that ends there keeps)."""

    rid: str
    request: GenerationRequest
    entry: PrefixEntry | None
    saves: dict[int, int]

    def steps(self, start: int, size: int) -> list[StepRequest]:
        """The steps from `start` to the prompt's end, `size` tokens each where no position
        of `saves` comes first."""
        steps: list[StepRequest] = []
        while start < len(self.request.prompt):
            steps.append(self.step(start, size))
            start += len(steps[-1].tokens)
        return steps

    def step(self, start: int, size: int) -> StepRequest:
        """The step from `start`: `size` tokens, or fewer where a position of `saves` or the
        prompt's end comes first. The request's first step opens it; the last one samples."""
        request, entry = self.request, self.entry
        prompt, begin = request.prompt, entry.length if entry else 0
        end = min(start + size, len(prompt), *(p for p in self.saves if p > start))
        step = StepRequest(
            self.rid,
            prompt[start:end],
            position=start,
            sample=end == len(prompt),
            options=request.options if start == begin else None,
            prefix_from=entry.snapshot_id if entry and start == begin else 0,
            prefix_save=self.saves.get(end, 0),
        )
        if end == len(prompt) and request.constraint is not None:
            step = replace(step, token_masks=request.constraint.masks(()))
        return step


async def _submit_all(pipeline: Pipeline, steps: list[StepRequest]) -> list[StepResult]:
    """Submitted together: a later chunk can enter the head while an earlier one runs on."""
    pending = [asyncio.ensure_future(pipeline.submit(s)) for s in steps]
    try:
        return list(await asyncio.gather(*pending))
    except BaseException:
        for future in pending:
            future.cancel()
        raise


def _run_id(request: GenerationRequest) -> str:
    """Each run has its own id on the shards: nodes refuse a released id, and a caller may
    well run the same request twice (or again after a prefix cache fallback)."""
    return f"{request.request_id}.{uuid.uuid4().hex[:8]}"


def _emission(
    result: StepResult, request: GenerationRequest, produced: int
) -> tuple[tuple[int, ...], str | None, tuple | None, tuple | None, tuple[int, ...]]:
    """What a step's result gives the client after `produced` tokens: the tokens (cut at a stop
    or max_tokens), why it ended, their logprobs and top logprobs, and the drafts to verify."""
    tokens, finish = _cut(result.tokens, request, produced)
    logprobs = result.logprobs[: len(tokens)] if result.logprobs else None
    top = result.top_logprobs[: len(tokens)] if result.top_logprobs else None
    drafts = result.drafts if request.options.mtp else ()
    # A step emits at most 1 + len(drafts) tokens: no draft past max_tokens.
    drafts = drafts[: max(request.max_tokens - produced - len(tokens) - 1, 0)]
    return tokens, finish, logprobs, top, drafts


def _following_step(
    step: StepRequest,
    result: StepResult,
    emitted: tuple[int, ...],
    drafts: tuple[int, ...],
    request: GenerationRequest,
) -> StepRequest:
    """The step after `step`: its last confirmed token and the drafts, rolling back what the
    verify rejected; a constrained request's masks follow the tokens just emitted."""
    following = StepRequest(
        step.request_id,
        (result.tokens[-1], *drafts),
        position=step.position + result.keep,
        draft_len=len(drafts),
        rollback=len(step.tokens) - result.keep,
    )
    if request.constraint is None:
        return following
    request.constraint.advance(emitted)
    return replace(following, token_masks=request.constraint.masks(drafts))


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
