"""Logprobs over HTTP from the real engine: each emitted token's logprob and its likeliest
alternatives equal log_softmax of the single-process model's logits at that position, MTP on
or off, greedy or sampled; chat and completions shapes as the `openai` client reads them."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import mlx.core as mx
import openai
import pytest
from mlx_lm import load as mlx_lm_load

from cluster.config import bundled_model_path
from coordinator.logprobs import TokenText
from tests.fakes import MODEL_ID, ServedApp, tokenizer
from tests.local_api import RecordingEngine, serve_local_engine

PROMPT = [{"role": "user", "content": "Show me the source of fibonacci"}]
TOKENS = 12
TOP = 5
TOLERANCE = 0.02  # bf16 logits: a cached step and a whole-sequence forward round apart


@pytest.fixture(scope="module")
def with_mtp() -> Iterator[tuple[ServedApp, RecordingEngine]]:
    with serve_local_engine(mtp=True) as served:
        yield served


@pytest.fixture(scope="module")
def without_mtp() -> Iterator[tuple[ServedApp, RecordingEngine]]:
    with serve_local_engine(mtp=False) as served:
        yield served


@pytest.fixture(params=["with_mtp", "without_mtp"])
def served(request: pytest.FixtureRequest) -> tuple[ServedApp, RecordingEngine]:
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def reference_model() -> Any:
    model, _ = mlx_lm_load(str(bundled_model_path()))
    return model


def _client(served: ServedApp) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)


def _reference(model: Any, prompt: list[int], emitted: list[int]) -> mx.array:
    """log_softmax of the whole-sequence forward at the positions that emitted each token."""
    logits = model(mx.array([*prompt, *emitted[:-1]])[None])[0, len(prompt) - 1 :]
    logits = logits.astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def _prompt_ids() -> list[int]:
    return list(tokenizer().apply_chat_template(PROMPT, add_generation_prompt=True))


def _check_against_reference(entries: list[Any], emitted: list[int], model: Any) -> None:
    """`entries`: the chat logprobs content, one per emitted token."""
    text = TokenText(tokenizer())
    expected = _reference(model, _prompt_ids(), emitted)
    assert len(entries) == len(emitted) == TOKENS
    for position, (entry, token) in enumerate(zip(entries, emitted, strict=True)):
        row = expected[position]
        assert (entry.token, bytes(entry.bytes)) == text.of(token)
        assert entry.logprob == pytest.approx(row[token].item(), abs=TOLERANCE)
        assert len(entry.top_logprobs) == TOP
        values = [alt.logprob for alt in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        best = mx.argsort(-row)[:TOP].tolist()
        for alt, ref_token in zip(entry.top_logprobs, best, strict=True):
            assert alt.logprob == pytest.approx(row[ref_token].item(), abs=TOLERANCE)
        # the likeliest tokens are the reference's (up to near-ties, which bf16 may swap)
        margin = row[best[TOP - 1]].item() - row[mx.argsort(-row)[TOP]].item()
        if margin > 2 * TOLERANCE:
            assert {bytes(alt.bytes) for alt in entry.top_logprobs} == {text.of(t)[1] for t in best}


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_chat_logprobs_are_the_models_own(served, reference_model, temperature: float) -> None:
    """Sampled or greedy, the values are the model's plain distribution, not the sampler's."""
    app, engine = served
    reply = _client(app).chat.completions.create(
        model=MODEL_ID,
        messages=PROMPT,
        max_tokens=TOKENS,
        temperature=temperature,
        seed=11,
        logprobs=True,
        top_logprobs=TOP,
    )
    _check_against_reference(reply.choices[0].logprobs.content, engine.emitted, reference_model)


def test_streamed_logprobs_match_the_whole_reply(served, reference_model) -> None:
    app, engine = served
    client = _client(app)
    kwargs = dict(model=MODEL_ID, messages=PROMPT, max_tokens=TOKENS, temperature=0)
    whole = client.chat.completions.create(logprobs=True, top_logprobs=TOP, **kwargs)
    streamed = []
    for chunk in client.chat.completions.create(
        logprobs=True, top_logprobs=TOP, stream=True, **kwargs
    ):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.content
    _check_against_reference(streamed, engine.emitted, reference_model)
    assert [(e.token, e.logprob) for e in streamed] == [
        (e.token, e.logprob) for e in whole.choices[0].logprobs.content
    ]


def test_completion_logprobs_shape(served, reference_model) -> None:
    app, engine = served
    prompt = "def fibonacci(n):\n"
    reply = _client(app).completions.create(
        model=MODEL_ID, prompt=prompt, max_tokens=TOKENS, temperature=0, logprobs=3
    )
    logprobs = reply.choices[0].logprobs
    assert "".join(logprobs.tokens) == reply.choices[0].text
    assert logprobs.text_offset == [
        sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(logprobs.tokens))
    ]
    assert all(1 <= len(top) <= 3 for top in logprobs.top_logprobs)
    expected = _reference(reference_model, tokenizer().encode(prompt), engine.emitted)
    for i, (token, value) in enumerate(zip(engine.emitted, logprobs.token_logprobs, strict=True)):
        assert value == pytest.approx(expected[i, token].item(), abs=TOLERANCE)


def test_without_logprobs_there_are_none(served) -> None:
    app, _ = served
    reply = _client(app).chat.completions.create(model=MODEL_ID, messages=PROMPT, max_tokens=3)
    assert reply.choices[0].logprobs is None


def test_mtp_on_and_off_give_the_same_values(with_mtp, without_mtp) -> None:
    """Exactly: drafting changes how many positions a step verifies, not their numbers."""
    shown = []
    # A fixed depth: `auto`, the server's default, may not draft at all on a busy machine.
    for (app, engine), body in ((with_mtp, {"mtp_depth": 1}), (without_mtp, {})):
        reply = _client(app).chat.completions.create(
            model=MODEL_ID, messages=PROMPT, max_tokens=24, temperature=0, logprobs=True,
            top_logprobs=TOP, extra_body=body,
        )  # fmt: skip
        content = reply.choices[0].logprobs.content
        shown.append([(e.token, e.logprob, [(a.token, a.logprob) for a in e.top_logprobs])
                      for e in content])  # fmt: skip
        drafted = engine.drafted
    assert drafted == 0 and with_mtp[1].drafted > 0
    assert shown[0] == shown[1]
