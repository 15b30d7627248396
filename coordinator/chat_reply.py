"""The assistant's reply as OpenAI shapes it: `reasoning_content`, `content` and `tool_calls`.

Text goes through the reasoning split first (`reasoning`), then, in the answer, through the
tool-call parser (`tool_calls`) when the request offered tools. Streamed, each part becomes a
delta as the `openai` client assembles them: a call opens with its index, id, type and name
(arguments ""), and its arguments follow in the next delta of the same index. Whole, the parts
make one message. With `single_call` (`parallel_tool_calls: false`) the reply is `complete`
after its first call, and the caller stops the generation there. Blank text right before a
call, or after the last one, is the calls' layout, not an answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from coordinator.chat_prompt import ChatPrompt
from coordinator.reasoning import ReasoningSplitter, ReplyPiece
from coordinator.tool_calls import ToolCall, ToolCallParser

Delta = dict[str, Any]


class ChatReply:
    def __init__(
        self, prompt: ChatPrompt, tools: Sequence[dict[str, Any]], *, single_call: bool = False
    ) -> None:
        self._single_call = single_call
        self.complete = False  # a single call is made: nothing after it belongs to the reply
        self._reasoning = ReasoningSplitter(starts_in_reasoning=prompt.starts_in_reasoning)
        self._calls = ToolCallParser(tools) if tools else None
        self._unfed = prompt.reply_prefix  # the reply's start, written by the prompt
        self._blank = ""  # blank answer text, held until we know whether a call follows
        self._last_was_call = False
        self.reasoning: list[str] = []
        self.content: list[str] = []
        self.tool_calls: list[ToolCall] = []

    def feed(self, text: str) -> list[Delta]:
        """The deltas that `text`, the reply's next piece, completes."""
        if self.complete:
            return []
        text, self._unfed = self._unfed + text, ""
        return self._deltas(self._reasoning.feed(text), final=False)

    def finish(self) -> list[Delta]:
        """The deltas of everything still held back, once the reply has ended."""
        if self.complete:
            return []
        deltas = self.feed("")
        deltas += self._deltas(self._reasoning.flush(), final=True)
        return deltas

    def finish_reason(self, ended: str) -> str:
        """OpenAI's reason: "tool_calls" when the model stopped after calling tools."""
        return "tool_calls" if self.tool_calls and ended == "stop" else ended

    def message(self) -> dict[str, Any]:
        """The whole reply as one message (after `finish`)."""
        content = "".join(self.content)
        message: dict[str, Any] = {
            "role": "assistant",
            "content": None if self.tool_calls and not content else content,
        }
        if self.reasoning:
            message["reasoning_content"] = "".join(self.reasoning)
        if self.tool_calls:
            message["tool_calls"] = [call.body() for call in self.tool_calls]
        return message

    def _deltas(self, piece: ReplyPiece, *, final: bool) -> list[Delta]:
        deltas: list[Delta] = []
        if piece.reasoning:
            self.reasoning.append(piece.reasoning)
            deltas.append({"reasoning_content": piece.reasoning})
        if self._calls is None:
            parts: list[str | ToolCall] = [piece.content] if piece.content else []
        else:
            parts = self._calls.feed(piece.content)
            if final:
                parts += self._calls.flush()
        for part in parts:
            if self.complete:
                break
            deltas += self._content(part) if isinstance(part, str) else self._call(part)
        if final and self._blank and not self._last_was_call:
            deltas += self._emit(self._blank)
            self._blank = ""
        return deltas

    def _content(self, text: str) -> list[Delta]:
        if self._calls is None:
            return self._emit(text)
        # Trailing blanks wait: before a call they are its layout, else they come with the next
        text, self._blank = self._blank + text, ""
        body = text.rstrip()
        self._blank = text[len(body) :]
        if not body:
            return []
        self._last_was_call = False
        return self._emit(body)

    def _emit(self, text: str) -> list[Delta]:
        self.content.append(text)
        return [{"content": text}]

    def _call(self, call: ToolCall) -> list[Delta]:
        self._blank = ""
        self._last_was_call = True
        index = len(self.tool_calls)
        self.tool_calls.append(call)
        self.complete = self._single_call
        opening = {
            "index": index,
            "id": call.id,
            "type": "function",
            "function": {"name": call.name, "arguments": ""},
        }
        arguments = {"index": index, "function": {"arguments": call.arguments}}
        return [{"tool_calls": [opening]}, {"tool_calls": [arguments]}]
