"""Steps built ahead (`ShardRunner.lookahead`): a head-and-tail shard builds each request's
next plain step on the token still on the device. The tokens must be those of the runner
that builds nothing ahead, and a step built ahead and not asked for must leave no trace."""

from __future__ import annotations

import asyncio

import pytest
from conftest import CODE_PROMPTS, run
from test_rollback import _assert_same_caches

from cluster.decode.engine import GenerationRequest
from cluster.decode.local_engine import open_local_engine
from cluster.decode.runner import ShardRunner
from cluster.messages import RequestOptions, SamplingParams, StepRequest
from cluster.model.loading import load_shard

MAX_TOKENS = 40


async def _generate(
    model_dir,
    requests: list[GenerationRequest],
    *,
    lookahead: bool,
    mtp: bool = False,
    concurrent: bool = False,
):
    """The outputs, and the (used, undone) counts of the steps built ahead."""
    local = await open_local_engine(model_dir, mtp=mtp)
    (runner,) = local.runners
    runner.lookahead = lookahead
    runner.mtp_lookahead = True  # whatever the backend's default
    try:
        if concurrent:
            outs = await asyncio.gather(*(local.engine.generate(r) for r in requests))
        else:
            outs = [await local.engine.generate(r) for r in requests]
        assert not runner.requests, "state leaked"
        return outs, (runner.steps_ahead_used, runner.steps_ahead_undone)
    finally:
        local.close()


def _requests(tokenizer, options: RequestOptions, max_tokens=MAX_TOKENS, stop=frozenset()):
    lengths = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(CODE_PROMPTS)
    return [
        GenerationRequest(tuple(tokenizer.encode(p)), n, options, stop)
        for p, n in zip(CODE_PROMPTS, lengths, strict=True)
    ]


def _same(a, b) -> None:
    assert [o.tokens for o in a] == [o.tokens for o in b]
    assert [o.finish_reason for o in a] == [o.finish_reason for o in b]


def test_greedy_tokens_are_unchanged_and_steps_are_built_ahead(model_dir, tokenizer) -> None:
    requests = _requests(tokenizer, RequestOptions(mtp=False))
    ahead, (used, undone) = run(_generate(model_dir, requests, lookahead=True))
    plain, counts = run(_generate(model_dir, requests, lookahead=False))
    _same(ahead, plain)
    assert counts == (0, 0)
    # Every decode step came from a step built ahead (the first one on the prompt's last
    # chunk); the one built after each request's last step was undone at its release.
    assert used == len(requests) * (MAX_TOKENS - 1)
    assert undone == len(requests)


def test_sampled_tokens_and_logprobs_are_unchanged(model_dir, tokenizer) -> None:
    sampling = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=7)
    options = RequestOptions(sampling, mtp=False, logprobs=True, top_logprobs=3)
    requests = _requests(tokenizer, options)
    ahead, (used, _) = run(_generate(model_dir, requests, lookahead=True))
    plain, _ = run(_generate(model_dir, requests, lookahead=False))
    _same(ahead, plain)
    assert used > 0


def test_concurrent_requests_that_end_apart_are_unchanged(model_dir, tokenizer) -> None:
    """A request that stops (a stop token, its max_tokens) changes the batch: the step built
    ahead for all of them is undone and the next batch is built as asked."""
    stop = frozenset({tokenizer.encode("\n")[0]})
    requests = _requests(tokenizer, RequestOptions(mtp=False), [7, 23, 41, 30], stop)
    ahead, (used, undone) = run(_generate(model_dir, requests, lookahead=True, concurrent=True))
    plain, _ = run(_generate(model_dir, requests, lookahead=False, concurrent=True))
    _same(ahead, plain)
    assert used > 0 and undone > 0


@pytest.mark.parametrize("concurrent", [False, True], ids=["one_by_one", "concurrent"])
def test_mtp_tokens_and_verdicts_are_unchanged(model_dir, tokenizer, concurrent) -> None:
    """Greedy MTP at one draft a step: each step is built before the verdict on the draft
    before it is read, the caches taking that verdict on the device. Rejected drafts included,
    the tokens and verdicts are those of the runner that builds nothing ahead."""
    requests = _requests(tokenizer, RequestOptions(mtp=True))
    ahead, (used, _) = run(
        _generate(model_dir, requests, lookahead=True, mtp=True, concurrent=concurrent)
    )
    plain, counts = run(
        _generate(model_dir, requests, lookahead=False, mtp=True, concurrent=concurrent)
    )
    _same(ahead, plain)
    assert [(o.drafted, o.accepted) for o in ahead] == [(o.drafted, o.accepted) for o in plain]
    assert counts == (0, 0)
    assert any(o.accepted < o.drafted for o in ahead), "no draft was rejected"
    if not concurrent:  # every step verifies a draft, and all but a last one came from ahead
        assert used >= sum(o.drafted for o in ahead) - len(requests)
    else:
        assert used > 0


def test_mtp_steps_whose_next_step_needs_the_host_are_not_built_ahead(model_dir, tokenizer) -> None:
    """A sampled request's random numbers are keyed by the position that the verdict fixes,
    and deeper drafts are chained after it: those steps wait for the verdict."""
    sampling = SamplingParams(temperature=0.8, seed=3)
    for options in (RequestOptions(sampling), RequestOptions(mtp_depth=2)):
        requests = _requests(tokenizer, options, max_tokens=12)[:2]
        ahead, counts = run(_generate(model_dir, requests, lookahead=True, mtp=True))
        plain, _ = run(_generate(model_dir, requests, lookahead=False, mtp=True))
        _same(ahead, plain)
        assert counts == (0, 0)


def test_a_verdict_the_host_reads_otherwise_undoes_the_step_built_on_it(
    model_dir, tokenizer, monkeypatch
) -> None:
    """A decision replaced on the host (here: every draft accepted, whatever the device
    found) must not leave the step built on the device's verdict in place."""
    import cluster.decode.tail
    from cluster.decode.verify import decide

    def accept_all(candidates, drafts, forced=None):
        if not drafts:
            return decide(candidates, drafts, forced)
        return (*drafts, candidates.target.tolist()[len(drafts)]), len(drafts)

    monkeypatch.setattr(cluster.decode.tail, "decide", accept_all)
    requests = _requests(tokenizer, RequestOptions(mtp=True), max_tokens=16)[:2]
    ahead, (_, undone) = run(_generate(model_dir, requests, lookahead=True, mtp=True))
    plain, _ = run(_generate(model_dir, requests, lookahead=False, mtp=True))
    _same(ahead, plain)
    assert undone > len(requests)  # (one per request is the step after its last)


@pytest.fixture(scope="module")
def shard(model_dir):
    return load_shard(model_dir, mtp=False)


def _prefill(runner: ShardRunner, rid: str, prompt: tuple[int, ...]):
    options = RequestOptions(mtp=False)
    (result,) = runner.run([StepRequest(rid, prompt, 0, options=options)]).results
    return result


@pytest.mark.parametrize("then", ["other_token", "rollback", "release_as_prefix", "other_batch"])
def test_a_step_built_ahead_and_not_asked_for_leaves_no_trace(shard, tokenizer, then) -> None:
    """Whatever comes instead of the step built ahead finds the caches of a runner that built
    nothing ahead, and gets the same results."""
    prompt = tuple(tokenizer.encode(CODE_PROMPTS[0]))
    ahead, plain = ShardRunner(shard), ShardRunner(shard, lookahead=False)
    first = _prefill(ahead, "r", prompt)
    assert _prefill(plain, "r", prompt) == first
    n = len(prompt)
    step = StepRequest("r", first.tokens, n)
    (result,) = ahead.run([step]).results
    assert plain.run([step]).results == [result]
    assert ahead._ahead is not None  # the step at n + 1 is on its way
    if then == "other_token":  # e.g. a constraint that changed the token
        other = StepRequest("r", ((result.tokens[0] + 1) % 1000,), n + 1)
        assert ahead.run([other]).results == plain.run([other]).results
    elif then == "rollback":  # the standalone signal (of nothing: the last step had no draft)
        assert ahead.rollback("r", 0) == plain.rollback("r", 0) == n + 1
    elif then == "release_as_prefix":  # the engine keeps the conversation so far
        kept = ahead.release_as_prefix("r", 1, n + 1)
        assert kept == plain.release_as_prefix("r", 1, n + 1) and kept[0]
        reopened = StepRequest("s", result.tokens, n + 1, prefix_from=1)
        assert ahead.run([reopened]).results == plain.run([reopened]).results
    else:  # another request joins: the batch is not the one built
        _prefill(ahead, "q", prompt[:5])
        _prefill(plain, "q", prompt[:5])
        both = [StepRequest("r", result.tokens, n + 1), StepRequest("q", (7,), 5)]
        assert ahead.run(both).results == plain.run(both).results
    ahead.settle()  # (the step after the last one is on its way)
    for rid, state in ahead.requests.items():
        _assert_same_caches(state.cache, plain.requests[rid].cache)
    assert ahead.steps_ahead_undone >= 1


@pytest.mark.parametrize("mtp", [False, True], ids=["mtp_off", "mtp_on"])
def test_moe_greedy_tokens_are_unchanged(tmp_path, mtp) -> None:
    from checkpoints import make_checkpoint

    path = make_checkpoint(tmp_path / "moe", moe=True, mtp_experts="fused")
    options = RequestOptions(mtp=mtp)
    requests = [GenerationRequest(p, 24, options) for p in [(5, 17, 300, 42, 7), (1, 2, 3, 4)]]
    ahead, (used, _) = run(_generate(path, requests, lookahead=True, mtp=mtp, concurrent=True))
    plain, _ = run(_generate(path, requests, lookahead=False, mtp=mtp, concurrent=True))
    _same(ahead, plain)
    assert [(o.drafted, o.accepted) for o in ahead] == [(o.drafted, o.accepted) for o in plain]
    assert used > 0


@pytest.fixture(scope="module")
def mtp_shard(model_dir):
    return load_shard(model_dir)


@pytest.mark.parametrize(
    "then", ["asked", "other_draft", "no_draft", "rollback", "release_as_prefix", "other_batch"]
)
def test_an_mtp_step_built_on_a_rejection_leaves_no_trace(mtp_shard, tokenizer, then) -> None:
    """A step [y, d] whose draft is rejected: the step after it is built with the rejection
    taken on the device, then resolved once read. Whether that step is asked for or something
    else comes, the caches (the MTP head's too) are those of a runner that built nothing
    ahead, once the rollback that each request's last step still owes is applied (a rejected
    draft's slot is dead from the verdict on: a step built ahead may have moved keys over it)."""
    prompt = tuple(tokenizer.encode(CODE_PROMPTS[0]))
    ahead = ShardRunner(mtp_shard, mtp_lookahead=True)
    plain = ShardRunner(mtp_shard, lookahead=False)
    owed: dict[str, int] = {}

    def both(steps: list[StepRequest]) -> list:
        results = ahead.run(steps).results
        assert plain.run(steps).results == results
        for step, result in zip(steps, results, strict=True):
            owed[step.request_id] = len(step.tokens) - result.keep
        return results

    (first,) = both([StepRequest("r", prompt, 0)])
    n = len(prompt)
    wrong = (first.drafts[0] + 1) % mtp_shard.vocab_size  # greedy decoding will not pick it
    (rejected,) = both([StepRequest("r", (first.tokens[0], wrong), n, draft_len=1)])
    assert rejected.accepted == 0 and ahead._ahead is not None
    after = StepRequest(
        "r", (rejected.tokens[-1], *rejected.drafts), n + 1, draft_len=1, rollback=1
    )
    if then == "asked":
        both([after])
        assert ahead.steps_ahead_used == 1
    elif then == "other_draft":
        both([StepRequest("r", (rejected.tokens[-1], wrong), n + 1, draft_len=1, rollback=1)])
    elif then == "no_draft":  # the engine cut the drafts (max_tokens)
        both([StepRequest("r", rejected.tokens[-1:], n + 1, rollback=1)])
    elif then == "rollback":
        assert ahead.rollback("r", 1) == plain.rollback("r", 1) == n + 1
        owed["r"] = 0
    elif then == "release_as_prefix":
        kept = ahead.release_as_prefix("r", 1, n + 1)
        assert kept == plain.release_as_prefix("r", 1, n + 1) and kept[0]
        both([StepRequest("s", after.tokens, n + 1, draft_len=1, prefix_from=1)])
    else:
        both([StepRequest("q", prompt[:5], 0)])
        both([after, StepRequest("q", (7,), 5)])
    ahead.settle()
    assert ahead.requests.keys() == plain.requests.keys()
    for rid, state in ahead.requests.items():
        other = plain.requests[rid]
        assert ahead.rollback(rid, owed[rid]) == plain.rollback(rid, owed[rid])
        assert state.tail.drafts == other.tail.drafts
        assert state.cache.deferred is None and state.tail.mtp_cache.deferred is None
        _assert_same_caches(state.cache, other.cache)
        _assert_same_caches(state.tail.mtp_cache, other.tail.mtp_cache)
    assert ahead.steps_ahead_used + ahead.steps_ahead_undone >= 1
