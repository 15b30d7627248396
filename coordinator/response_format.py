"""`response_format`: JSON the reply must be, enforced token by token with llguidance.

`json_object` asks for any JSON object, `json_schema` for one that fits the schema. The schema
becomes llguidance's grammar; its matcher follows the reply and gives, for each step, the
tokens allowed at each position the tail samples (`cluster.decode.token_mask`): after what is
emitted, and after each MTP draft as if it were accepted, so the tail can verify drafts under
the grammar. Once the JSON is whole, only the end-of-turn tokens are allowed.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import llguidance
import llguidance.hf
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from cluster.messages import RequestError
from coordinator.openai_schema import ApiError

# No whitespace between the JSON's tokens: free whitespace lets a small model fill its whole
# budget with blank lines, and costs tokens even when it does not.
COMPACT_JSON = {"whitespace_flexible": False}


class JsonConstraint:
    """One reply's grammar state (a `TokenConstraint`)."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab: int) -> None:
        self._matcher = matcher
        self._bitmask = allocate_token_bitmask(1, vocab)
        self._any = b"\xff" * self._bitmask.nbytes
        self.refused_drafts = 0  # MTP drafts the grammar did not allow (the tail rejects them)

    def masks(self, drafts: tuple[int, ...]) -> tuple[bytes, ...]:
        matcher = self._matcher
        valid = matcher.validate_tokens(list(drafts)) if drafts else 0
        out = [self._mask()]
        for draft in drafts[:valid]:
            matcher.consume_token(draft)
            out.append(self._mask())
        if valid:
            matcher.rollback(valid)
        # Past a draft the grammar refuses, the tail rejects that draft first: any mask does.
        self.refused_drafts += len(drafts) > valid
        out += [self._any] * (len(drafts) - valid)
        return tuple(out)

    def advance(self, tokens: tuple[int, ...]) -> None:
        if tokens and not self._matcher.consume_tokens(list(tokens)):
            raise RequestError(f"the reply left its JSON grammar: {self._matcher.get_error()}")

    def _mask(self) -> bytes:
        fill_next_token_bitmask(self._matcher, self._bitmask, 0)
        return self._bitmask[0].astype("<i4").tobytes()


class JsonGrammars:
    """Makes constraints for one tokenizer; llguidance's view of it is built once, on first use
    (about a second for a large vocabulary)."""

    def __init__(self, tokenizer: Any, stop_tokens: Iterable[int]) -> None:
        self._tokenizer = tokenizer
        self._stop_tokens = sorted(stop_tokens)
        self._ll_tokenizer: llguidance.LLTokenizer | None = None

    def constraint(self, schema: dict[str, Any]) -> JsonConstraint:
        """A fresh matcher for `schema`; a schema llguidance cannot take is a 400."""
        ll_tokenizer = self._llguidance_tokenizer()
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                json.dumps(schema), defaults=COMPACT_JSON
            )
            matcher = llguidance.LLMatcher(ll_tokenizer, grammar)
        except (ValueError, TypeError) as exc:
            raise _bad_schema(str(exc)) from exc
        if matcher.is_error():
            raise _bad_schema(matcher.get_error())
        return JsonConstraint(matcher, ll_tokenizer.vocab_size)

    def _llguidance_tokenizer(self) -> llguidance.LLTokenizer:
        if self._ll_tokenizer is None:
            hf = getattr(self._tokenizer, "_tokenizer", self._tokenizer)  # mlx-lm's wrapper
            self._ll_tokenizer = llguidance.hf.from_tokenizer(
                hf, n_vocab=len(hf), eos_token=self._stop_tokens
            )
        return self._ll_tokenizer


def _bad_schema(detail: str) -> ApiError:
    return ApiError(400, f"'response_format' has a schema this server cannot use: {detail}",
                    param="response_format")  # fmt: skip
