"""A rejected draft, once restored and trimmed, leaves every cache as if never seen."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from conftest import CODE_PROMPTS
from mlx_lm.models.cache import KVCache

from cluster.decode.runner import ShardRunner
from cluster.messages import RequestError, StepRequest
from cluster.model.cache import own
from cluster.model.loading import load_shard


@pytest.fixture(scope="module")
def shard(model_dir):
    return load_shard(model_dir)


def _layer_arrays(cache) -> list[np.ndarray]:
    """A cache's meaningful contents: KV up to its offset, GDN conv and recurrent state."""
    if isinstance(cache, KVCache):
        keys, values = cache.keys[..., : cache.offset, :], cache.values[..., : cache.offset, :]
        return [np.array(keys.astype(mx.float32)), np.array(values.astype(mx.float32))]
    return [np.array(own(a).astype(mx.float32)) for a in cache.cache]


def _assert_same_caches(a, b) -> None:
    assert a.position == b.position
    assert len(a.layers) == len(b.layers)
    for la, lb in zip(a.layers, b.layers, strict=True):
        if isinstance(la, KVCache):
            assert la.offset == lb.offset
        for x, y in zip(_layer_arrays(la), _layer_arrays(lb), strict=True):
            np.testing.assert_array_equal(x, y)


def _prefill(runner: ShardRunner, rid: str, prompt: tuple[int, ...]):
    (result,) = runner.run([StepRequest(rid, prompt, 0)]).results
    return result


@pytest.mark.parametrize("signal", ["on_next_step", "standalone"])
def test_rejected_draft_is_undone_exactly(shard, tokenizer, signal: str) -> None:
    prompt = tuple(tokenizer.encode(CODE_PROMPTS[0]))
    drafted, clean = ShardRunner(shard), ShardRunner(shard)
    first = _prefill(drafted, "r", prompt)
    assert len(first.drafts) == 1
    assert _prefill(clean, "r", prompt) == first
    (y,) = first.tokens
    n = len(prompt)

    # Force a rejection: a draft that greedy decoding will not pick.
    wrong = (first.drafts[0] + 1) % 8192
    (rejected,) = drafted.run([StepRequest("r", (y, wrong), n, draft_len=1)]).results
    assert rejected.keep == 1 and rejected.accepted == 0 and rejected.drafted == 1
    # The run that never saw the draft computes [y] alone.
    (plain,) = clean.run([StepRequest("r", (y,), n)]).results
    assert rejected.tokens == plain.tokens and rejected.drafts == plain.drafts

    nxt = StepRequest("r", (plain.tokens[0],), n + 1)
    if signal == "standalone":
        assert drafted.rollback("r", 1) == n + 1
        clean.settle()  # (the step built ahead of its next one)
        _assert_same_caches(drafted.requests["r"].cache, clean.requests["r"].cache)
        carried = nxt
    else:  # the signal rides on the next step and is applied before computing it
        carried = StepRequest("r", nxt.tokens, nxt.position, rollback=1)
    assert drafted.run([carried]).results == clean.run([nxt]).results
    drafted.settle()
    clean.settle()
    _assert_same_caches(drafted.requests["r"].cache, clean.requests["r"].cache)
    _assert_same_caches(drafted.requests["r"].tail.mtp_cache, clean.requests["r"].tail.mtp_cache)


def test_rollback_larger_than_the_last_step_is_refused(shard, tokenizer) -> None:
    runner = ShardRunner(shard)
    prompt = tuple(tokenizer.encode(CODE_PROMPTS[1]))
    first = _prefill(runner, "r", prompt)
    runner.run([StepRequest("r", (first.tokens[0], *first.drafts), len(prompt), draft_len=1)])
    with pytest.raises(RequestError, match="exceeds"):
        runner.rollback("r", 3)
    out = runner.run([StepRequest("r", (1,), len(prompt) + 2, rollback=3)])
    assert "r" in out.errors and not out.results
    with pytest.raises(RequestError, match="unknown request"):
        runner.rollback("nope", 1)


def test_a_released_request_is_not_reopened_by_a_late_step(shard, tokenizer) -> None:
    """A client that hung up mid-prefill: its release can overtake its first step."""
    runner = ShardRunner(shard)
    assert not runner.release("late")  # the release arrives first
    out = runner.run([StepRequest("late", tuple(tokenizer.encode("x = 1")), 0)])
    assert "late" in out.errors and "released" in str(out.errors["late"])
    assert not runner.requests
