"""One request's generation as text: the engine's chunks in, detokenized text out.

The text goes through mlx-lm's streaming detokenizer (so multi-byte characters and BPE spaces
come out whole) and a `StopMatcher` that holds back anything that might still grow into a stop
string: a stop string, and everything after it, never reaches the client. Closing the stream
(`aclose()`) closes the engine's, which is what frees the request's caches on every node.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from pathlib import Path
from typing import Any, Protocol, cast

from cluster.decode.engine import GenerationChunk, GenerationRequest
from cluster.messages import RequestError
from coordinator.logprobs import TokenLogprob
from coordinator.openai_schema import ApiError
from coordinator.partial_text import split_at_partial_marker

log = logging.getLogger(__name__)


class Engine(Protocol):
    """The part of `cluster.decode.engine.GenerationEngine` the API uses."""

    @property
    def max_context(self) -> int: ...

    def stream(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        """An async generator: closing it early cancels the request on every node."""
        ...


def stop_token_ids(tokenizer: Any) -> frozenset[int]:
    """The tokenizer's eos ids plus generation_config.json's `eos_token_id` (int or list).

    Chat models end a turn with a token (`<|im_end|>`) that is not always the tokenizer's
    eos, and generation_config.json is where the checkpoint says so.
    """
    ids = {int(token) for token in tokenizer.eos_token_ids}
    config_file = Path(str(getattr(tokenizer, "name_or_path", ""))) / "generation_config.json"
    if config_file.is_file():
        eos = json.loads(config_file.read_text()).get("eos_token_id")
        ids.update([eos] if isinstance(eos, int) else (eos or []))
    return frozenset(ids)


class StopMatcher:
    """Cuts streamed text at the first stop string, holding back what could still become one.

    Text is emitted only once no stop string can start inside it; the held-back tail is at
    most the longest stop string minus one character.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(stops)
        self._held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Return the text that is safe to emit, and whether a stop string was found."""
        buffer = self._held + text
        found = [i for i in (buffer.find(stop) for stop in self._stops) if i >= 0]
        if found:
            self._held = ""
            return buffer[: min(found)], True
        safe, self._held = split_at_partial_marker(buffer, self._stops)
        return safe, False

    def flush(self) -> str:
        """The held-back text, once the generation has ended without a stop string."""
        held, self._held = self._held, ""
        return held


class TextStream:
    """One request's generation as text: engine chunks in, detokenized, stop-trimmed text out.

    `next_text()` returns the next piece (possibly empty on the last one) or None once done;
    `finish_reason` is set when the last piece is returned. Callers must `aclose()` it.
    """

    def __init__(
        self, engine: Engine, tokenizer: Any, request: GenerationRequest, stops: Sequence[str]
    ) -> None:
        # An async generator by the engine's contract; its aclose() is what cancels.
        self._chunks = cast(AsyncGenerator[GenerationChunk, None], engine.stream(request))
        self._detokenizer = tokenizer.detokenizer
        self._stops = StopMatcher(stops)
        self._stop_tokens = request.stop_tokens
        self.completion_tokens = 0
        self.cached_tokens = 0  # prompt tokens the conversation cache spared
        self.drafted = 0  # MTP drafts of this request so far, and how many were accepted
        self.accepted = 0
        self.finish_reason: str | None = None
        # Every emitted token's logprob (when asked for), and how many were already taken.
        self.logprobs: list[TokenLogprob] | None = [] if request.options.logprobs else None
        self._logprobs_taken = 0

    async def next_text(self) -> str | None:
        while self.finish_reason is None:
            chunk = await self._next_chunk()
            text = self._absorb(chunk)
            if text or self.finish_reason is not None:
                return text
        return None

    def take_logprobs(self) -> list[TokenLogprob] | None:
        """The logprobs of the tokens absorbed since the last call (None: not asked for)."""
        if self.logprobs is None:
            return None
        new = self.logprobs[self._logprobs_taken :]
        self._logprobs_taken = len(self.logprobs)
        return new

    async def aclose(self) -> None:
        """Close the engine's stream: a request still running is cancelled on every node."""
        await self._chunks.aclose()

    async def _next_chunk(self) -> GenerationChunk | None:
        """The engine's next chunk, with its failures turned into API errors."""
        try:
            return await anext(self._chunks)
        except StopAsyncIteration:
            return None
        except RequestError as exc:
            raise ApiError(400, str(exc), code="invalid_request") from exc
        except Exception as exc:
            log.exception("generation failed")
            raise ApiError(
                502, f"generation failed: {exc}", type="server_error", code="engine_error"
            ) from exc

    def _absorb(self, chunk: GenerationChunk | None) -> str:
        if chunk is None:  # the engine ended without saying why; treat it as a natural end
            self.finish_reason = "stop"
            self._detokenizer.finalize()
            text, _ = self._stops.feed(self._detokenizer.last_segment)
            return text + self._stops.flush()
        self.completion_tokens += len(chunk.tokens)
        self.cached_tokens = chunk.cached_tokens
        self.drafted, self.accepted = chunk.drafted, chunk.accepted
        for i, token in enumerate(chunk.tokens):
            if token not in self._stop_tokens:  # an end-of-turn token is not text
                self._detokenizer.add_token(token)
                self._absorb_logprob(chunk, i)
        if chunk.finish_reason is not None:
            self._detokenizer.finalize()
        text, stopped = self._stops.feed(self._detokenizer.last_segment)
        if stopped:
            self.finish_reason = "stop"
        elif chunk.finish_reason is not None:
            self.finish_reason = chunk.finish_reason
            text += self._stops.flush()
        return text

    def _absorb_logprob(self, chunk: GenerationChunk, i: int) -> None:
        if self.logprobs is None:
            return
        if chunk.logprobs is None or len(chunk.logprobs) <= i:
            raise ApiError(502, "the engine sent no logprobs", type="server_error")
        top = chunk.top_logprobs[i] if chunk.top_logprobs else ()
        self.logprobs.append(TokenLogprob(chunk.tokens[i], chunk.logprobs[i], top))
