"""coordinator.openai_schema and coordinator.chat_request: what request bodies are accepted,
how refusals read, and the shape of the response objects OpenAI clients parse."""

from __future__ import annotations

import json
from typing import Any

import pytest

from cluster.messages import SamplingParams
from coordinator.chat_request import ToolChoice, parse_chat_request
from coordinator.openai_schema import (
    ApiError,
    ResponseIdentity,
    Usage,
    chat_chunk,
    chat_completion,
    parse_completion_request,
    text_completion,
)

MODEL = "tiny"
CONTEXT = 1024
HELLO = [{"role": "user", "content": "hello"}]


def _chat(**fields: Any) -> bytes:
    return json.dumps({"model": MODEL, "messages": HELLO, **fields}).encode()


def _completion(**fields: Any) -> bytes:
    return json.dumps({"model": MODEL, "prompt": "def f():", **fields}).encode()


def _refusal(parse: Any, raw: bytes) -> ApiError:
    with pytest.raises(ApiError) as caught:
        parse(raw, model_id=MODEL, max_context=CONTEXT)
    return caught.value


# (body, status, param, code)
BAD_CHAT = [
    (b"{not json", 400, None, None),
    (b"", 400, None, None),
    (b'[{"role": "user"}]', 400, None, None),
    (b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', 400, None, None),
    (json.dumps({"model": MODEL}).encode(), 400, "messages", None),
    (_chat(messages=[]), 400, "messages", None),
    (_chat(messages="hello"), 400, "messages", None),
    (_chat(messages=["hello"]), 400, "messages[0]", None),
    (_chat(messages=[{"role": "wizard", "content": "x"}]), 400, "messages[0].role", None),
    (_chat(messages=[{"role": "user"}]), 400, "messages[0].content", None),
    (_chat(messages=[{"role": "user", "content": 7}]), 400, "messages[0].content", None),
    (
        _chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
        400,
        "messages[0].content",
        None,
    ),
    (_chat(model="gpt-4o"), 404, "model", "model_not_found"),
    (_chat(model=3), 400, "model", None),
    (_chat(max_tokens=0), 400, "max_tokens", None),
    (_chat(max_tokens=-5), 400, "max_tokens", None),
    (_chat(max_tokens=2.5), 400, "max_tokens", None),
    (_chat(max_tokens="10"), 400, "max_tokens", None),
    (_chat(max_tokens=True), 400, "max_tokens", None),
    (_chat(max_tokens=10**9), 400, "max_tokens", "context_length_exceeded"),
    (_chat(max_completion_tokens=-1), 400, "max_completion_tokens", None),
    (_chat(temperature=-0.1), 400, "temperature", None),
    (_chat(temperature=2.5), 400, "temperature", None),
    (_chat(temperature="hot"), 400, "temperature", None),
    (_chat(top_p=0), 400, "top_p", None),
    (_chat(top_p=1.5), 400, "top_p", None),
    (_chat(top_k=-2), 400, "top_k", None),
    (_chat(top_k=1.5), 400, "top_k", None),
    (_chat(min_p=1.0), 400, "min_p", None),
    (_chat(seed="x"), 400, "seed", None),
    (_chat(seed=2**70), 400, "seed", None),
    (_chat(seed=-1), 400, "seed", None),
    (_chat(seed=2**63), 400, "seed", None),
    (_chat(stop=3), 400, "stop", None),
    (_chat(stop=["a", 3]), 400, "stop", None),
    (_chat(stop=["a", "b", "c", "d", "e"]), 400, "stop", None),
    (_chat(stop=""), 400, "stop", None),
    (_chat(n=2), 400, "n", None),
    (_chat(stream="yes"), 400, "stream", None),
    (_chat(stream_options={"include_usage": "yes"}), 400, "stream_options", None),
    (_chat(stream_options={"continuous_usage_stats": True}), 400, "stream_options", None),
    (_chat(logprobs="yes"), 400, "logprobs", None),
    (_chat(logprobs=True, top_logprobs=21), 400, "top_logprobs", None),
    (_chat(top_logprobs=2), 400, "top_logprobs", None),  # without logprobs: true
    # Nothing is silently dropped: unknown fields, and known ones we cannot honour.
    (_chat(frobnicate=1), 400, "frobnicate", "unknown_parameter"),
    (_chat(functions=[]), 400, "functions", "unknown_parameter"),
    (_chat(presence_penalty=0.5), 400, "presence_penalty", "unsupported_parameter"),
    (_chat(frequency_penalty=-1), 400, "frequency_penalty", "unsupported_parameter"),
    (_chat(logit_bias={"5": 3}), 400, "logit_bias", "unsupported_parameter"),
    (
        _chat(
            response_format={"type": "json_object"},
            tools=[{"type": "function", "function": {"name": "f"}}],
        ),
        400,
        "response_format",
        "unsupported_parameter",
    ),
    (
        _chat(response_format={"type": "json_schema", "json_schema": {}}),
        400,
        "response_format",
        None,
    ),
    (
        _chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}),
        400,
        "response_format",
        None,
    ),
    (_chat(response_format={"type": "json_object", "x": 1}), 400, "response_format", None),
    (_chat(response_format={"type": "yaml"}), 400, "response_format", None),
    (_chat(parallel_tool_calls="no"), 400, "parallel_tool_calls", None),
    (_chat(messages=[{"role": "user", "content": "x", "audio": {}}]), 400, "messages[0]", None),
    (_chat(messages=[{"role": "tool", "content": "x"}]), 400, "messages[0]", None),
    (
        _chat(messages=[{"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]}]),
        400,
        "messages[0].tool_calls[0]",
        None,
    ),
    (_chat(tools=[{"type": "function"}]), 400, "tools[0]", None),
    (
        _chat(tools=[{"type": "function", "function": {"name": "f", "strict": True}}]),
        400,
        "tools[0]",
        "unsupported_parameter",
    ),
    (_chat(tool_choice="required"), 400, "tool_choice", None),
    (
        _chat(
            tools=[{"type": "function", "function": {"name": "f"}}],
            tool_choice={"type": "function", "function": {"name": "g"}},
        ),
        400,
        "tool_choice",
        None,
    ),
    (_chat(chat_template_kwargs={"messages": []}), 400, "chat_template_kwargs", None),
    (_chat(chat_template_kwargs=[1]), 400, "chat_template_kwargs", None),
]

BAD_COMPLETION = [
    (_completion(prompt=""), 400, "prompt", None),
    (_completion(prompt=None), 400, "prompt", None),
    (_completion(prompt=5), 400, "prompt", None),
    (_completion(prompt=["a", "b"]), 400, "prompt", None),
    (_completion(prompt=[1, -2]), 400, "prompt", None),
    (_completion(logprobs=21), 400, "logprobs", None),
    (_completion(logprobs=True), 400, "logprobs", None),
    (_completion(best_of=2), 400, "best_of", None),
    (_completion(max_completion_tokens=5), 400, "max_completion_tokens", "unknown_parameter"),
    (_completion(echo=True), 400, "echo", "unsupported_parameter"),
    (_completion(max_tokens=0), 400, "max_tokens", None),
    (_completion(temperature=-1), 400, "temperature", None),
    (_completion(model="other"), 404, "model", "model_not_found"),
]


@pytest.mark.parametrize(("raw", "status", "param", "code"), BAD_CHAT)
def test_bad_chat_bodies_are_refused(raw: bytes, status: int, param: str | None, code: str | None):
    error = _refusal(parse_chat_request, raw)
    assert (error.status, error.param, error.code) == (status, param, code)
    body = error.body()["error"]
    assert set(body) == {"message", "type", "param", "code"}
    assert body["type"] == "invalid_request_error" and body["message"]


@pytest.mark.parametrize(("raw", "status", "param", "code"), BAD_COMPLETION)
def test_bad_completion_bodies_are_refused(raw: bytes, status: int, param: str, code: str | None):
    error = _refusal(parse_completion_request, raw)
    assert (error.status, error.param, error.code) == (status, param, code)


def test_chat_request_is_parsed_fully():
    raw = _chat(
        messages=[
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": t} for t in ("hi ", "there")]},
        ],
        max_tokens=99,
        temperature=0.7,
        top_p=0.9,
        top_k=20,
        min_p=0.05,
        seed=7,
        stop="\n\n",
        stream=True,
        stream_options={"include_usage": True},
        n=1,
        logprobs=False,
        presence_penalty=0,  # its no-op value: accepted
        user="someone",
        tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
        tool_choice={"type": "function", "function": {"name": "f"}},
        chat_template_kwargs={"enable_thinking": True},
        response_format={"type": "text"},
    )
    chat = parse_chat_request(raw, model_id=MODEL, max_context=CONTEXT)
    assert [(m.role, m.content) for m in chat.messages] == [
        ("system", "be brief"),
        ("user", "hi there"),
    ]
    assert chat.tool_choice == ToolChoice("function", "f") and len(chat.offered_tools) == 1
    assert chat.template_kwargs == {"enable_thinking": True}
    params = chat.params
    assert params.top_logprobs is None
    assert params.sampling == SamplingParams(0.7, 0.9, 20, 0.05, 7)
    assert (params.max_tokens, params.stop, params.stream, params.include_usage) == (
        99,
        ("\n\n",),
        True,
        True,
    )


def test_defaults_follow_openai():
    """Temperature 1 when omitted (OpenAI's default), no limit but the context, no stops."""
    params = parse_chat_request(
        json.dumps({"messages": HELLO}).encode(), model_id=MODEL, max_context=CONTEXT
    ).params
    assert params.model == MODEL  # one model served: omitting it is unambiguous
    assert params.sampling == SamplingParams(temperature=1.0)
    assert (params.max_tokens, params.stop, params.stream) == (None, (), False)


def test_greedy_and_the_newer_max_tokens_name():
    params = parse_chat_request(
        _chat(temperature=0, max_tokens=5, max_completion_tokens=9, top_k=-1),
        model_id=MODEL,
        max_context=CONTEXT,
    ).params
    assert params.sampling.greedy and params.sampling.top_k == 0
    assert params.max_tokens == 9


def test_completion_prompts():
    def prompt(value: Any) -> Any:
        raw = _completion(prompt=value)
        return parse_completion_request(raw, model_id=MODEL, max_context=CONTEXT).prompt

    assert prompt("abc") == "abc"
    assert prompt(["abc"]) == "abc"
    assert prompt([1, 2, 3]) == (1, 2, 3)
    assert prompt([[4, 5]]) == (4, 5)


def test_logprobs_requests():
    def chat(**fields: Any) -> int | None:
        return parse_chat_request(
            _chat(**fields), model_id=MODEL, max_context=CONTEXT
        ).params.top_logprobs

    def completion(**fields: Any) -> int | None:
        raw = _completion(**fields)
        return parse_completion_request(
            raw, model_id=MODEL, max_context=CONTEXT
        ).params.top_logprobs

    assert (chat(), chat(logprobs=False), chat(logprobs=True)) == (None, None, 0)
    assert chat(logprobs=True, top_logprobs=20) == 20
    assert (completion(), completion(logprobs=0), completion(logprobs=5)) == (None, 0, 5)


def test_stop_strings_are_deduplicated_in_order():
    stop = parse_chat_request(_chat(stop=["b", "a", "b"]), model_id=MODEL, max_context=CONTEXT)
    assert stop.params.stop == ("b", "a")


def test_response_objects():
    ident = ResponseIdentity.new("chatcmpl", MODEL)
    whole = chat_completion(ident, "hi", "stop", Usage(3, 2))
    assert whole["object"] == "chat.completion" and whole["id"].startswith("chatcmpl-")
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": "hi"}
    assert whole["choices"][0]["finish_reason"] == "stop"
    assert whole["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "total_tokens": 5,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    chunk = chat_chunk(ident, {"content": "h"})
    assert chunk["object"] == "chat.completion.chunk"
    assert (chunk["id"], chunk["created"], chunk["model"]) == (ident.id, ident.created, MODEL)
    text = text_completion(ResponseIdentity.new("cmpl", MODEL), "x", "length", Usage(1, 1))
    assert text["object"] == "text_completion" and text["choices"][0]["text"] == "x"
    assert text["usage"]["total_tokens"] == 2


def test_usage_reports_drafts_whenever_the_request_asked_for_mtp():
    """0 accepted and 0 rejected when MTP was asked for and nothing was drafted (a model
    without an MTP head), so that a client tells "no drafts" from "not asked"."""
    none_drafted = Usage(3, 5, mtp=True).body()
    assert none_drafted["completion_tokens_details"] == {
        "accepted_prediction_tokens": 0,
        "rejected_prediction_tokens": 0,
    }
    assert none_drafted["total_tokens"] == 8
    assert "completion_tokens_details" not in Usage(3, 5, mtp=False).body()  # not asked
    drafted = Usage(3, 5, drafted=4, accepted=3).body()["completion_tokens_details"]
    assert drafted == {"accepted_prediction_tokens": 3, "rejected_prediction_tokens": 1}
