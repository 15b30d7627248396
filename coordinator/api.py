"""The coordinator's HTTP face: the OpenAI API, health, Prometheus metrics and the dashboard.

One request's path: parse and validate the body (`openai_schema`), turn it into prompt token
ids, wait for an admission slot, then pull `GenerationChunk`s from the engine and turn them
into text. The text goes through mlx-lm's streaming detokenizer (so multi-byte characters and
BPE spaces come out whole) and a `StopMatcher` that holds back anything that might still grow
into a stop string: a stop string, and everything after it, never reaches the client.

Whatever way a request ends (finished, stop string, client gone, error), the engine's stream
is closed explicitly with `aclose()`, which is what frees the request's caches on every node.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, cast

from aiohttp import web

from cluster.decode.engine import GenerationChunk, GenerationRequest
from cluster.decode.token_mask import TokenConstraint
from cluster.messages import MtpDepth, RequestError, RequestOptions
from coordinator.admission import AdmissionController, OverCapacity
from coordinator.api_keys import ApiKeys, api_key_middleware
from coordinator.chat_prompt import render_chat_prompt
from coordinator.chat_reply import ChatReply
from coordinator.chat_request import parse_chat_request
from coordinator.logprobs import TokenLogprob, TokenText, chat_logprobs, completion_logprobs
from coordinator.metrics import ClusterView, RequestCounters, cluster_json, render_prometheus
from coordinator.openai_schema import (
    ApiError,
    CommonParams,
    CompletionRequest,
    ResponseIdentity,
    Usage,
    chat_chunk,
    chat_completion,
    chat_usage_chunk,
    model_list,
    parse_completion_request,
    text_completion,
    text_usage_chunk,
)
from coordinator.partial_text import split_at_partial_marker
from coordinator.response_format import JsonGrammars

log = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).with_name("static")
SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # a reverse proxy must not sit on the tokens
}
PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Engine(Protocol):
    """The part of `cluster.decode.engine.GenerationEngine` the API uses."""

    @property
    def max_context(self) -> int: ...

    def stream(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        """An async generator: closing it early cancels the request on every node."""
        ...


def create_app(
    engine: Engine,
    tokenizer: Any,
    view: ClusterView,
    *,
    model_id: str,
    admission: AdmissionController,
    counters: RequestCounters | None = None,
    api_keys: ApiKeys | None = None,
    mtp_depth: MtpDepth = 1,
) -> web.Application:
    """The coordinator's aiohttp application.

    `tokenizer` is mlx-lm's `TokenizerWrapper`. Pass the same `counters` to the `ClusterView`
    that reports `ClusterStats`, so that the requests counted here show up in its stats.
    Run it with `handler_cancellation=True` (AppRunner / run_app) so that a client that hangs
    up cancels its request at once, not only at the next write. With `api_keys`, the routes
    they guard need `Authorization: Bearer KEY`. `mtp_depth` is the MTP drafts per step of a
    request that does not name its own.
    """
    api = _Api(
        engine, tokenizer, view, model_id, admission, counters or RequestCounters(), mtp_depth
    )
    keys = api_keys or ApiKeys()
    app = web.Application(middlewares=[_openai_errors, api_key_middleware(keys)])
    app.router.add_post("/v1/chat/completions", api.counted(api.chat_completions))
    app.router.add_post("/v1/completions", api.counted(api.completions))
    app.router.add_get("/v1/models", api.models)
    app.router.add_get("/health", api.health)
    app.router.add_get("/metrics", api.metrics)
    app.router.add_get("/api/cluster", api.cluster)
    app.router.add_get("/", _dashboard)
    app.router.add_static("/static/", STATIC_DIR)
    return app


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


_Logprobs = list[TokenLogprob] | None


class _ChatFormat:
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
        self, text: str, finish_reason: str | None, logprobs: _Logprobs = None
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

    def whole(self, finish_reason: str, usage: Usage, logprobs: _Logprobs = None) -> dict[str, Any]:
        self.reply.finish()
        reason = self.reply.finish_reason(finish_reason)
        shaped = None if logprobs is None else chat_logprobs(logprobs, self._token_text)
        return chat_completion(self.ident, self.reply.message(), reason, usage, shaped)


class _TextFormat:
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
        self, text: str, finish_reason: str | None, logprobs: _Logprobs = None
    ) -> list[dict[str, Any]]:
        return [text_completion(self.ident, text, finish_reason, None, self._shape(logprobs))]

    def usage(self, usage: Usage) -> dict[str, Any]:
        return text_usage_chunk(self.ident, usage)

    def whole(self, finish_reason: str, usage: Usage, logprobs: _Logprobs = None) -> dict[str, Any]:
        text = "".join(self._pieces)
        return text_completion(self.ident, text, finish_reason, usage, self._shape(logprobs))

    def _shape(self, logprobs: _Logprobs) -> dict[str, Any] | None:
        if logprobs is None:
            return None
        shaped = completion_logprobs(
            logprobs, self._token_text, offset=self._offset, alternatives=self._alternatives
        )
        self._offset += sum(len(token) for token in shaped["tokens"])
        return shaped


_Format = _ChatFormat | _TextFormat
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class _Api:
    """The handlers, sharing the engine, tokenizer, view, admission and counters."""

    def __init__(
        self,
        engine: Engine,
        tokenizer: Any,
        view: ClusterView,
        model_id: str,
        admission: AdmissionController,
        counters: RequestCounters,
        mtp_depth: MtpDepth = 1,
    ) -> None:
        self._engine = engine
        self._tokenizer = tokenizer
        self._view = view
        self._model_id = model_id
        self._admission = admission
        self._counters = counters
        self._stop_tokens = stop_token_ids(tokenizer)
        self._token_text = TokenText(tokenizer)
        self._grammars = JsonGrammars(tokenizer, self._stop_tokens)
        self._created = int(time.time())
        self._mtp_depth = mtp_depth  # for requests that do not name theirs

    # --- OpenAI endpoints -------------------------------------------------------------------

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        max_context = self._engine.max_context
        chat = parse_chat_request(
            await request.read(), model_id=self._model_id, max_context=max_context
        )
        prompt = render_chat_prompt(self._tokenizer, chat)
        reply = ChatReply(prompt, chat.offered_tools, single_call=not chat.parallel_tool_calls)
        fmt = _ChatFormat(chat.params.model, reply, self._token_text)
        constraint = None
        if chat.json_schema is not None:
            if prompt.starts_in_reasoning:  # the JSON would land in the think block
                raise ApiError(
                    400,
                    "'response_format' needs the reply to start with the answer: turn thinking "
                    "off (chat_template_kwargs.enable_thinking: false)",
                    param="response_format",
                )
            constraint = self._grammars.constraint(chat.json_schema)
        return await self._generate(request, prompt.tokens, chat.params, fmt, constraint)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        max_context = self._engine.max_context
        completion = parse_completion_request(
            await request.read(), model_id=self._model_id, max_context=max_context
        )
        params = completion.params
        fmt = _TextFormat(params.model, self._token_text, params.top_logprobs or 0)
        return await self._generate(request, self._text_prompt(completion), completion.params, fmt)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(model_list(self._model_id, self._created))

    # --- cluster endpoints ------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        """200 "ok" when every node is up; 503 "degraded" otherwise (the pipeline needs all)."""
        nodes = self._view.node_statuses()
        healthy = bool(nodes) and all(node.up for node in nodes)
        body = {
            "status": "ok" if healthy else "degraded",
            "model": self._model_id,
            "nodes": [{"node_id": n.node_id, "address": n.address, "up": n.up} for n in nodes],
        }
        return web.json_response(body, status=200 if healthy else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        text = render_prometheus(
            self._view,
            self._counters,
            requests_queued=self._admission.queued,
            requests_running=self._admission.running,
        )
        return web.Response(body=text.encode(), headers={"Content-Type": PROMETHEUS_CONTENT_TYPE})

    async def cluster(self, request: web.Request) -> web.Response:
        body = cluster_json(self._view)
        body["admission"] = {
            "running": self._admission.running,
            "queued": self._admission.queued,
            "max_running": self._admission.max_running,
            "max_queued": self._admission.max_queued,
        }
        return web.json_response(body, headers={"Cache-Control": "no-store"})

    # --- generation -------------------------------------------------------------------------

    def counted(self, handler: _Handler) -> _Handler:
        """Count a generation request, and whether it was refused or failed on our side."""

        async def counted_handler(request: web.Request) -> web.StreamResponse:
            self._counters.requests_total += 1
            try:
                return await handler(request)
            except ApiError as exc:
                if exc.status >= 500 and not isinstance(exc, OverCapacity):
                    self._counters.errors_total += 1
                else:
                    self._counters.rejected_total += 1
                raise
            except Exception:
                self._counters.errors_total += 1
                raise

        return counted_handler

    def _text_prompt(self, completion: CompletionRequest) -> tuple[int, ...]:
        if isinstance(completion.prompt, str):
            return tuple(self._tokenizer.encode(completion.prompt))
        vocab = len(self._tokenizer)
        if any(token >= vocab for token in completion.prompt):
            raise ApiError(400, f"prompt token ids must be < {vocab}", param="prompt")
        return completion.prompt

    def _generation_request(
        self,
        prompt: tuple[int, ...],
        params: CommonParams,
        constraint: TokenConstraint | None = None,
    ) -> GenerationRequest:
        """Check the context budget here, before a slot is taken, and build the request."""
        max_context = self._engine.max_context
        room = max_context - len(prompt)
        max_tokens = params.max_tokens if params.max_tokens is not None else room
        if max_tokens > room or room < 1:
            raise ApiError(
                400,
                f"This model's maximum context length is {max_context} tokens. However, you "
                f"requested {len(prompt) + max(max_tokens, 1)} tokens ({len(prompt)} in the "
                f"prompt, {max(max_tokens, 1)} for the completion).",
                param="max_tokens" if params.max_tokens is not None else "prompt",
                code="context_length_exceeded",
            )
        depth = self._mtp_depth if params.mtp_depth is None else params.mtp_depth
        options = RequestOptions(
            sampling=params.sampling,
            mtp=params.mtp,
            logprobs=params.top_logprobs is not None,
            top_logprobs=params.top_logprobs or 0,
            mtp_depth=depth,
        )
        stop_tokens = frozenset() if params.ignore_eos else self._stop_tokens
        try:
            return GenerationRequest(
                prompt, max_tokens, options, stop_tokens, constraint=constraint
            )
        except RequestError as exc:
            raise ApiError(400, str(exc), code="invalid_request") from exc

    async def _generate(
        self,
        request: web.Request,
        prompt: tuple[int, ...],
        params: CommonParams,
        fmt: _Format,
        constraint: TokenConstraint | None = None,
    ) -> web.StreamResponse:
        generation = self._generation_request(prompt, params, constraint)
        async with self._admission.slot():
            self._counters.in_flight += 1
            self._counters.prompt_tokens_total += len(prompt)
            stream = TextStream(self._engine, self._tokenizer, generation, params.stop)
            try:
                if params.stream:
                    return await self._send_events(request, stream, params, fmt, len(prompt))
                return await self._send_whole(request, stream, fmt, len(prompt))
            finally:
                try:
                    # Cancels the request on every node if still running, else releases it
                    # (keeping the conversation's snapshot). A client that hangs up once the
                    # response is out cancels this handler: that must not cut the release short.
                    await asyncio.shield(stream.aclose())
                finally:
                    self._counters.in_flight -= 1
                    self._counters.completion_tokens_total += stream.completion_tokens

    async def _send_whole(
        self, request: web.Request, stream: TextStream, fmt: _Format, prompt_tokens: int
    ) -> web.Response:
        while (text := await stream.next_text()) is not None:
            fmt.absorb(text)
            if fmt.complete:  # the rest would not be part of the reply: stop generating
                break
            if _client_gone(request):
                log.info("client went away; cancelling its request")
                break
        usage = _usage(prompt_tokens, stream)
        body = fmt.whole(stream.finish_reason or "stop", usage, stream.logprobs)
        return web.json_response(body)

    async def _send_events(
        self,
        request: web.Request,
        stream: TextStream,
        params: CommonParams,
        fmt: _Format,
        prompt_tokens: int,
    ) -> web.StreamResponse:
        """Server-sent events. The first piece is awaited before the headers go out, so that a
        request the engine refuses at once still gets a real HTTP error status."""
        text = await stream.next_text()
        response = web.StreamResponse(headers=SSE_HEADERS)
        try:
            await response.prepare(request)
            for obj in fmt.opening():
                await _send_event(response, obj)
            while text is not None:
                for obj in fmt.pieces(text, stream.finish_reason, stream.take_logprobs()):
                    await _send_event(response, obj)
                if fmt.complete:  # the rest would not be part of the reply: stop generating
                    break
                text = await stream.next_text()
            if params.include_usage:
                await _send_event(response, fmt.usage(_usage(prompt_tokens, stream)))
            await response.write(b"data: [DONE]\n\n")
        except ApiError as exc:  # failed after the headers went out: say so in the stream
            self._counters.errors_total += 1
            with contextlib.suppress(ConnectionResetError):
                await _send_event(response, exc.body())
        except ConnectionResetError:  # aiohttp's ClientConnectionResetError is one
            log.info("client went away mid-stream; cancelling its request")
            return response
        await response.write_eof()
        return response


def _usage(prompt_tokens: int, stream: TextStream) -> Usage:
    return Usage(
        prompt_tokens,
        stream.completion_tokens,
        stream.cached_tokens,
        stream.drafted,
        stream.accepted,
    )


def _client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


async def _send_event(response: web.StreamResponse, obj: dict[str, Any]) -> None:
    data = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    await response.write(f"data: {data}\n\n".encode())


async def _dashboard(request: web.Request) -> web.FileResponse:
    return web.FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-cache"})


@web.middleware
async def _openai_errors(request: web.Request, handler: _Handler) -> web.StreamResponse:
    """Every error leaves as an OpenAI error body, including aiohttp's own 404/405/413."""
    try:
        return await handler(request)
    except ApiError as exc:
        return _error_response(exc)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        error_type = "invalid_request_error" if exc.status < 500 else "server_error"
        return _error_response(ApiError(exc.status, exc.reason, type=error_type))
    except Exception:
        log.exception("unhandled error serving %s", request.path)
        return _error_response(ApiError(500, "internal server error", type="server_error"))


def _error_response(exc: ApiError) -> web.Response:
    return web.json_response(exc.body(), status=exc.status, headers=exc.headers)
