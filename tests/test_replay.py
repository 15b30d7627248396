"""Replay: a request cut off mid-generation continues on another pipeline with exactly the
tokens it would have produced (greedy and seeded sampling, with and without MTP).

The engine is cut after a few chunks (as a node loss cuts it), then resumed on a fresh
pipeline from what the cut run emitted; the concatenation must equal an undisturbed run.
A 2-stage local pipeline stands for the new placement, so the replay also crosses layouts.
The coordinator-level half (`ReplayingEngine`) is driven with a pipeline that fails on cue,
and admission is checked to hold new requests while the model is placed again.
"""

from __future__ import annotations

import asyncio

import pytest
from conftest import CODE_PROMPTS, run

from cluster.decode.engine import GenerationEngine, GenerationRequest, ResumePoint
from cluster.decode.local_engine import open_local_engine
from cluster.messages import RequestError, RequestOptions, SamplingParams, StepRequest
from cluster.transport.node_client import NodeUnavailable
from coordinator.admission import AdmissionController, OverCapacity
from coordinator.replay import ReplayingEngine, with_seed

MAX_TOKENS = 32
PREFILL_CHUNK = 8  # small, so that a replay's prefill spans several chunks

CASES = {
    "greedy-mtp": RequestOptions(SamplingParams(), mtp=True),
    "seeded-mtp": RequestOptions(SamplingParams(0.9, top_p=0.95, seed=11), mtp=True),
    "seeded-plain": RequestOptions(SamplingParams(1.0, top_k=50, seed=5), mtp=False),
    "seeded-deep": RequestOptions(SamplingParams(0.8, seed=3), mtp=True, mtp_depth=3),
    "greedy-deep": RequestOptions(SamplingParams(), mtp=True, mtp_depth=2),
}


@pytest.fixture(scope="module")
def engines(model_dir):
    """(the engine that gets cut, the engine a replay continues on: another layout)."""

    async def go():
        first = await open_local_engine(model_dir, prefill_chunk=PREFILL_CHUNK)
        second = await open_local_engine(
            model_dir, ranges=[(0, 3), (3, 8)], prefill_chunk=PREFILL_CHUNK
        )
        return first, second

    first, second = run(go())
    yield first.engine, second.engine
    first.close()
    second.close()


async def _cut_after(engine: GenerationEngine, request, chunks: int) -> ResumePoint:
    """Run `request` for `chunks` chunks, then drop it (as a node loss does)."""
    emitted: list[int] = []
    stream = engine.stream(request)
    chunk = None
    try:
        for _ in range(chunks):
            chunk = await anext(stream)
            emitted += chunk.tokens
    finally:
        await stream.aclose()
    assert chunk is not None and chunk.finish_reason is None, "finished before the cut"
    return ResumePoint(tuple(emitted), chunk.drafts, chunk.drafted, chunk.accepted)


async def _resume(engine: GenerationEngine, request, point: ResumePoint) -> tuple[int, ...]:
    tokens = list(point.emitted)
    async for chunk in engine.stream(request, resume=point):
        tokens += chunk.tokens
    return tuple(tokens)


@pytest.mark.parametrize("case", CASES)
def test_replay_continues_with_the_undisturbed_tokens(engines, tokenizer, case) -> None:
    cut_engine, replay_engine = engines
    prompt = tuple(tokenizer.encode(CODE_PROMPTS[0]))
    request = GenerationRequest(prompt, MAX_TOKENS, CASES[case])

    async def go():
        undisturbed = (await cut_engine.generate(request)).tokens
        assert len(undisturbed) == MAX_TOKENS
        for chunks in (1, 6):
            point = await _cut_after(cut_engine, request, chunks)
            if request.options.mtp:
                assert point.drafts
            replayed = await _resume(replay_engine, request, point)
            assert replayed == undisturbed, f"cut after {chunks} chunk(s)"
        # The replay is itself replayable (a second node loss).
        point = await _cut_after(cut_engine, request, 3)
        stream = replay_engine.stream(request, resume=point)
        more = list(point.emitted)
        try:
            chunk = await anext(stream)
            more += chunk.tokens
        finally:
            await stream.aclose()
        again = ResumePoint(tuple(more), chunk.drafts, chunk.drafted, chunk.accepted)
        assert await _resume(cut_engine, request, again) == undisturbed

    run(go())


def test_next_token_steps_are_validated() -> None:
    with pytest.raises(RequestError):
        StepRequest("r", (1, 2), position=0, sample=True, next_token=3)
    with pytest.raises(RequestError):
        StepRequest("r", (1, 2), position=0, sample=False, draft_len=1, next_token=3)
    StepRequest("r", (1, 2), position=0, sample=False, next_token=3)


def test_out_of_vocabulary_tokens_are_refused(engines) -> None:
    engine, _ = engines
    request = GenerationRequest((1, 2, 10**6), 4)

    async def go():
        with pytest.raises(RequestError, match="outside the vocabulary"):
            await engine.generate(request)
        # and the engine serves on
        assert len((await engine.generate(GenerationRequest((1, 2, 3), 4))).tokens) == 4

    run(go())


def test_concurrent_replays_match(engines, tokenizer) -> None:
    """Several requests cut at different points and replayed together (batched)."""
    cut_engine, replay_engine = engines
    requests = [
        GenerationRequest(tuple(tokenizer.encode(p)), 24, options)
        for p, options in zip(CODE_PROMPTS, list(CASES.values())[1:], strict=True)
    ]

    async def go():
        undisturbed = [
            o.tokens for o in await asyncio.gather(*(cut_engine.generate(r) for r in requests))
        ]
        points = await asyncio.gather(
            *(_cut_after(cut_engine, r, 1 + i) for i, r in enumerate(requests))
        )
        replayed = await asyncio.gather(
            *(_resume(replay_engine, r, p) for r, p in zip(requests, points, strict=True))
        )
        assert replayed == undisturbed

    run(go())


class _FailingPipeline:
    """A pipeline whose node "dies" after `steps` submissions (as RemotePipeline fails)."""

    def __init__(self, inner, steps: int):
        self.inner, self.left = inner, steps

    @property
    def max_context(self) -> int:
        return self.inner.max_context

    async def submit(self, step):
        self.left -= 1
        if self.left < 0:
            raise NodeUnavailable("node n1 (127.0.0.1:1) stopped answering")
        return await self.inner.submit(step)

    async def release(self, request_id: str) -> None:
        await self.inner.release(request_id)


class _Replacement:
    """The coordinator's part: swap in `new` (or fail as when no placement fits)."""

    def __init__(self, engine: GenerationEngine, new, error: str | None = None):
        self.engine, self.new, self.error = engine, new, error
        self.failed: list[object] = []

    async def restored(self, failed, error) -> None:
        self.failed.append(failed)
        if self.error is not None:
            raise NodeUnavailable(f"{error}; {self.error}")
        self.engine.pipeline = self.new


def test_replaying_engine_continues_on_the_new_pipeline(engines, tokenizer) -> None:
    cut_engine, replay_engine = engines
    prompt = tuple(tokenizer.encode(CODE_PROMPTS[1]))
    request = GenerationRequest(prompt, MAX_TOKENS, CASES["seeded-mtp"])

    async def go():
        undisturbed = (await cut_engine.generate(request)).tokens
        failing = _FailingPipeline(cut_engine.pipeline, steps=5)
        engine = GenerationEngine(failing, prefill_chunk=PREFILL_CHUNK)
        replacement = _Replacement(engine, replay_engine.pipeline)
        replaying = ReplayingEngine(engine, replacement)
        tokens = [t async for chunk in replaying.stream(request) for t in chunk.tokens]
        assert tuple(tokens) == undisturbed
        assert replaying.replays_total == 1 and replacement.failed == [failing]

        # No placement fits: the request fails, saying why, and is counted.
        engine = GenerationEngine(_FailingPipeline(cut_engine.pipeline, steps=3))
        replaying = ReplayingEngine(engine, _Replacement(engine, None, "nothing fits"))
        with pytest.raises(NodeUnavailable, match="stopped answering; nothing fits"):
            async for _ in replaying.stream(request):
                pass
        assert replaying.replays_failed == 1 and replaying.replays_total == 0

    run(go())


def test_unseeded_sampled_requests_get_a_seed_to_replay_with(tokenizer) -> None:
    prompt = tuple(tokenizer.encode(CODE_PROMPTS[2]))
    sampled = GenerationRequest(prompt, 4, RequestOptions(SamplingParams(0.7)))
    seeded = with_seed(sampled)
    assert seeded.options.sampling.seed is not None
    assert seeded.request_id == sampled.request_id and seeded.prompt == sampled.prompt
    greedy = GenerationRequest(prompt, 4)
    assert with_seed(greedy) is greedy


def test_admission_holds_new_requests_while_paused() -> None:
    async def go():
        admission = AdmissionController(max_running=2, max_queued=1, queue_timeout_s=5)
        async with admission.slot():  # a running request keeps its slot through the pause
            admission.pause()
            held = admission.slot()
            waiting = asyncio.ensure_future(held.__aenter__())
            await asyncio.sleep(0.05)
            assert not waiting.done() and admission.queued == 1
            with pytest.raises(OverCapacity) as full:  # bounded: the usual 429
                async with admission.slot():
                    pass
            assert full.value.status == 429
            admission.resume()
            await asyncio.wait_for(waiting, 1)
            assert admission.running == 2 and admission.queued == 0
            await held.__aexit__(None, None, None)
        assert admission.running == 0

    run(go())
