"""The prefill chunks the coordinator takes after its warm-up (`warmup.measure_chunks`): timed
through the pipeline, the prefill chunk that would prefill a long prompt soonest over its
stages, longer chunks tried only where a chunk is cheap, and the chunk for prompts that arrive
while others decode no longer than it.

A pipeline that answers after a set time per step and per token stands in for the nodes: what
is chosen then follows from the timings, not from the machine running the test."""

from __future__ import annotations

import asyncio

import pytest
from conftest import run

from cluster.decode.warmup import (
    LONGER_CHUNK_BUDGET_S,
    LONGER_CHUNKS,
    choose_prefill_chunk,
    measure_chunks,
)
from cluster.messages import StepRequest, StepResult

CONTEXT = 8192


class TimedPipeline:
    """Answers each step after `per_step_s` plus `per_token_s` a position; `stages` at once."""

    def __init__(
        self, per_step_s: float, per_token_s: float, stages: int = 2, context: int = CONTEXT
    ) -> None:
        self.per_step_s, self.per_token_s, self._stages = per_step_s, per_token_s, stages
        self._context = context
        self.chunks: list[int] = []

    @property
    def max_context(self) -> int:
        return self._context

    @property
    def stages(self) -> int:
        return self._stages

    async def submit(self, step: StepRequest) -> StepResult:
        if step.position == 0 or step.n_confirmed > 1:
            self.chunks.append(len(step.tokens))
        await asyncio.sleep(self.per_step_s + self.per_token_s * len(step.tokens))
        return StepResult(step.request_id, (7,) if step.sample else (), keep=len(step.tokens))

    async def release(self, request_id: str) -> None:
        pass


def test_the_prefill_chunk_is_the_one_predicted_to_finish_first() -> None:
    # A step's fixed cost dominates: the longest chunk, whose prompt takes the fewest steps.
    flat = {256: 0.05, 512: 0.05, 1024: 0.05, 2048: 0.05}
    assert choose_prefill_chunk(flat, list(flat), stages=2, prompt=16384) == 2048
    # Cost by the token: shorter chunks keep both stages busy for more of the prompt.
    linear = {256: 0.1, 512: 0.2, 1024: 0.4, 2048: 0.8}
    assert choose_prefill_chunk(linear, list(linear), stages=2, prompt=16384) == 256
    # One stage at a time: a chunk's length changes nothing but its fixed cost.
    assert choose_prefill_chunk(linear, list(linear), stages=1, prompt=16384) == 256
    assert choose_prefill_chunk({512: 0.2, 1024: 0.39}, [512, 1024], 1, 16384) == 1024
    # A prompt of little more than a chunk: one longer chunk beats two short ones.
    assert choose_prefill_chunk({256: 0.1, 512: 0.12}, [256, 512], 2, 300) == 512


def test_where_chunks_are_cheap_longer_ones_are_timed_and_taken() -> None:
    pipeline = TimedPipeline(per_step_s=0.05, per_token_s=0.0)
    choice = run(measure_chunks(pipeline, 512, vocab_size=1000))
    assert set(LONGER_CHUNKS) <= set(choice.prefill_s)  # each timed (after a first run)
    assert pipeline.chunks.count(2048) == 2
    assert choice.stages == 2 and choice.prefill_chunk == 2048
    # Every timed prefill takes about a decode step: the longest of the short ones, which a
    # prompt arriving while others decode is cut in, never longer than the prefill chunk.
    assert choice.interleave_chunk == 512
    assert "prefill chunk 2048 tokens, 512 while others decode" in choice.line()


def test_where_a_chunk_is_dear_longer_ones_are_not_tried() -> None:
    pipeline = TimedPipeline(per_step_s=0.001, per_token_s=0.003)
    choice = run(measure_chunks(pipeline, 512, vocab_size=1000))
    assert choice.prefill_s[512] > LONGER_CHUNK_BUDGET_S
    assert not set(LONGER_CHUNKS) & set(choice.prefill_s)
    assert choice.prefill_chunk in (256, 512)
    # No prefill fits within 1.5 decode steps: the shortest one timed.
    assert choice.interleave_chunk == 4


@pytest.mark.parametrize("context", [300, 1100])
def test_only_chunks_within_the_context_are_timed(context: int) -> None:
    pipeline = TimedPipeline(per_step_s=0.005, per_token_s=0.0, context=context)
    choice = run(measure_chunks(pipeline, 512, vocab_size=1000))
    assert all(n < context for n in choice.prefill_s)
    assert max(pipeline.chunks) < context
