"""Token logprobs as OpenAI shapes them, for chat (`logprobs.content`) and text completions.

The values come from the tail: the target model's own distribution (plain softmax of its
logits, whatever the sampling temperature) at the position where each token was emitted, so
MTP on or off gives the same numbers. Here they only get their text: a token's exact bytes
(byte-level BPE tokens are bytes written as printable characters; a token may be a part of a
multi-byte character) and its text, those bytes decoded with U+FFFD for an incomplete part.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One emitted token, its logprob, and the likeliest tokens at its position."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's character for each byte: printable Latin-1 bytes stand for themselves,
    the others (controls, space, a few more) for the characters from U+0100 on, in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    alphabet = {chr(b): b for b in printable}
    shifted = (b for b in range(256) if b not in set(printable))
    for n, b in enumerate(shifted):
        alphabet[chr(256 + n)] = b
    return alphabet


_BYTE_OF_CHAR = _byte_level_alphabet()


class TokenText:
    """A tokenizer's tokens as bytes and text (cached; a response repeats tokens often)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, tuple[str, bytes]] = {}

    def of(self, token: int) -> tuple[str, bytes]:
        cached = self._cache.get(token)
        if cached is None:
            data = self._bytes(token)
            cached = self._cache[token] = (data.decode("utf-8", errors="replace"), data)
        return cached

    def _bytes(self, token: int) -> bytes:
        piece = self._tokenizer.convert_ids_to_tokens(token)
        if isinstance(piece, str) and piece and all(c in _BYTE_OF_CHAR for c in piece):
            return bytes(_BYTE_OF_CHAR[c] for c in piece)
        return self._tokenizer.decode([token]).encode()  # not byte-level: its own decoding


def chat_logprobs(entries: Sequence[TokenLogprob], text: TokenText) -> dict[str, Any]:
    """`choices[].logprobs` of a chat completion (or of one chunk)."""

    def entry(token: int, logprob: float) -> dict[str, Any]:
        string, data = text.of(token)
        return {"token": string, "logprob": logprob, "bytes": list(data)}

    content = [
        {**entry(e.token, e.logprob), "top_logprobs": [entry(t, lp) for t, lp in e.top]}
        for e in entries
    ]
    return {"content": content, "refusal": None}


def completion_logprobs(
    entries: Sequence[TokenLogprob], text: TokenText, *, offset: int, alternatives: int
) -> dict[str, Any]:
    """`choices[].logprobs` of a text completion; `offset` is where the entries' text starts."""
    tokens, offsets = [], []
    for e in entries:
        offsets.append(offset)
        string = text.of(e.token)[0]
        tokens.append(string)
        offset += len(string)
    top = [{text.of(t)[0]: lp for t, lp in e.top} for e in entries] if alternatives else None
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": top,
        "text_offset": offsets,
    }
