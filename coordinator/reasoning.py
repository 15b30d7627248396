"""The model's reasoning, `<think>...</think>`, split from its answer as `reasoning_content`.

This is the convention of vLLM and mlx-lm's servers, which chat front-ends read. Qwen3.5's
templates open the think block in the prompt when thinking is on, so the output may start
inside it (`starts_in_reasoning`) and only close it; otherwise the model may open one itself
at the very start of its answer. Once `</think>` has passed, the rest is the answer, markup
included. Markers split across streamed pieces are held back until they are whole; nothing of
the text is dropped but the markers themselves and the blank lines that follow `</think>`.
"""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.partial_text import split_at_partial_marker

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


@dataclass(frozen=True, slots=True)
class ReplyPiece:
    """A piece of the reply: reasoning and answer text, either possibly empty."""

    reasoning: str = ""
    content: str = ""


class ReasoningSplitter:
    """Feed the reply's text as it streams; get reasoning and answer text back."""

    def __init__(self, *, starts_in_reasoning: bool) -> None:
        self._state = "reasoning" if starts_in_reasoning else "start"
        self._held = ""
        self._after_close = False  # the answer's leading newlines are the think block's

    def feed(self, text: str) -> ReplyPiece:
        buffer, self._held = self._held + text, ""
        if self._state == "start":
            stripped = buffer.lstrip()
            if stripped.startswith(THINK_OPEN):
                self._state = "reasoning"
                buffer = stripped[len(THINK_OPEN) :]
            elif THINK_OPEN.startswith(stripped):  # blank so far, or the marker's first part
                self._held = buffer
                return ReplyPiece()
            else:
                self._state = "content"
        if self._state == "reasoning":
            end = buffer.find(THINK_CLOSE)
            if end < 0:
                reasoning, self._held = split_at_partial_marker(buffer, (THINK_CLOSE,))
                return ReplyPiece(reasoning=reasoning)
            self._state, self._after_close = "content", True
            return ReplyPiece(buffer[:end], self._answer(buffer[end + len(THINK_CLOSE) :]))
        return ReplyPiece(content=self._answer(buffer))

    def flush(self) -> ReplyPiece:
        """What is held back, once the reply has ended."""
        held, self._held = self._held, ""
        if self._state == "reasoning":
            return ReplyPiece(reasoning=held)
        return ReplyPiece(content=held)

    def _answer(self, text: str) -> str:
        if self._after_close:
            text = text.lstrip("\n")
            self._after_close = not text
        return text
