"""A chat request rendered into prompt tokens through the model's own chat template.

The template gets the messages as Hugging Face templates expect them (an assistant's calls with
their arguments as objects, `tool` results with the id of the call they answer), the tools the
model may call (its `tools` argument) and the request's `chat_template_kwargs`. A call the
request forces (`tool_choice` "required" or a named function) is begun in the prompt itself,
in the template's own call format, so the model can only go on with it.

The prompt also says where its messages end, in tokens (`ChatPrompt.boundaries`), so that the
conversation cache keeps snapshots there: the end of the leading system message (with the
tools, which templates put in that block), which every conversation with the same system
prompt and tools begins with; and the end of the last message, before the generation prompt,
which the next turn of this conversation begins with even where the template renders the
reply differently from how it was generated (reasoning left out of history, a re-tokenized
end), and which a repeat of this request begins with. Only these two: each snapshot holds a
whole GatedDeltaNet state on every node, so a snapshot per message would fill the nodes'
budget with points nobody returns to.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from jinja2 import TemplateError

from coordinator.chat_request import ChatMessage, ChatRequest
from coordinator.openai_schema import ApiError
from coordinator.reasoning import THINK_CLOSE, THINK_OPEN
from coordinator.tool_calls import CALL_OPEN

SYSTEM_ROLES = frozenset({"system", "developer"})


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    tokens: tuple[int, ...]
    starts_in_reasoning: bool  # the prompt opens a think block the reply goes on with
    reply_prefix: str = ""  # the start of the reply, written by the prompt (a forced call)
    # Token positions, ascending, where the system block and the last message end (where
    # they are a token prefix of `tokens`), for the conversation cache.
    boundaries: tuple[int, ...] = ()


def render_chat_prompt(tokenizer: Any, chat: ChatRequest) -> ChatPrompt:
    """The prompt's tokens; a template that refuses the conversation is a 400, and so is a
    chat for a model whose tokenizer has no template."""
    if not getattr(tokenizer, "chat_template", None):
        raise ApiError(
            400,
            "this model has no chat template (chat_template.jinja or tokenizer_config.json's "
            "chat_template), so it cannot take chat messages: send a prompt to /v1/completions",
        )
    tools = chat.offered_tools
    kwargs: dict[str, Any] = dict(chat.template_kwargs)
    if tools:
        kwargs["tools"] = list(tools)
    try:
        text = tokenizer.apply_chat_template(
            [_template_message(m) for m in chat.messages],
            add_generation_prompt=True,
            tokenize=False,
            **kwargs,
        )
    except TemplateError as exc:  # templates reject e.g. a conversation in a bad order
        raise ApiError(400, f"the chat template rejected the messages: {exc}") from exc
    starts_in_reasoning = _opens_think_block(text)
    prefix = _forced_call_start(chat, str(getattr(tokenizer, "chat_template", "") or ""))
    if prefix and starts_in_reasoning:  # a forced call comes right away, without thinking
        text += f"\n{THINK_CLOSE}\n\n"
        starts_in_reasoning = False
    ids = tuple(int(t) for t in tokenizer.encode(text + prefix, add_special_tokens=False))
    heads = [_leading_system(chat)] if chat.messages[0].role in SYSTEM_ROLES or tools else []
    boundaries = []
    for count in dict.fromkeys([*heads, len(chat.messages)]):
        position = _boundary(tokenizer, chat.messages[:count], kwargs, text + prefix, ids)
        if position is not None:
            boundaries.append(position)
    return ChatPrompt(ids, starts_in_reasoning, prefix, tuple(sorted(set(boundaries))))


def _leading_system(chat: ChatRequest) -> int:
    """How many messages the system block holds (the leading system messages)."""
    count = 0
    while count < len(chat.messages) and chat.messages[count].role in SYSTEM_ROLES:
        count += 1
    return count


def _boundary(
    tokenizer: Any,
    messages: tuple[ChatMessage, ...],
    kwargs: dict[str, Any],
    text: str,
    ids: tuple[int, ...],
) -> int | None:
    """Where `messages` end in the prompt's tokens: the length of their rendering (without a
    generation prompt) when that is both a text prefix of the prompt and a token prefix of
    `ids`; else None. The shorter side is tokenized again (a repeat of a long conversation
    pays for its generation prompt, not its history)."""
    try:
        head = tokenizer.apply_chat_template(
            [_template_message(m) for m in messages],
            add_generation_prompt=False,
            tokenize=False,
            **kwargs,
        )
    except Exception:  # a template may refuse a part of a conversation (no user turn yet)
        return None
    if not head or len(head) >= len(text) or not text.startswith(head):
        return None
    if len(head) <= len(text) // 2:
        head_ids = tuple(tokenizer.encode(head, add_special_tokens=False))
        end = len(head_ids)
        return end if 0 < end < len(ids) and ids[:end] == head_ids else None
    tail_ids = tuple(tokenizer.encode(text[len(head) :], add_special_tokens=False))
    end = len(ids) - len(tail_ids)
    return end if 0 < end < len(ids) and ids[end:] == tail_ids else None


def _template_message(message: ChatMessage) -> dict[str, Any]:
    role = "system" if message.role == "developer" else message.role  # its newer name
    out: dict[str, Any] = {"role": role, "content": message.content or ""}
    if message.name is not None:
        out["name"] = message.name
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.reasoning_content is not None:
        out["reasoning_content"] = message.reasoning_content
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": json.loads(call.arguments)},
            }
            for call in message.tool_calls
        ]
    return out


def _opens_think_block(text: str) -> bool:
    return text.rfind(THINK_OPEN) > text.rfind(THINK_CLOSE)


def _forced_call_start(chat: ChatRequest, template: str) -> str:
    """The opening of the call `tool_choice` requires, in the form the template teaches."""
    choice = chat.tool_choice
    if choice.mode == "required":
        return f"{CALL_OPEN}\n"
    if choice.mode != "function":
        return ""
    if "<function=" in template:  # the XML form of Qwen3-Coder and Qwen3.5
        return f"{CALL_OPEN}\n<function={choice.function}>\n"
    return f'{CALL_OPEN}\n{{"name": {json.dumps(choice.function)}, "arguments": '
