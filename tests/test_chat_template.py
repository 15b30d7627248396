"""The bundled model's chat template (Qwen3.5's conventions: <tools>, <tool_call>, <think>) and
coordinator.chat_prompt, which renders a request through it."""

from __future__ import annotations

import json
from typing import Any

import pytest

from coordinator.chat_prompt import render_chat_prompt
from coordinator.chat_request import parse_chat_request
from coordinator.openai_schema import ApiError
from coordinator.tool_calls import CALL_CLOSE, CALL_OPEN, parse_call_body
from tests.fakes import MODEL_ID, tokenizer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        },
    },
}
ARGUMENTS = {"city": "Paris", "days": 3, "hours": [9, 12], "note": "line 1\nline 2"}


def _render(messages: list[dict[str, Any]], **kwargs: Any) -> str:
    return tokenizer().apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False, **kwargs
    )


def _request(**body: Any) -> Any:
    raw = json.dumps({"model": MODEL_ID, **body}).encode()
    return parse_chat_request(raw, model_id=MODEL_ID, max_context=4096)


def test_a_plain_chat_keeps_the_trained_format() -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert _render(messages) == (
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_tools_go_in_the_system_turn() -> None:
    text = _render(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        tools=[WEATHER],
    )
    assert text.startswith("<|im_start|>system\nbe brief\n\n# Tools\n")
    assert text.count("<|im_start|>system") == 1
    listed = text.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0]
    assert json.loads(listed) == WEATHER["function"]
    assert "<tool_call>\n<function=NAME>\n<parameter=PARAMETER>" in text  # the form taught


def test_history_calls_render_in_the_form_the_parser_reads() -> None:
    """A call the template writes into the history reads back as the same call."""
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather"}}
    call["function"]["arguments"] = ARGUMENTS
    text = _render(
        [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
            {"role": "tool", "tool_call_id": "c2", "content": "21 C"},
        ],
        tools=[WEATHER],
    )
    body = text.split(CALL_OPEN, 2)[2].split(CALL_CLOSE, 1)[0]  # the first is the taught form
    parsed = parse_call_body(body, [WEATHER])
    assert parsed is not None and parsed.name == "get_weather"
    assert json.loads(parsed.arguments)["days"] == 3  # typed by the schema
    assert json.loads(parsed.arguments)["note"] == ARGUMENTS["note"]
    assert (
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n"
        "<tool_response>\n21 C\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    ) in text


def test_reasoning_of_the_current_turn_only() -> None:
    messages = [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1", "reasoning_content": "old thoughts"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "", "reasoning_content": "\nnew thoughts\n"},
    ]
    text = _render(messages)
    assert "old thoughts" not in text
    assert "<|im_start|>assistant\n<think>\nnew thoughts\n</think>\n\n<|im_end|>" in text


def test_enable_thinking_opens_the_block() -> None:
    messages = [{"role": "user", "content": "hi"}]
    assert _render(messages, enable_thinking=True).endswith("<|im_start|>assistant\n<think>\n")
    assert _render(messages, enable_thinking=False).endswith("<|im_start|>assistant\n")


def test_chat_prompt_tokens_match_the_tokenizers_own() -> None:
    messages = [{"role": "user", "content": "Show me the source of add"}]
    prompt = render_chat_prompt(tokenizer(), _request(messages=messages))
    expected = tokenizer().apply_chat_template(messages, add_generation_prompt=True)
    assert list(prompt.tokens) == list(expected)
    assert (prompt.starts_in_reasoning, prompt.reply_prefix) == (False, "")


def test_chat_prompt_tool_choices_and_thinking() -> None:
    messages = [{"role": "user", "content": "weather?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    cases = {
        "none": ("none", ""),
        "auto": ("auto", ""),
        "required": ("required", "<tool_call>\n"),
        "named": (named, "<tool_call>\n<function=get_weather>\n"),
    }
    for name, (choice, prefix) in cases.items():
        prompt = render_chat_prompt(
            tokenizer(), _request(messages=messages, tools=[WEATHER], tool_choice=choice)
        )
        text = tokenizer().decode(list(prompt.tokens))
        assert prompt.reply_prefix == prefix, name
        assert text.endswith("<|im_start|>assistant\n" + prefix), name
        assert ("<tools>" in text) == (name != "none"), name
    thinking = render_chat_prompt(
        tokenizer(),
        _request(messages=messages, chat_template_kwargs={"enable_thinking": True}),
    )
    assert thinking.starts_in_reasoning
    forced = render_chat_prompt(
        tokenizer(),
        _request(
            messages=messages,
            tools=[WEATHER],
            tool_choice="required",
            chat_template_kwargs={"enable_thinking": True},
        ),
    )
    assert not forced.starts_in_reasoning  # a forced call closes the think block first
    assert tokenizer().decode(list(forced.tokens)).endswith("<think>\n\n</think>\n\n<tool_call>\n")


def test_a_model_without_a_chat_template_answers_400_naming_the_completions_endpoint() -> None:
    """A checkpoint whose tokenizer has no template cannot take chat messages: a clear 400,
    not an internal error."""

    class NoTemplate:
        chat_template = None

        def __getattr__(self, name: str) -> Any:
            return getattr(tokenizer(), name)

    request = _request(messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(ApiError) as caught:
        render_chat_prompt(NoTemplate(), request)
    assert caught.value.status == 400
    assert "/v1/completions" in str(caught.value)
