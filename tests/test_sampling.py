"""Sampling: the filters, and lossless speculative sampling with the MTP head."""

from __future__ import annotations

import asyncio
from collections import Counter

import mlx.core as mx
import numpy as np
import pytest
from conftest import run
from scipy.stats import chi2_contingency

import cluster.decode.verify as verify
from cluster.decode.engine import GenerationRequest
from cluster.decode.local_engine import open_local_engine
from cluster.decode.prefix_index import PrefixIndex
from cluster.decode.sampling import RequestRandom, log_probs, sample_with
from cluster.messages import RequestError, RequestOptions, SamplingParams

# Requests per sample (each a batch of them at once). Power: in a run of 800, three
# subsamples of 200 told the accept-every-draft verifier below from plain sampling at
# p = 1e-11 to 4e-10 (the test asks for 1e-3). The test's own seeds at 150 draws: p = 5e-9
# for that verifier, 0.10 and 0.47 for the real one (at 250: 3e-14, 0.62 and 0.95). Each
# draw starts from the prompt's snapshot: 30 s for the test, against 55 s prefilling it each.
DRAWS = 150
PROMPT = "import os\nimport sys\n\n\ndef "


def test_filters() -> None:
    logits = mx.log(mx.array([[0.5, 0.25, 0.15, 0.1]]))
    probs = lambda **kw: np.exp(np.array(log_probs(logits, SamplingParams(1.0, **kw))))[0]  # noqa: E731
    np.testing.assert_allclose(probs(), [0.5, 0.25, 0.15, 0.1], rtol=1e-5)
    np.testing.assert_allclose(probs(top_k=2), [2 / 3, 1 / 3, 0, 0], rtol=1e-5)
    np.testing.assert_allclose(probs(top_p=0.7), [2 / 3, 1 / 3, 0, 0], rtol=1e-5)
    np.testing.assert_allclose(probs(min_p=0.35), [2 / 3, 1 / 3, 0, 0], rtol=1e-5)
    hot = np.exp(np.array(log_probs(logits, SamplingParams(2.0))))[0]
    assert hot[0] < 0.5 and hot[3] > 0.1
    greedy = sample_with(log_probs(logits, SamplingParams()), SamplingParams(), None)
    assert greedy.item() == 0


def _reference_filters(logits: np.ndarray, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """The filters' rule by sorting everything (float64): top-k keeps what is at least the
    k-th largest; top-p keeps the likeliest while the mass before them is below top_p, and
    every token tied with the last one kept; min-p keeps what is at least min_p x the top.
    Also which tokens top-p's cut leaves to rounding: float32 sums 248k probabilities to
    about 1e-4, so a token whose mass before it is that close to top_p may fall either way."""
    z = logits.astype(np.float64) / params.temperature
    if 0 < params.top_k < z.size:
        z = np.where(z < np.sort(z)[-params.top_k], -np.inf, z)
    lp = z - np.logaddexp.reduce(z)
    close = np.zeros(z.shape, dtype=bool)
    if params.top_p < 1.0:
        ranked = np.sort(lp)[::-1]
        before = np.concatenate([[0.0], np.cumsum(np.exp(ranked))[:-1]])
        last = ranked[(before < params.top_p).sum() - 1]
        # The mass of the tokens likelier than each token.
        above = np.cumsum(np.exp(ranked))[np.searchsorted(-ranked, -lp, side="left") - 1]
        above = np.where(lp >= ranked[0], 0.0, above)
        close = np.abs(above - params.top_p) < 1e-3
        lp = np.where(lp < last, -np.inf, lp)
    if params.min_p > 0.0:
        lp = np.where(lp < lp.max() + np.log(params.min_p), -np.inf, lp)
    return lp - np.logaddexp.reduce(lp), close


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(0.7, top_k=20),
        SamplingParams(0.7, top_p=0.95),
        SamplingParams(0.6, top_k=20, top_p=0.95),
        SamplingParams(1.0, top_k=500, top_p=0.5),
        SamplingParams(0.7, top_p=0.8, min_p=0.05),
        SamplingParams(1.3, top_k=3),
    ],
)
def test_filters_match_the_sorted_rule_at_a_real_vocabulary(params: SamplingParams) -> None:
    """The filters take no sort of the vocabulary (a partition for top-k, a sort of top-k's
    survivors for top-p) and keep what sorting everything keeps, ties included: bf16 logits
    over a 248k vocabulary tie often, and a tie at the cut stays in."""
    rng = np.random.default_rng(5)
    rows = [rng.normal(0, 3, 248320), rng.normal(0, 0.5, 248320)]
    rows.append(np.round(rows[0]))  # many exact ties, at every cut
    logits = mx.array(np.stack(rows)).astype(mx.bfloat16)
    ours = np.array(log_probs(logits, params))
    for row, got in zip(np.array(logits.astype(mx.float32)), ours, strict=True):
        want, close = _reference_filters(row, params)
        differ = np.isinf(got) != np.isinf(want)
        assert not (differ & ~close).any(), np.flatnonzero(differ & ~close)[:10]
        kept = ~np.isinf(want) & ~np.isinf(got)
        np.testing.assert_allclose(got[kept], want[kept], atol=2e-4 + differ.sum() * 1e-4)


def test_seeded_sampling_replays() -> None:
    logits = mx.random.normal((1, 100), key=mx.random.key(3))
    params = SamplingParams(1.0, seed=7)

    def draw() -> list[int]:
        rng = RequestRandom(7)
        lp = log_probs(logits, params)
        return [sample_with(lp, params, rng.uniform((1,))).item() for _ in range(20)]

    assert draw() == draw()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -1},
        {"top_p": 0},
        {"top_p": 1.5},
        {"top_k": -1},
        {"min_p": 1},
        {"seed": -1},
        {"seed": 2**63},
    ],
)
def test_bad_sampling_params(kwargs: dict) -> None:
    with pytest.raises(RequestError):
        SamplingParams(**kwargs)


def test_verifier_is_lossless_on_fixed_distributions() -> None:
    """Draft from q, verify against p: the emitted first token is distributed as p."""
    p = np.array([0.5, 0.2, 0.2, 0.1])
    q = np.array([0.1, 0.6, 0.1, 0.2])
    params = SamplingParams(1.0)
    rng = RequestRandom(0)
    target = mx.log(mx.array(np.stack([p, p])))
    counts = Counter()
    for _ in range(4000):
        d = int(mx.random.categorical(mx.log(mx.array(q)), key=rng.next_key()).item())
        c = verify.propose(target, (d,), mx.log(mx.array(q))[None], params, rng)
        mx.eval(c.arrays())
        emitted, _ = verify.decide(c, (d,))
        counts[emitted[0]] += 1
    observed = np.array([counts[i] for i in range(4)])
    _, pvalue = chi2_contingency(np.stack([observed, p * 4000]))[:2]
    assert pvalue > 1e-3, (observed, p * 4000)


@pytest.mark.parametrize("depth", [1, 3])
def test_a_batch_samples_each_request_as_it_would_alone(model_dir, tokenizer, depth) -> None:
    """The tail transforms the rows of requests that sample alike together (one call per
    setup), its chained drafts' too: seeded requests of several setups, MTP on, decode in one
    batch the tokens each decodes alone."""
    setups = [
        SamplingParams(0.7, seed=1),
        SamplingParams(0.7, seed=2),
        SamplingParams(0.9, top_k=20, top_p=0.9, seed=3),
        SamplingParams(),
        SamplingParams(0.7, seed=4),
        SamplingParams(0.9, top_k=20, top_p=0.9, seed=5),
    ]
    prompt = tuple(tokenizer.encode(PROMPT))
    options = [RequestOptions(p, mtp=True, mtp_depth=depth) for p in setups]
    requests = [GenerationRequest(prompt, 24, o) for o in options]

    async def go():
        local = await open_local_engine(model_dir, mtp=True)
        try:
            alone = [(await local.engine.generate(r)).tokens for r in requests]
            outs = await asyncio.gather(*(local.engine.generate(r) for r in requests))
            assert sum(o.drafted for o in outs) > 0
            return alone, [o.tokens for o in outs]
        finally:
            local.close()

    alone, together = run(go())
    assert together == alone
    assert len(set(alone)) == len(alone)  # the setups and seeds do differ


async def _second_and_third_tokens(model_dir, tokenizer, *, mtp: bool, seed0: int):
    """Each draw's tokens 1 and 2 (token 1 is the first a draft can reach). The prompt less
    its last token is prefilled once, into the conversation cache; every draw starts from
    that snapshot and prefills one token: the p-values of prefilling the whole prompt each
    time (0.10 and 0.47), in half the time."""
    local = await open_local_engine(model_dir, mtp=mtp, prefix_index=PrefixIndex())
    try:
        prompt = tuple(tokenizer.encode(PROMPT))
        options = RequestOptions(SamplingParams(), mtp)
        await local.engine.generate(GenerationRequest(prompt[:-1], 1, options))
        requests = [
            GenerationRequest(prompt, 3, RequestOptions(SamplingParams(1.0, seed=seed0 + i), mtp))
            for i in range(DRAWS)
        ]
        outs = await asyncio.gather(*(local.engine.generate(r) for r in requests))
        assert local.engine.prefix_index.stats.hits == DRAWS
        if mtp:
            assert sum(o.drafted for o in outs) > 0
        return [o.tokens[1] for o in outs], [o.tokens[2] for o in outs]
    finally:
        local.close()


def _homogeneity_pvalue(a: list[int], b: list[int]) -> float:
    """Chi-square test that two samples come from one distribution (rare tokens pooled)."""
    ca, cb = Counter(a), Counter(b)
    common = [t for t in set(ca) | set(cb) if ca[t] + cb[t] >= 10]
    rows = [[ca[t] for t in common], [cb[t] for t in common]]
    rows[0].append(len(a) - sum(rows[0]))
    rows[1].append(len(b) - sum(rows[1]))
    table = np.array(rows)
    table = table[:, table.sum(axis=0) > 0]
    return float(chi2_contingency(table)[1])


def test_mtp_sampling_is_distributed_as_plain_sampling(model_dir, tokenizer, monkeypatch) -> None:
    plain = run(_second_and_third_tokens(model_dir, tokenizer, mtp=False, seed0=0))
    spec = run(_second_and_third_tokens(model_dir, tokenizer, mtp=True, seed0=10**6))
    for a, b in zip(plain, spec, strict=True):
        assert _homogeneity_pvalue(a, b) > 1e-3

    # The same test has the power to see a verifier that is not lossless: accept every draft.
    real_propose = verify.propose

    def accept_all(target, drafts, draft_logprobs, params, rng):
        c = real_propose(target, drafts, draft_logprobs, params, rng)
        return verify.Candidates(c.target, mx.ones_like(c.accept), c.correction) if drafts else c

    monkeypatch.setattr("cluster.decode.tail.propose", accept_all)
    biased = run(_second_and_third_tokens(model_dir, tokenizer, mtp=True, seed0=2 * 10**6))
    assert _homogeneity_pvalue(plain[0], biased[0]) < 1e-3
