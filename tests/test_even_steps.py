"""A batch of steps of mixed lengths, padded to one (`cluster.model.even_steps`), computes
exactly what it computes unpadded, and leaves every cache as the unpadded batch does."""

from __future__ import annotations

import asyncio
import dataclasses

import mlx.core as mx
import pytest
from conftest import CODE_PROMPTS, run
from test_rollback import _assert_same_caches

from cluster.decode.engine import GenerationRequest
from cluster.decode.local_engine import open_local_engine
from cluster.messages import RequestOptions
from cluster.model.cache import RequestCache
from cluster.model.even_steps import EvenSteps
from cluster.model.fast_path import DecodeFastPath
from cluster.model.layers import Segment
from cluster.model.loading import load_shard

# Bitwise identity across row counts is the CPU backend's (tests/test_decode_fast_path.py).
pytestmark = pytest.mark.skipif(
    mx.cuda.is_available(), reason="bitwise identity across row counts holds on the CPU only"
)

PLAIN = DecodeFastPath.plain()
EVEN = dataclasses.replace(PLAIN, even_steps=True)


@pytest.fixture
def padded_batches(monkeypatch) -> list[tuple[int, ...]]:
    """The step lengths of each batch that ran padded."""
    seen: list[tuple[int, ...]] = []
    drop_padding = EvenSteps.drop_padding

    def counted(self: EvenSteps) -> None:
        seen.append(self.lengths)
        drop_padding(self)

    monkeypatch.setattr(EvenSteps, "drop_padding", counted)
    return seen


def _step(shard, caches: list[RequestCache], steps: list[tuple[tuple[int, ...], int]]) -> mx.array:
    """One batch: per request (tokens, rollback of the step before); the first token
    confirmed, the rest drafts."""
    segments = []
    for cache, (tokens, rollback) in zip(caches, steps, strict=True):
        cache.begin_step(rollback, len(tokens))
        segments.append(Segment(cache, len(tokens), 1))
    ids = mx.array([t for tokens, _ in steps for t in tokens])[None]
    hidden = shard(shard.embed(ids), segments)
    mx.eval(hidden, [c.arrays() for c in caches])
    return hidden


def _prefilled(shard, prompts: list[list[int]]) -> list[RequestCache]:
    caches = []
    for prompt in prompts:
        cache = RequestCache.for_layers(shard.linear_flags)
        cache.begin_step(0, len(prompt))
        prefill = [Segment(cache, len(prompt), len(prompt))]
        mx.eval(shard(shard.embed(mx.array(prompt)[None]), prefill))
        caches.append(cache)
    return caches


def test_mixed_lengths_padded_compute_what_unpadded_do(model_dir, tokenizer, padded_batches):
    plain, even = load_shard(model_dir, fast_path=PLAIN), load_shard(model_dir, fast_path=EVEN)
    prompts = [tokenizer.encode(p) for p in CODE_PROMPTS[:3]]
    batches = [
        # a draft, none, two drafts
        [((11, 12), 0), ((13,), 0), ((14, 15, 16), 0)],
        # the first rejected its draft, the third kept one of two; the second now drafts
        [((17,), 1), ((18, 19), 0), ((20,), 1)],
        # one shape again (the second's draft rejected): nothing padded
        [((21,), 0), ((22,), 1), ((23,), 0)],
        [((24,), 0), ((25, 26, 27, 28), 0), ((29, 30), 0)],
        [((31,), 0), ((32,), 3), ((33,), 1)],
    ]
    reference, padded = _prefilled(plain, prompts), _prefilled(even, prompts)
    for steps in batches:
        expected, got = _step(plain, reference, steps), _step(even, padded, steps)
        assert got.shape == expected.shape
        assert mx.array_equal(got, expected)
        for a, b in zip(reference, padded, strict=True):
            _assert_same_caches(a, b)
            assert a.last_step_len == b.last_step_len
            assert a.snapshots.keys() == b.snapshots.keys()
            assert all(a.snapshots[i].keys() == b.snapshots[i].keys() for i in a.snapshots)
    assert padded_batches == [(2, 1, 3), (1, 2, 1), (1, 4, 2)]


def test_mixed_batches_that_cannot_be_padded_run_as_they_are(model_dir) -> None:
    shard = load_shard(model_dir, fast_path=EVEN)
    cache = lambda: RequestCache.for_layers(shard.linear_flags)  # noqa: E731
    # one shape; confirmed counts that differ (a prefill chunk beside a decode step); too long
    assert EvenSteps.of([Segment(cache(), 2, 1), Segment(cache(), 2, 1)]) is None
    assert EvenSteps.of([Segment(cache(), 4, 4), Segment(cache(), 1, 1)]) is None
    assert EvenSteps.of([Segment(cache(), 12, 1), Segment(cache(), 1, 1)]) is None
    even = EvenSteps.of([Segment(cache(), 3, 1), Segment(cache(), 1, 1)])
    assert even is not None and even.lengths == (3, 1) and even.longest == 3
    assert [(s.length, s.n_confirmed) for s in even.segments] == [(3, 1), (3, 1)]


async def _mixed_depths(model_dir, prompts, fast_path: DecodeFastPath | None, concurrent: bool):
    """One request drafting at depth 1 and one at depth 2 beside two that do not."""
    local = await open_local_engine(model_dir, fast_path=fast_path)
    try:
        stop = frozenset(local.config.eos_token_ids)
        depths = [1, 0, 2, 0]
        requests = [
            GenerationRequest(tuple(p), 24, RequestOptions(mtp=d > 0, mtp_depth=d), stop)
            for p, d in zip(prompts, depths, strict=True)
        ]
        if concurrent:
            return await asyncio.gather(*(local.engine.generate(r) for r in requests))
        return [await local.engine.generate(r) for r in requests]
    finally:
        local.close()


def test_a_batch_of_drafting_and_plain_requests_keeps_greedy_identity(
    model_dir, tokenizer, padded_batches
) -> None:
    prompts = [tokenizer.encode(p) for p in CODE_PROMPTS[:4]]
    reference = run(_mixed_depths(model_dir, prompts, PLAIN, concurrent=False))
    assert not padded_batches
    together = run(_mixed_depths(model_dir, prompts, EVEN, concurrent=True))
    assert [o.tokens for o in together] == [o.tokens for o in reference]
    assert padded_batches, "no batch mixed drafting and plain steps"
    assert sum(o.drafted for o in together) > 0
