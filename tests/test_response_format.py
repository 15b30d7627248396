"""response_format over HTTP with the real engine: the reply is JSON that fits the schema,
streamed or whole; MTP drafts that break the grammar are rejected (the output equals the one
without MTP); schemas and combinations the server cannot serve are 400s."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from coordinator.response_format import JsonGrammars
from tests.fakes import EOS, MODEL_ID, ServedApp, tokenizer
from tests.local_api import RecordingEngine, serve_local_engine

HELLO = [{"role": "user", "content": "Show me the source of json"}]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "size": {"enum": [1, 2, 3]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
    },
    "required": ["name", "size", "tags"],
    "additionalProperties": False,
}
AS_SCHEMA = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}
Served = tuple[ServedApp, RecordingEngine]


@pytest.fixture(scope="module")
def with_mtp() -> Iterator[Served]:
    with serve_local_engine(mtp=True) as served:
        yield served


@pytest.fixture(scope="module")
def without_mtp() -> Iterator[Served]:
    with serve_local_engine(mtp=False) as served:
        yield served


def _client(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served[0].url}/v1", api_key="unused", max_retries=0)


def _ask(served: Served, response_format: dict[str, Any], **kwargs: Any) -> Any:
    kwargs = {"max_tokens": 120, "temperature": 0, **kwargs}
    return _client(served).chat.completions.create(
        model=MODEL_ID, messages=HELLO, response_format=response_format, **kwargs
    )


def _fits(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and set(value) == {"name", "size", "tags"}
        and isinstance(value["name"], str)
        and len(value["name"]) <= 12
        and value["size"] in (1, 2, 3)
        and isinstance(value["tags"], list)
        and len(value["tags"]) <= 3
        and all(isinstance(t, str) and len(t) <= 6 for t in value["tags"])
    )


def test_json_schema_with_and_without_mtp(with_mtp: Served, without_mtp: Served) -> None:
    """Greedy: the same JSON either way, though the MTP head drafted tokens the grammar
    refuses (it was trained on Python source), which the tail rejected."""
    # A fixed depth: `auto`, the server's default, may not draft at all on a busy machine.
    replies = [_ask(with_mtp, AS_SCHEMA, extra_body={"mtp_depth": 1}), _ask(without_mtp, AS_SCHEMA)]
    contents = [reply.choices[0].message.content for reply in replies]
    assert contents[0] == contents[1]
    assert _fits(json.loads(contents[0]))
    assert [reply.choices[0].finish_reason for reply in replies] == ["stop", "stop"]
    engine = with_mtp[1]
    assert engine.drafted > 0 and engine.request.constraint.refused_drafts > 0


def test_streamed_json_is_the_whole_one(with_mtp: Served) -> None:
    whole = _ask(with_mtp, AS_SCHEMA).choices[0].message.content
    pieces = [
        chunk.choices[0].delta.content or ""
        for chunk in _client(with_mtp).chat.completions.create(
            model=MODEL_ID, messages=HELLO, response_format=AS_SCHEMA, temperature=0, stream=True
        )
        if chunk.choices
    ]
    assert "".join(pieces) == whole


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_json_object_sampled(with_mtp: Served, seed: int) -> None:
    reply = _ask(with_mtp, {"type": "json_object"}, temperature=0.8, seed=seed, max_tokens=200)
    if reply.choices[0].finish_reason == "stop":  # cut by max_tokens, it cannot be whole
        assert isinstance(json.loads(reply.choices[0].message.content), dict)
    else:
        assert reply.choices[0].message.content.startswith("{")


def test_refusals(with_mtp: Served) -> None:
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}
    with pytest.raises(openai.BadRequestError, match="schema"):
        _ask(with_mtp, bad_schema)
    thinking = {"chat_template_kwargs": {"enable_thinking": True}}
    with pytest.raises(openai.BadRequestError, match="thinking"):
        _ask(with_mtp, {"type": "json_object"}, extra_body=thinking)


def test_masks_follow_the_grammar_and_the_drafts() -> None:
    constraint = JsonGrammars(tokenizer(), [EOS]).constraint({"type": "object"})
    good = tuple(tokenizer().encode('{"a'))
    bad = tuple(tokenizer().encode("x"))
    masks = constraint.masks(good[:1] + bad + good[1:])
    assert len(masks) == 2 + len(good)
    assert all(mask == masks[2] for mask in masks[2:]) and set(masks[2]) == {0xFF}
    assert constraint.refused_drafts == 1
    constraint.advance(good)
    constraint.advance(tuple(tokenizer().encode('":1}')))
    (final,) = constraint.masks(())
    allowed = [t for t in range(len(tokenizer())) if final[t // 8] >> (t % 8) & 1]
    assert allowed == [EOS]  # the object is whole: only the end of the turn
