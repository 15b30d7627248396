"""Warm-up: every shape the nodes will run, run once before the coordinator says it is ready.

MLX builds a kernel the first time it meets a shape, and the decode fast path traces a
compiled step per (rows, drafts) shape (`cluster.model.compiled_steps`): a prefill chunk of
a new length, a decode batch of a new size, a verify step of a new width. On a GPU at a large
model each costs up to seconds, and a cold cluster makes its first users wait for all of them.
So, once a pipeline is placed (at the start, and again after every re-placement: new shards
are cold), the coordinator drives synthetic requests through its real pipeline, and every
node runs, through the same code as a user's request:

- prefill: one request per prompt length of `prefill_lengths`: shorter last chunks in
  powers of two, and a prompt of a full chunk and a short one (the engine's chunk, then a
  chunk at an offset, attending over the cache), with MTP where the model has it (the decode
  steps' own prompts take the path without it);
- decode: for each batch size k = 1 .. `max_running` (the admission limit), k requests at
  once (their steps travel and batch together as k users' would), once per MTP variant the
  coordinator may serve: MTP off, and MTP at each depth it may draft (the configured depth;
  with `auto`, every depth 0 .. AUTO_MAX_DEPTH), each step verifying `1 + depth` positions.
  Every other request samples (temperature > 0): the sampling paths warm beside argmax.

The synthetic requests go through a `GenerationEngine` of their own, with no conversation
cache, past the HTTP layer and `MeteredEngine`: they leave no prefix snapshot, count in no
request, token or rate figure, and each is released on every node when it ends. The nodes' own
counters (steps, batches, busy time, positions computed) do count them: that is the work
they did.

`WarmupProgress` is what the terminal, the dashboard (`/api/cluster`'s `warmup`), `/health`
and `/metrics` show of it; `Driven` records what each step actually submitted, so tests can
see that every planned shape ran.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Literal

from cluster.decode.engine import GenerationEngine, GenerationRequest
from cluster.decode.interleave import SHORTEST_CHUNK
from cluster.decode.mtp_depth import AUTO_MAX_DEPTH
from cluster.decode.pipeline import Pipeline
from cluster.messages import MtpDepth, RequestOptions, SamplingParams, StepRequest, StepResult

log = logging.getLogger(__name__)

# Each request of a decode step: short (its decode is the point, and on a CPU a prompt
# costs per position), and within the context.
DECODE_PROMPT_TOKENS = 4
CYCLE = 4  # synthetic prompts repeat a cycle of this many tokens
# The users' prompts of a wave: prefilled several at once, then decoded in the batches (and
# caches) that such prefills leave, with MTP as served (under `auto`, requests of one batch at
# different depths). Shapes of their own that single requests of the steps above never make:
# a cluster that skipped them stalled for seconds when its first users came together. The
# lengths are ones that no step above prefills, so that what the wave builds is what several
# prompts together need, not what one length does; and they differ (WAVE_PROMPT_TOKENS less
# 0 .. WAVE_SPREAD - 1), as users' prompts do: a prefill of prompts of several lengths
# attends prompt by prompt, and their decode batches stand at different offsets.
WAVE_PROMPT_TOKENS = 100
WAVE_SPREAD = 4
WAVE_TOKENS = 8
# Every other request samples: these touch the filters (top-k, top-p, min-p) and the
# seeded sampler that a user's request may ask for.
SAMPLED = SamplingParams(temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, seed=1)


@dataclass(frozen=True, slots=True)
class Variant:
    """How a warm-up request decodes: MTP off, or on with `depth` drafts per step ("auto":
    the tail's choice, as a served request's)."""

    mtp: bool
    depth: MtpDepth = 0

    @property
    def width(self) -> int:
        """Positions of each of its decode steps (the confirmed token and the drafts; under
        "auto", the most)."""
        if not self.mtp:
            return 1
        return 1 + (AUTO_MAX_DEPTH if self.depth == "auto" else self.depth)

    @property
    def name(self) -> str:
        return f"MTP depth {self.depth}" if self.mtp else "MTP off"

    def options(self, sampled: bool) -> RequestOptions:
        sampling = SAMPLED if sampled else SamplingParams()
        return RequestOptions(sampling=sampling, mtp=self.mtp, mtp_depth=self.depth)

    def max_tokens(self) -> int:
        """Enough for one full-width decode step whatever passes (no drafts run past
        max_tokens): the first run of a shape is the one that builds its kernels."""
        return 2 + self.width


@dataclass(frozen=True, slots=True)
class WarmupStep:
    """One line of the warm-up's progress, run once for each of `variants`, one after the
    other: a prefill of `size` prompt tokens; a decode batch of `size` requests; or a wave of
    `size` users' prompts of about WAVE_PROMPT_TOKENS at once, decoding as served requests do."""

    kind: Literal["prefill", "decode", "wave"]
    size: int
    variants: tuple[Variant, ...]

    @property
    def label(self) -> str:
        if self.kind == "prefill":
            return f"prefill {self.size} tokens"
        names = ", ".join(v.name for v in self.variants)
        if self.kind == "wave":
            return f"{self.size} prompts at once ({names})"
        return f"decode batch {self.size} ({names})"

    def requests(self, variant: Variant, vocab_size: int) -> list[GenerationRequest]:
        """The synthetic requests of one variant: run at once, they make one batch."""
        if self.kind == "prefill":
            options = variant.options(sampled=True)
            prompt = synthetic_prompt(self.size, 0, vocab_size)
            return [GenerationRequest(prompt, 1, options, request_id=_request_id())]
        if self.kind == "wave":
            return [
                GenerationRequest(
                    synthetic_prompt(WAVE_PROMPT_TOKENS - i % WAVE_SPREAD, i, vocab_size),
                    WAVE_TOKENS,
                    variant.options(sampled=i % 2 == 1),
                    request_id=_request_id(),
                )
                for i in range(self.size)
            ]
        return [
            GenerationRequest(
                synthetic_prompt(DECODE_PROMPT_TOKENS, i, vocab_size),
                variant.max_tokens(),
                variant.options(sampled=i % 2 == 1),
                request_id=_request_id(),
            )
            for i in range(self.size)
        ]


@dataclass(frozen=True, slots=True)
class Driven:
    """What one variant of a warm-up step submitted to the pipeline: a prefill of `size`
    prompt tokens (every chunk, summed); decode steps of `width` positions of which `size`
    were in flight at once (the batch the nodes could form); or a wave of `size` requests;
    `positions`: every position its steps fed (each node computes each of them once)."""

    kind: str
    size: int
    mtp: bool
    depth: MtpDepth
    positions: int

    @property
    def shape(self) -> tuple[str, int, bool, MtpDepth]:
        return (self.kind, self.size, self.mtp, self.depth)


def prefill_lengths(prefill_chunk: int, max_context: int) -> list[int]:
    """Prompt lengths whose prefill the warm-up runs: powers of two from SHORTEST_CHUNK
    below the chunk (shorter last chunks), then a full chunk and a short one (the chunk's
    shape, and a chunk at an offset that attends over the cache); within the context.

    MLX on CUDA builds a quantized matmul's kernel per range of row counts, ranges that end at
    powers of two (9-16 rows share one, 17-32 the next), the first time a range meets it:
    33-37 s each at the 27B shape on an H200 with nothing cached, a few hundred milliseconds
    where another process of the host cached it. Powers of four left ranges between them
    (rows 8 and 24 each built a kernel after 4, 16 and 64 had run; a first 128-token prompt
    waited 320 ms after 64 and 256), so a first prompt, or a held-back run of MTP pairs, of
    such a length waited for one."""
    lengths, n = [], SHORTEST_CHUNK
    while n < prefill_chunk:
        lengths.append(n)
        n *= 2
    lengths.append(prefill_chunk + min(SHORTEST_CHUNK, prefill_chunk))
    # Room for the one token each prefill request samples.
    return [n for n in lengths if n < max_context]


def decode_variants(mtp_depth: MtpDepth, has_mtp: bool) -> tuple[Variant, ...]:
    """MTP off, and where the model has an MTP head, each depth a request may draft at:
    the configured one, or with `auto` every depth the tail may choose."""
    if not has_mtp:
        return (Variant(False),)
    depths = range(AUTO_MAX_DEPTH + 1) if mtp_depth == "auto" else (mtp_depth,)
    return (Variant(False), *(Variant(True, d) for d in depths))


@dataclass(frozen=True, slots=True)
class WarmupArgs:
    """`plan_warmup`'s arguments, as a coordinator calls it: the prefill chunk, the admission
    limit, the context (0: the model's), the served MTP depth, and whether the model drafts."""

    prefill_chunk: int
    max_running: int
    max_context: int
    mtp_depth: MtpDepth
    has_mtp: bool

    def plan(self, model_context: int) -> list[WarmupStep]:
        """The plan, on a model of `model_context` positions."""
        context = min(self.max_context or model_context, model_context)
        return plan_warmup(
            prefill_chunk=self.prefill_chunk,
            max_running=self.max_running,
            max_context=context,
            mtp_depth=self.mtp_depth,
            has_mtp=self.has_mtp,
        )


def plan_warmup(
    *,
    prefill_chunk: int,
    max_running: int,
    max_context: int,
    mtp_depth: MtpDepth,
    has_mtp: bool,
) -> list[WarmupStep]:
    """The coordinator's warm-up: every prefill length, then every batch size up to the
    admission limit, with each MTP variant it may serve; then a wave of users' prompts at
    the admission limit, at the served MTP depth."""
    variants = decode_variants(mtp_depth, has_mtp)
    # Where the model has one, the tail's MTP head runs over each chunk too: the path that
    # requests take by default. The decode steps' prompts prefill without it.
    prefill_variants = (Variant(has_mtp, 1 if mtp_depth == "auto" else mtp_depth),)
    if not has_mtp:
        prefill_variants = (Variant(False),)
    steps = [
        WarmupStep("prefill", n, prefill_variants)
        for n in prefill_lengths(prefill_chunk, max_context)
    ]
    fits = [v for v in variants if DECODE_PROMPT_TOKENS + v.max_tokens() <= max_context]
    steps += [WarmupStep("decode", k, tuple(fits)) for k in range(1, max_running + 1) if fits]
    served = (Variant(True, mtp_depth),) if has_mtp else (Variant(False),)
    if max_running > 1 and max_context >= WAVE_PROMPT_TOKENS + WAVE_TOKENS:
        steps.append(WarmupStep("wave", max_running, served))
    return steps


def plan_for_request(request: GenerationRequest, max_context: int) -> list[WarmupStep]:
    """What one request will run (`cluster generate`): its prompt's prefill (the same
    chunks), and decode at batch 1 with its MTP setting (every depth under `auto`)."""
    options = request.options
    if options.mtp:
        depths = range(AUTO_MAX_DEPTH + 1) if options.mtp_depth == "auto" else (options.mtp_depth,)
        variants = tuple(Variant(True, d) for d in depths)
    else:
        variants = (Variant(False),)
    steps = [WarmupStep("prefill", len(request.prompt), variants[-1:])]
    fits = tuple(v for v in variants if DECODE_PROMPT_TOKENS + v.max_tokens() <= max_context)
    if fits:
        steps.append(WarmupStep("decode", 1, fits))
    return steps


def synthetic_prompt(length: int, seed: int, vocab_size: int) -> tuple[int, ...]:
    """`length` valid token ids repeating a cycle of CYCLE (a pattern the model can go on
    with, rather than noise), different for each `seed`."""
    cycle = [(seed * 131 + j * 7919 + 1000) % vocab_size for j in range(CYCLE)]
    return tuple(cycle[i % CYCLE] for i in range(length))


_ids = iter(range(1 << 62))


def _request_id() -> str:
    return f"warmup-{next(_ids)}"


# -- progress ------------------------------------------------------------------------------


@dataclass(slots=True)
class WarmupProgress:
    """How far the warm-up is, as the terminal, the dashboard, /health and /metrics show it.

    `state` is "warming" from the start of a warm-up to its end and "ready" otherwise;
    `done` of `total` steps, `step` the one running (or the last); `seconds` the last
    warm-up's duration (so far, while warming). `skipped`: warm-up turned off; `error`: the
    last one failed, and the cluster serves cold. `driven`: what each step submitted."""

    state: Literal["warming", "ready"] = "ready"
    done: int = 0
    total: int = 0
    step: str = ""
    skipped: bool = False
    error: str = ""
    driven: list[Driven] = field(default_factory=list)
    _seconds: float = field(default=0.0, init=False)
    _started: float | None = field(default=None, init=False)
    _ready: asyncio.Event = field(default_factory=asyncio.Event, init=False)

    def __post_init__(self) -> None:
        if self.state == "ready":
            self._ready.set()

    @property
    def seconds(self) -> float:
        if self._started is not None:
            return time.monotonic() - self._started
        return self._seconds

    def begin(self, total: int) -> None:
        self.state, self.done, self.total, self.step, self.error = "warming", 0, total, "", ""
        self.driven = []
        self._started = time.monotonic()
        self._ready.clear()

    def finish(self, error: str = "") -> None:
        self._seconds = self.seconds
        self._started = None
        self.state, self.error = "ready", error
        self._ready.set()

    def skip(self) -> None:
        self.skipped = True
        self.finish()

    async def ready(self) -> None:
        """Return once no warm-up runs or is due."""
        await self._ready.wait()

    def line(self) -> str:
        """What the terminal and the dashboard say: "warming 3/15: decode batch 4"."""
        if self.state == "warming":
            return f"warming {self.done + 1}/{self.total}: {self.step}"
        if self.skipped:
            return "warm-up skipped"
        if self.error:
            return f"warm-up failed after {self.seconds:.1f} s, serving cold: {self.error}"
        return f"warm in {self.seconds:.1f} s ({self.total} steps)"

    def as_json(self) -> dict[str, object]:
        return {
            "state": self.state,
            "done": self.done,
            "total": self.total,
            "step": self.step,
            "seconds": round(self.seconds, 3),
            "skipped": self.skipped,
            "error": self.error,
            "line": self.line(),
        }

    def prometheus(self) -> str:
        """Its gauges in the Prometheus text format, to append to /metrics."""
        return (
            "# HELP cluster_warmup_seconds How long the last warm-up took (so far, while"
            " warming).\n"
            "# TYPE cluster_warmup_seconds gauge\n"
            f"cluster_warmup_seconds {self.seconds:.3f}\n"
            "# HELP cluster_warming 1 while the nodes warm up (not ready), else 0.\n"
            "# TYPE cluster_warming gauge\n"
            f"cluster_warming {int(self.state == 'warming')}\n"
        )


# While others decode, a prompt's chunks go through the pipeline one at a time (the engine's
# `_prefill`): a decode step may wait for the chunk a node is running and share a batch
# with it there, so the running streams' gap between tokens grows by up to about one chunk
# through the pipeline. Kept within this many times a plain decode step, a gap stays within
# the 3x of a stream's median that a user notices least.
INTERLEAVE_BUDGET = 1.5
CALIBRATION_TOKENS = 8  # decode tokens timed for the decode step


# The prefill chunks measured: those up to the configured one always (its warm-up times them),
# longer ones only where the one below took at most LONGER_CHUNK_BUDGET_S through the pipeline
# (a GPU; on a CPU, where a token costs what it costs in any chunk, they would only add
# seconds to every start). Chosen for a prompt of LONG_PROMPT tokens (or the context).
LONGER_CHUNKS = (1024, 2048)
LONGER_CHUNK_BUDGET_S = 0.5
LONG_PROMPT = 16384
# Shorter chunks spend a step's fixed costs (hops, sampling, the host's graph) on too few tokens
# to prefill a long prompt well; they serve prompts that arrive while others decode.
SHORTEST_PREFILL_CHUNK = 256


@dataclass(frozen=True, slots=True)
class ChunkChoice:
    """The measurement behind `GenerationEngine.prefill_chunk` and `interleave_chunk`: seconds
    of one decode step and of a prefill of each length through the pipeline (of `stages`
    stages that run at once), and the chunks chosen."""

    decode_step_s: float
    prefill_s: dict[int, float]
    stages: int
    prefill_chunk: int
    interleave_chunk: int

    def line(self) -> str:
        timed = ", ".join(f"{n}: {s * 1e3:.0f} ms" for n, s in sorted(self.prefill_s.items()))
        return (
            f"prefill chunk {self.prefill_chunk} tokens, {self.interleave_chunk} while others "
            f"decode (decode step {self.decode_step_s * 1e3:.1f} ms; prefill {timed})"
        )


def choose_interleave_chunk(decode_step_s: float, prefill_s: dict[int, float]) -> int:
    """The longest timed prefill length within INTERLEAVE_BUDGET decode steps (the shortest
    timed one if none is)."""
    fits = [n for n, s in prefill_s.items() if s <= INTERLEAVE_BUDGET * decode_step_s]
    return max(fits) if fits else min(prefill_s)


def choose_prefill_chunk(
    prefill_s: dict[int, float], candidates: list[int], stages: int, prompt: int
) -> int:
    """The candidate chunk that prefills a `prompt`-token prompt soonest by the timings: its
    chunks stream through `stages` stages, each running its share of a chunk's time, so the
    prompt takes (chunks + stages - 1) of those shares. Short chunks keep more stages busy at
    once; long ones pay each step's fixed costs less often."""

    def predicted_s(chunk: int) -> float:
        return (math.ceil(prompt / chunk) + stages - 1) * prefill_s[chunk] / stages

    return min(candidates, key=predicted_s)


async def measure_chunks(pipeline: Pipeline, prefill_chunk: int, vocab_size: int) -> ChunkChoice:
    """Time, on a warm pipeline, one request's decode step and a prefill of each length in
    powers of two from SHORTEST_CHUNK to `prefill_chunk` (the second run of each shape, the
    warm-up having run the first) and, where cheap, of LONGER_CHUNKS (each run twice, the
    first building it); choose the prefill chunk, and the chunk for prompts that arrive while
    others decode. Within the context of `pipeline`."""
    engine = GenerationEngine(pipeline, prefill_chunk=prefill_chunk)  # no conversation cache
    off = RequestOptions(mtp=False)
    context = pipeline.max_context
    lengths = [n for n in prefill_lengths(prefill_chunk, context) if n < prefill_chunk]
    lengths += [prefill_chunk] if prefill_chunk < context else []
    prompt = synthetic_prompt(DECODE_PROMPT_TOKENS, 0, vocab_size)
    out = await engine.generate(GenerationRequest(prompt, CALIBRATION_TOKENS + 1, off))
    decode_step_s = 1.0 / out.generation_tps if out.generation_tps else 0.0

    async def prefill_s(n: int, runs: int = 1) -> float:
        """The quickest of `runs` prefills of `n` tokens: a first run that builds the shape,
        or one that met the host's noise, is not the chunk's cost."""
        engine.prefill_chunk = n
        request = GenerationRequest(synthetic_prompt(n, 1, vocab_size), 1, off)
        return min([(await engine.generate(request)).time_to_first_token_s for _ in range(runs)])

    timed = {n: await prefill_s(n) for n in lengths}
    interleave = choose_interleave_chunk(decode_step_s, timed)
    candidates = [n for n in timed if n >= min(prefill_chunk, SHORTEST_PREFILL_CHUNK)]
    longer = [n for n in LONGER_CHUNKS if prefill_chunk < n < context]
    if candidates and longer and timed[candidates[-1]] <= LONGER_CHUNK_BUDGET_S:
        # Compared on equal terms: the warm-up ran the configured chunk as a prompt's first
        # chunk, not as a whole prompt (which samples at its end), so it is timed again too.
        timed[candidates[-1]] = await prefill_s(candidates[-1])
        for n in longer:
            if timed[candidates[-1]] > LONGER_CHUNK_BUDGET_S:
                break
            timed[n] = await prefill_s(n, runs=2)
            candidates.append(n)
    stages = pipeline.stages
    chosen = prefill_chunk
    if candidates:
        chosen = choose_prefill_chunk(timed, candidates, stages, min(LONG_PROMPT, context - 1))
    return ChunkChoice(decode_step_s, timed, stages, chosen, min(interleave, chosen))


# Called before each step (`progress.step` names it) and once more after the last one (before
# `run_warmup`'s `last`): a test holds the warm-up here, or reads the nodes' counters between
# steps.
WarmupHook = Callable[[WarmupProgress], Awaitable[None]]


# -- running it ----------------------------------------------------------------------------


async def run_warmup(
    pipeline: Pipeline,
    steps: list[WarmupStep],
    *,
    prefill_chunk: int,
    vocab_size: int,
    progress: WarmupProgress,
    hook: WarmupHook | None = None,
    say: Callable[[str], None] | None = None,
    last: tuple[str, Callable[[], Awaitable[None]]] | None = None,
) -> None:
    """Run `steps` through `pipeline` (prompts cut in `prefill_chunk` chunks, as the serving
    engine cuts them), reporting in `progress` and, line by line, to `say`; then `last` (a
    label and what it runs: the coordinator's chunk measurement), still warming, so that
    `/health` says ready only once it too is done. Raises what a request meets (a node lost:
    `NodeUnavailable`); `progress` then stays "warming"."""
    recorder = _Recorder(pipeline)
    engine = GenerationEngine(recorder, prefill_chunk=prefill_chunk)  # no conversation cache
    progress.begin(len(steps) + (last is not None))
    for i, step in enumerate(steps):
        progress.done, progress.step = i, step.label
        if say is not None:
            say(progress.line())
        if hook is not None:
            await hook(progress)
        for variant in step.variants:
            recorder.reset()
            async with asyncio.TaskGroup() as group:  # one fails: the others are cancelled
                for request in step.requests(variant, vocab_size):
                    group.create_task(_drain(engine, request))
            progress.driven.append(recorder.driven(step.kind, variant))
    if hook is not None:  # after the steps, before `last`: it drives no planned shape
        await hook(progress)
    if last is not None:
        label, run = last
        progress.done, progress.step = len(steps), label
        if say is not None:
            say(progress.line())
        await run()
    progress.done = progress.total
    progress.finish()
    if say is not None:
        say(progress.line())


async def _drain(engine: GenerationEngine, request: GenerationRequest) -> None:
    # Closed here, not by the garbage collector: the request is released on every node now.
    async with contextlib.aclosing(engine.stream(request)) as chunks:
        async for _ in chunks:
            pass


class _Recorder:
    """The pipeline as the warm-up's engine sees it: every step passed on, and counted."""

    def __init__(self, pipeline: Pipeline) -> None:
        self.pipeline = pipeline
        self.reset()

    @property
    def max_context(self) -> int:
        return self.pipeline.max_context

    def reset(self) -> None:
        self.positions = 0
        self.prompt_tokens = 0
        self.request_ids: set[str] = set()
        self._in_flight: Counter[int] = Counter()  # decode steps in flight, by width
        self.most_in_flight: Counter[int] = Counter()

    async def submit(self, step: StepRequest) -> StepResult:
        self.positions += len(step.tokens)
        self.request_ids.add(step.request_id)
        decode = step.n_confirmed == 1 and step.position > 0
        width = len(step.tokens)
        if not decode:
            self.prompt_tokens += len(step.tokens)
            return await self.pipeline.submit(step)
        self._in_flight[width] += 1
        self.most_in_flight[width] = max(self.most_in_flight[width], self._in_flight[width])
        try:
            return await self.pipeline.submit(step)
        finally:
            self._in_flight[width] -= 1

    async def release(self, request_id: str) -> None:
        await self.pipeline.release(request_id)

    def driven(self, kind: str, variant: Variant) -> Driven:
        """What the variant just run submitted."""
        size = self.most_in_flight[variant.width]
        if kind == "prefill":
            size = self.prompt_tokens
        elif kind != "decode":
            size = len(self.request_ids)
        depth = variant.depth if variant.mtp else 0
        return Driven(kind, size, variant.mtp, depth, self.positions)
