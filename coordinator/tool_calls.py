"""Tool calls: the model's `<tool_call>...</tool_call>` blocks turned into OpenAI `tool_calls`.

Qwen models write a call in one of two forms inside the block: JSON (Qwen2.5, Qwen3)

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

or XML (Qwen3-Coder, Qwen3.5)

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

The body of a finished block is read by mlx-lm's own parsers for these forms (the XML one
converts parameter values by the tool's JSON schema). A block is passed on only once it is
closed and read; one that does not parse, or is left open when the reply ends, stays in the
content word for word, so a malformed call loses nothing.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mlx_lm.tool_parsers import json_tools, qwen3_coder

from coordinator.partial_text import split_at_partial_marker

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One function call, as OpenAI carries it: arguments are a JSON object's text."""

    id: str
    name: str
    arguments: str

    @classmethod
    def new(cls, name: str, arguments: dict[str, Any]) -> ToolCall:
        return cls(f"call_{uuid.uuid4().hex[:24]}", name, json.dumps(arguments, ensure_ascii=False))

    def body(self) -> dict[str, Any]:
        function = {"name": self.name, "arguments": self.arguments}
        return {"id": self.id, "type": "function", "function": function}


def parse_call_body(body: str, tools: Sequence[dict[str, Any]]) -> ToolCall | None:
    """The call in one block's body, in either form; None if it is not a well-formed call."""
    try:
        if "<function=" in body:
            call = qwen3_coder.parse_tool_call(body, list(tools))
        else:
            call = json_tools.parse_tool_call(body)
    except (ValueError, SyntaxError, TypeError):  # json.JSONDecodeError is a ValueError
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return None
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall.new(call["name"], arguments)


class ToolCallParser:
    """Feed the answer's text as it streams; get text and finished calls back, in order.

    Text is held back only while it may be the start of `<tool_call>`, and a block's text
    until the block closes.
    """

    def __init__(self, tools: Sequence[dict[str, Any]]) -> None:
        self._tools = tools
        self._held = ""
        self._in_call = False

    def feed(self, text: str) -> list[str | ToolCall]:
        out: list[str | ToolCall] = []
        buffer, self._held = self._held + text, ""
        while buffer:
            if self._in_call:
                end = buffer.find(CALL_CLOSE)
                if end < 0:
                    self._held = buffer
                    break
                out.append(self._read(buffer[:end]))
                buffer, self._in_call = buffer[end + len(CALL_CLOSE) :], False
            else:
                start = buffer.find(CALL_OPEN)
                if start < 0:
                    text, self._held = split_at_partial_marker(buffer, (CALL_OPEN,))
                    out.append(text)
                    break
                out.append(buffer[:start])
                buffer, self._in_call = buffer[start + len(CALL_OPEN) :], True
        return [piece for piece in out if piece]

    def flush(self) -> list[str | ToolCall]:
        """What is held back once the reply has ended: an unclosed block stays text."""
        held, self._held = self._held, ""
        if self._in_call:
            self._in_call = False
            return [CALL_OPEN + held]
        return [held] if held else []

    def _read(self, body: str) -> str | ToolCall:
        call = parse_call_body(body, self._tools)
        return call if call is not None else CALL_OPEN + body + CALL_CLOSE
