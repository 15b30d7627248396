"""Tool calls through the official `openai` client, against an engine that emits fixed text
(the bundled model never calls tools): both Qwen forms, streaming and not, malformed calls,
`tool_choice`, and `tool` results in the history."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import openai
import pytest

from cluster.decode.engine import GenerationRequest
from coordinator.tool_calls import ToolCallParser
from tests.fakes import EOS, MODEL_ID, FakeEngine, Served, serve, tokenizer, wait_until

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
TOOLS = [WEATHER, TIME]
HELLO = [{"role": "user", "content": "Weather in Paris and the time?"}]

XML_CALL = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
)
JSON_CALL = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
EXPECTED_CALLS = [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"zone": "CET"})]


@dataclass(slots=True)
class Script:
    """The text the engine says next; each test sets its own."""

    text: str = ""

    def reply(self, request: GenerationRequest) -> tuple[int, ...]:
        return (*tokenizer().encode(self.text), EOS)


@pytest.fixture(scope="module")
def script() -> Script:
    return Script()


@pytest.fixture(scope="module")
def served(script: Script) -> Iterator[Served]:
    with serve(FakeEngine(reply=script.reply, chunk_size=2)) as served:
        yield served


@pytest.fixture(scope="module")
def client(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)


def _calls(message: Any) -> list[tuple[str, dict[str, Any]]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def _ask(client: openai.OpenAI, stream: bool, **kwargs: Any) -> tuple[Any, str]:
    """(the assistant's message, finish_reason), whole or assembled by the client's stream."""
    kwargs = {"model": MODEL_ID, "messages": HELLO, "tools": TOOLS, **kwargs}
    if not stream:
        reply = client.chat.completions.create(**kwargs)
        return reply.choices[0].message, reply.choices[0].finish_reason
    with client.chat.completions.stream(**kwargs) as events:
        reply = events.get_final_completion()
    return reply.choices[0].message, reply.choices[0].finish_reason


@pytest.mark.parametrize("stream", [False, True])
def test_both_forms_with_text_before(client: openai.OpenAI, script: Script, stream: bool) -> None:
    script.text = f"Let me check.\n{XML_CALL}\n{JSON_CALL}\n"
    message, finish = _ask(client, stream)
    assert finish == "tool_calls"
    assert message.content == "Let me check."
    assert _calls(message) == EXPECTED_CALLS  # "days" is an integer by the tool's schema
    ids = [call.id for call in message.tool_calls]
    assert len(set(ids)) == 2 and all(i.startswith("call_") for i in ids)


@pytest.mark.parametrize("stream", [False, True])
def test_calls_alone_have_no_content(client: openai.OpenAI, script: Script, stream: bool) -> None:
    script.text = f"{JSON_CALL}\n"
    message, finish = _ask(client, stream)
    assert (finish, _calls(message)) == ("tool_calls", EXPECTED_CALLS[1:])
    assert not message.content


def test_streamed_deltas_as_openai_sends_them(client: openai.OpenAI, script: Script) -> None:
    """A call opens with index, id, type and name; its arguments come under the same index."""
    script.text = XML_CALL
    deltas = []
    for chunk in client.chat.completions.create(
        model=MODEL_ID, messages=HELLO, tools=TOOLS, stream=True
    ):
        for call in chunk.choices[0].delta.tool_calls or []:
            deltas.append(call)
    opening, arguments = deltas
    assert (opening.index, opening.type, opening.function.name) == (0, "function", "get_weather")
    assert opening.id and opening.function.arguments == ""
    assert arguments.index == 0 and arguments.id is None
    assert json.loads(arguments.function.arguments) == {"city": "Paris", "days": 3}


MALFORMED = [
    '<tool_call>\n{"name": "get_time", "arguments": {"zone": }\n</tool_call>',  # bad JSON
    "<tool_call>\n<function=get_weather>\n<parameter=days>\nmany\n</parameter>\n</tool_call>",
    '<tool_call>\n["get_time"]\n</tool_call>',  # JSON, but not a call
    '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}',  # never closed
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("malformed", MALFORMED)
def test_malformed_calls_stay_content(
    client: openai.OpenAI, script: Script, malformed: str, stream: bool
) -> None:
    script.text = f"Trying: {malformed}"
    message, finish = _ask(client, stream)
    assert (message.content, message.tool_calls, finish) == (script.text, None, "stop")


@pytest.mark.parametrize("stream", [False, True])
def test_a_good_call_after_a_malformed_one(
    client: openai.OpenAI, script: Script, stream: bool
) -> None:
    script.text = f"{MALFORMED[0]}\n{JSON_CALL}"
    message, finish = _ask(client, stream)
    assert message.content == MALFORMED[0]
    assert (finish, _calls(message)) == ("tool_calls", EXPECTED_CALLS[1:])


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_none(
    client: openai.OpenAI, served: Served, script: Script, stream: bool
) -> None:
    """The model is not told of the tools, and what it writes stays text."""
    script.text = XML_CALL
    message, finish = _ask(client, stream, tool_choice="none")
    assert (message.content, message.tool_calls, finish) == (XML_CALL, None, "stop")
    assert "<tools>" not in tokenizer().decode(list(served.engine.requests[-1].prompt))


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_tool_choice_begins_the_call(
    client: openai.OpenAI, served: Served, script: Script, stream: bool
) -> None:
    script.text = XML_CALL.split("<function=get_weather>\n", 1)[1]  # the prompt wrote the rest
    choice = {"type": "function", "function": {"name": "get_weather"}}
    message, finish = _ask(client, stream, tool_choice=choice)
    assert (finish, _calls(message)) == ("tool_calls", EXPECTED_CALLS[:1])
    prompt = tokenizer().decode(list(served.engine.requests[-1].prompt))
    assert prompt.endswith("<|im_start|>assistant\n<tool_call>\n<function=get_weather>\n")
    tools_block = prompt.split("<tools>", 1)[1].split("</tools>", 1)[0]
    assert "get_weather" in tools_block and "get_time" not in tools_block  # only the one named


def test_tool_choice_required(client: openai.OpenAI, served: Served, script: Script) -> None:
    script.text = JSON_CALL.removeprefix("<tool_call>\n")
    message, finish = _ask(client, False, tool_choice="required")
    assert (finish, _calls(message)) == ("tool_calls", EXPECTED_CALLS[1:])
    assert (
        tokenizer()
        .decode(list(served.engine.requests[-1].prompt))
        .endswith("<|im_start|>assistant\n<tool_call>\n")
    )


@pytest.mark.parametrize("stream", [False, True])
def test_one_call_when_parallel_calls_are_off(
    client: openai.OpenAI, served: Served, script: Script, stream: bool
) -> None:
    """The reply ends with its first call, and the generation is stopped there."""
    script.text = f"{XML_CALL}\n{JSON_CALL}\nand more text " + "x" * 200
    message, finish = _ask(client, stream, parallel_tool_calls=False)
    assert (finish, _calls(message)) == ("tool_calls", EXPECTED_CALLS[:1])
    assert not message.content
    request_id = served.engine.requests[-1].request_id
    wait_until(lambda: request_id in served.engine.closed_early, what="the generation stopped")


def test_a_call_cut_by_max_tokens_is_text(client: openai.OpenAI, script: Script) -> None:
    script.text = XML_CALL
    message, finish = _ask(client, False, max_tokens=6)
    assert finish == "length" and message.tool_calls is None
    assert XML_CALL.startswith(message.content) and message.content


def test_tool_results_in_the_history(client: openai.OpenAI, served: Served, script: Script) -> None:
    """A second turn: the assistant's calls and the `tool` answers reach the template."""
    script.text = XML_CALL
    first, _ = _ask(client, False)
    call = first.tool_calls[0]
    history = [
        *HELLO,
        first.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    script.text = "It is sunny in Paris."
    message, finish = _ask(client, False, messages=history)
    assert (message.content, finish) == ("It is sunny in Paris.", "stop")
    prompt = tokenizer().decode(list(served.engine.requests[-1].prompt))
    assert "<|im_start|>assistant\n<tool_call>\n<function=get_weather>\n" in prompt
    assert "<parameter=days>\n3\n</parameter>" in prompt
    assert "<|im_start|>user\n<tool_response>\nsunny, 21 C\n</tool_response><|im_end|>" in prompt


def test_reasoning_then_a_call(client: openai.OpenAI, script: Script) -> None:
    script.text = f"<think>\nI need the weather.\n</think>\n\n{XML_CALL}"
    message, finish = _ask(client, True)
    assert message.reasoning_content == "\nI need the weather.\n"  # type: ignore[attr-defined]
    assert (finish, _calls(message)) == ("tool_calls", EXPECTED_CALLS[:1])
    assert not message.content  # "" streamed: the opening delta cannot know calls will come


def test_parser_at_every_split_point() -> None:
    text = f"a<b {XML_CALL} c <tool_call {JSON_CALL}"
    expected = None
    for cut in range(len(text) + 1):
        parser = ToolCallParser(TOOLS)
        parts = parser.feed(text[:cut]) + parser.feed(text[cut:]) + parser.flush()
        shape = [
            part if isinstance(part, str) else (part.name, json.loads(part.arguments))
            for part in parts
        ]
        merged: list[Any] = []
        for part in shape:  # text may come in more pieces; join neighbours to compare
            if isinstance(part, str) and merged and isinstance(merged[-1], str):
                merged[-1] += part
            else:
                merged.append(part)
        expected = expected or merged
        assert merged == expected, cut
    assert expected == ["a<b ", EXPECTED_CALLS[0], " c <tool_call ", EXPECTED_CALLS[1]]
