"""The OpenAI objects of one response, streamed or whole: chat completions (reasoning,
content, tool calls) and text completions, each with its logprobs in OpenAI's shape."""

from __future__ import annotations

from typing import Any

from coordinator.chat_reply import ChatReply
from coordinator.logprobs import TokenLogprob, TokenText, chat_logprobs, completion_logprobs
from coordinator.openai_schema import (
    ResponseIdentity,
    Usage,
    chat_chunk,
    chat_completion,
    chat_usage_chunk,
    text_completion,
    text_usage_chunk,
)

Logprobs = list[TokenLogprob] | None


class ChatFormat:
    """The chat.completion(.chunk) objects of one response: reasoning, content, tool calls.

    Streamed logprobs ride on the next chunk that goes out (text may be held back a while).
    """

    def __init__(self, model: str, reply: ChatReply, token_text: TokenText) -> None:
        self.ident = ResponseIdentity.new("chatcmpl", model)
        self.reply = reply
        self._token_text = token_text
        self._pending: list[TokenLogprob] = []

    @property
    def complete(self) -> bool:
        """The reply has all it may have (one call made, when only one is allowed)."""
        return self.reply.complete

    def absorb(self, text: str) -> None:
        """Take in a piece of a reply that is sent whole."""
        self.reply.feed(text)

    def opening(self) -> list[dict[str, Any]]:
        return [chat_chunk(self.ident, {"role": "assistant", "content": ""})]

    def pieces(
        self, text: str, finish_reason: str | None, logprobs: Logprobs = None
    ) -> list[dict[str, Any]]:
        deltas = self.reply.feed(text)
        if finish_reason is None and self.reply.complete:
            finish_reason = "stop"  # the caller stops the generation here
        if finish_reason is not None:
            deltas += self.reply.finish()
        out = [chat_chunk(self.ident, delta) for delta in deltas]
        if finish_reason is not None:
            out.append(chat_chunk(self.ident, {}, self.reply.finish_reason(finish_reason)))
        if logprobs is not None:
            self._pending += logprobs
            if out and self._pending:
                out[0]["choices"][0]["logprobs"] = chat_logprobs(self._pending, self._token_text)
                self._pending = []
        return out

    def usage(self, usage: Usage) -> dict[str, Any]:
        return chat_usage_chunk(self.ident, usage)

    def whole(self, finish_reason: str, usage: Usage, logprobs: Logprobs = None) -> dict[str, Any]:
        self.reply.finish()
        reason = self.reply.finish_reason(finish_reason)
        shaped = None if logprobs is None else chat_logprobs(logprobs, self._token_text)
        return chat_completion(self.ident, self.reply.message(), reason, usage, shaped)


class TextFormat:
    """The text_completion objects of one response."""

    def __init__(self, model: str, token_text: TokenText, alternatives: int) -> None:
        self.ident = ResponseIdentity.new("cmpl", model)
        self._token_text = token_text
        self._alternatives = alternatives
        self._offset = 0  # of the next logprobs' text in the completion
        self._pieces: list[str] = []
        self.complete = False  # a text completion ends only when the generation does

    def absorb(self, text: str) -> None:
        self._pieces.append(text)

    def opening(self) -> list[dict[str, Any]]:
        return []

    def pieces(
        self, text: str, finish_reason: str | None, logprobs: Logprobs = None
    ) -> list[dict[str, Any]]:
        return [text_completion(self.ident, text, finish_reason, None, self._shape(logprobs))]

    def usage(self, usage: Usage) -> dict[str, Any]:
        return text_usage_chunk(self.ident, usage)

    def whole(self, finish_reason: str, usage: Usage, logprobs: Logprobs = None) -> dict[str, Any]:
        text = "".join(self._pieces)
        return text_completion(self.ident, text, finish_reason, usage, self._shape(logprobs))

    def _shape(self, logprobs: Logprobs) -> dict[str, Any] | None:
        if logprobs is None:
            return None
        shaped = completion_logprobs(
            logprobs, self._token_text, offset=self._offset, alternatives=self._alternatives
        )
        self._offset += sum(len(token) for token in shaped["tokens"])
        return shaped


ResponseObjects = ChatFormat | TextFormat
