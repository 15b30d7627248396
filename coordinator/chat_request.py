"""A `/v1/chat/completions` body as this server reads it.

Beyond what both endpoints share (`openai_schema.common_params`): the messages, with the
assistant's earlier tool calls and reasoning and the `tool` results that answer them; the
tools and `tool_choice`; `chat_template_kwargs` for the chat template; logprobs;
`response_format` (the JSON schema the reply must fit). Every field is either honoured or
refused with a 400 that names it, never silently dropped (strict function schemas, say).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

from coordinator.openai_schema import (
    COMMON_FIELDS,
    MAX_TOP_LOGPROBS,
    CommonParams,
    check_fields,
    common_params,
    invalid,
    json_object,
    optional,
    unsupported,
)
from coordinator.tool_calls import ToolCall

CHAT_FIELDS = COMMON_FIELDS | {
    "messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools", "tool_choice",
    "parallel_tool_calls", "chat_template_kwargs", "response_format",
}  # fmt: skip
# The fields each role's message may carry (`name` is passed on to the template).
MESSAGE_FIELDS = {
    "system": frozenset({"role", "content", "name"}),
    "developer": frozenset({"role", "content", "name"}),
    "user": frozenset({"role", "content", "name"}),
    "assistant": frozenset({"role", "content", "name", "tool_calls", "reasoning_content"}),
    "tool": frozenset({"role", "content", "tool_call_id"}),
}
CHAT_ROLES = frozenset(MESSAGE_FIELDS)
# What the template is called with already; a kwarg of that name would overwrite it.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {"messages", "tools", "add_generation_prompt", "tokenize", "conversation", "documents"}
)


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str
    content: str | None  # None only for an assistant turn that is all tool calls
    name: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None  # a `tool` message: the call it answers
    reasoning_content: str | None = None


@dataclass(frozen=True, slots=True)
class ToolChoice:
    mode: str = "auto"  # "auto" | "none" | "required" | "function"
    function: str | None = None  # the name, when mode is "function"


@dataclass(frozen=True, slots=True)
class ChatRequest:
    messages: tuple[ChatMessage, ...]
    params: CommonParams
    tools: tuple[dict[str, Any], ...] = ()  # as sent: {"type": "function", "function": {...}}
    tool_choice: ToolChoice = field(default_factory=ToolChoice)
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    json_schema: dict[str, Any] | None = None  # response_format: the reply must fit it
    parallel_tool_calls: bool = True  # False: the reply ends after its first call

    @property
    def offered_tools(self) -> tuple[dict[str, Any], ...]:
        """The tools the model is told about: none for "none", only the one that is named."""
        choice = self.tool_choice
        if choice.mode == "none":
            return ()
        if choice.mode == "function":
            return tuple(t for t in self.tools if t["function"]["name"] == choice.function)
        return self.tools


def parse_chat_request(raw: bytes, *, model_id: str, max_context: int) -> ChatRequest:
    """Parse a `/v1/chat/completions` body; raise `ApiError` for anything we would misread."""
    body = json_object(raw)
    check_fields(body, CHAT_FIELDS)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("'messages' must be a non-empty array", "messages")
    parsed = tuple(_message(m, f"messages[{i}]") for i, m in enumerate(messages))
    params = common_params(body, model_id=model_id, max_context=max_context)
    params = replace(params, top_logprobs=_logprobs(body))
    json_schema = _response_format(body.get("response_format"))
    tools = _tools(body.get("tools"))
    choice = _tool_choice(body.get("tool_choice"), tools)
    if json_schema is not None and choice.mode != "none":
        raise unsupported(
            "'response_format' and tools cannot be combined: the reply is either JSON or calls",
            "response_format",
        )
    parallel = optional(body, "parallel_tool_calls", bool, True)
    return ChatRequest(parsed, params, tools, choice, _template_kwargs(body), json_schema, parallel)


def _message(message: object, where: str) -> ChatMessage:
    if not isinstance(message, dict):
        raise invalid(f"'{where}' must be an object", where)
    role = message.get("role")
    if not isinstance(role, str) or role not in CHAT_ROLES:  # a list role is unhashable
        raise invalid(f"'{where}.role' must be one of {sorted(CHAT_ROLES)}", f"{where}.role")
    for name in message:
        if name not in MESSAGE_FIELDS[role]:
            raise invalid(f"'{where}.{name}' is not supported in a {role} message", where)
    tool_calls = _history_calls(message.get("tool_calls"), f"{where}.tool_calls")
    content = message.get("content")
    text = None if content is None and tool_calls else _content(content, f"{where}.content")
    tool_call_id = message.get("tool_call_id")
    if role == "tool" and not (isinstance(tool_call_id, str) and tool_call_id):
        raise invalid(f"'{where}.tool_call_id' must be a non-empty string", where)
    return ChatMessage(
        role,
        text,
        name=_optional_string(message, "name", where),
        tool_calls=tool_calls,
        tool_call_id=tool_call_id,
        reasoning_content=_optional_string(message, "reasoning_content", where),
    )


def _content(content: object, where: str) -> str:
    """A string, or an array of text parts (what newer clients send), joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"):
                raise invalid(f"'{where}' may only hold text parts", where)
            if not isinstance(part.get("text"), str) or set(part) != {"type", "text"}:
                raise invalid(f"'{where}' text parts need a string 'text' and nothing else", where)
            texts.append(part["text"])
        return "".join(texts)
    raise invalid(f"'{where}' must be a string or an array of text parts", where)


def _optional_string(message: dict[str, Any], name: str, where: str) -> str | None:
    value = message.get(name)
    if value is not None and not isinstance(value, str):
        raise invalid(f"'{where}.{name}' must be a string", where)
    return value


def _history_calls(calls: object, where: str) -> tuple[ToolCall, ...]:
    """An assistant turn's earlier calls; their arguments must be a JSON object's text."""
    if calls is None:
        return ()
    if not isinstance(calls, list):
        raise invalid(f"'{where}' must be an array", where)
    out = []
    for i, call in enumerate(calls):
        here = f"{where}[{i}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not (
            isinstance(call, dict)
            and call.get("type", "function") == "function"
            and isinstance(call.get("id"), str)
            and isinstance(function, dict)
            and isinstance(function.get("name"), str)
            and isinstance(function.get("arguments"), str)
        ):
            raise invalid(
                f"'{here}' must be {{id, type: function, function: {{name, arguments}}}}", here
            )
        try:
            arguments = json.loads(function["arguments"])
        except ValueError as exc:
            raise invalid(f"'{here}.function.arguments' is not valid JSON: {exc}", here) from exc
        if not isinstance(arguments, dict):
            raise invalid(f"'{here}.function.arguments' must be a JSON object", here)
        out.append(ToolCall(call["id"], function["name"], function["arguments"]))
    return tuple(out)


def _tools(tools: object) -> tuple[dict[str, Any], ...]:
    if tools is None:
        return ()
    if not isinstance(tools, list):
        raise invalid("'tools' must be an array", "tools")
    names = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        function = tool.get("function") if isinstance(tool, dict) else None
        if not (
            isinstance(tool, dict)
            and tool.get("type") == "function"
            and isinstance(function, dict)
            and isinstance(function.get("name"), str)
            and function["name"]
        ):
            raise invalid(f"'{where}' must be {{type: function, function: {{name, ...}}}}", where)
        if not isinstance(function.get("parameters", {}), dict):
            raise invalid(f"'{where}.function.parameters' must be a JSON schema object", where)
        if function.get("strict"):
            raise unsupported(
                f"'{where}.function.strict' needs constrained decoding, which this server "
                "does not do",
                where,
            )
        if function["name"] in names:
            raise invalid(f"'{where}': two tools are named {function['name']!r}", where)
        names.add(function["name"])
    return tuple(tools)


def _tool_choice(choice: object, tools: tuple[dict[str, Any], ...]) -> ToolChoice:
    if choice is None:
        return ToolChoice("auto" if tools else "none")
    if choice in ("auto", "none", "required"):
        if choice == "required" and not tools:
            raise invalid("'tool_choice' is 'required' but no tools are given", "tool_choice")
        return ToolChoice(str(choice))
    function = choice.get("function") if isinstance(choice, dict) else None
    if not (
        isinstance(choice, dict)
        and choice.get("type") == "function"
        and isinstance(function, dict)
        and isinstance(function.get("name"), str)
    ):
        raise invalid(
            "'tool_choice' must be 'auto', 'none', 'required' or "
            "{type: function, function: {name}}",
            "tool_choice",
        )
    if function["name"] not in {t["function"]["name"] for t in tools}:
        raise invalid(
            f"'tool_choice' names {function['name']!r}, which is not a tool", "tool_choice"
        )
    return ToolChoice("function", function["name"])


def _template_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    kwargs = optional(body, "chat_template_kwargs", dict, {})
    for name in kwargs:
        if name in RESERVED_TEMPLATE_KWARGS:
            raise invalid(
                f"'chat_template_kwargs.{name}' would replace what the server passes",
                "chat_template_kwargs",
            )
    return dict(kwargs)


def _logprobs(body: dict[str, Any]) -> int | None:
    """None without logprobs; else how many alternatives each token comes with."""
    wanted = optional(body, "logprobs", bool, False)
    top = optional(body, "top_logprobs", int, None)
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise invalid(f"'top_logprobs' must be in [0, {MAX_TOP_LOGPROBS}]", "top_logprobs")
    if top and not wanted:
        raise invalid("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return (top or 0) if wanted else None


def _response_format(value: object) -> dict[str, Any] | None:
    """The JSON schema the reply must fit (any object for json_object); None for text."""
    kind = value.get("type") if isinstance(value, dict) else None
    if value is None or (kind == "text" and set(value) == {"type"}):  # type: ignore[arg-type]
        return None
    if kind == "json_object" and set(value) == {"type"}:  # type: ignore[arg-type]
        return {"type": "object"}
    spec = value.get("json_schema") if isinstance(value, dict) else None
    if kind == "json_schema" and isinstance(spec, dict) and set(value) == {"type", "json_schema"}:
        unknown = set(spec) - {"name", "description", "schema", "strict"}
        if unknown or not isinstance(spec.get("name"), str):
            raise invalid(
                "'response_format.json_schema' takes a string 'name', and 'description', "
                "'schema' and 'strict'",
                "response_format",
            )
        schema = spec.get("schema", {})
        if not isinstance(schema, dict):
            raise invalid(
                "'response_format.json_schema.schema' must be an object", "response_format"
            )
        return schema  # strict or not, the reply is held to the schema
    raise invalid(
        "'response_format' must be {type: text}, {type: json_object} or "
        "{type: json_schema, json_schema: {name, schema}}",
        "response_format",
    )
