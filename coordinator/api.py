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

import contextlib
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, cast

from aiohttp import web
from jinja2 import TemplateError

from cluster.decode.engine import GenerationChunk, GenerationRequest
from cluster.messages import RequestError, RequestOptions
from coordinator.admission import AdmissionController, OverCapacity
from coordinator.metrics import ClusterView, RequestCounters, cluster_json, render_prometheus
from coordinator.openai_schema import (
    ApiError,
    ChatRequest,
    CommonParams,
    CompletionRequest,
    ResponseIdentity,
    Usage,
    chat_chunk,
    chat_completion,
    chat_usage_chunk,
    model_list,
    parse_chat_request,
    parse_completion_request,
    text_completion,
    text_usage_chunk,
)

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
) -> web.Application:
    """The coordinator's aiohttp application.

    `tokenizer` is mlx-lm's `TokenizerWrapper`. Pass the same `counters` to the `ClusterView`
    that reports `ClusterStats`, so that the requests counted here show up in its stats.
    Run it with `handler_cancellation=True` (AppRunner / run_app) so that a client that hangs
    up cancels its request at once, not only at the next write.
    """
    api = _Api(engine, tokenizer, view, model_id, admission, counters or RequestCounters())
    app = web.Application(middlewares=[_openai_errors])
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
        keep = self._longest_stop_prefix_suffix(buffer)
        self._held = buffer[len(buffer) - keep :]
        return buffer[: len(buffer) - keep], False

    def flush(self) -> str:
        """The held-back text, once the generation has ended without a stop string."""
        held, self._held = self._held, ""
        return held

    def _longest_stop_prefix_suffix(self, buffer: str) -> int:
        longest = max((len(stop) - 1 for stop in self._stops), default=0)
        for size in range(min(longest, len(buffer)), 0, -1):
            tail = buffer[-size:]
            if any(stop.startswith(tail) for stop in self._stops):
                return size
        return 0


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
        self.drafted = 0  # MTP drafts of this request so far, and how many were accepted
        self.accepted = 0
        self.finish_reason: str | None = None

    async def next_text(self) -> str | None:
        while self.finish_reason is None:
            chunk = await self._next_chunk()
            text = self._absorb(chunk)
            if text or self.finish_reason is not None:
                return text
        return None

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
        self.drafted, self.accepted = chunk.drafted, chunk.accepted
        for token in chunk.tokens:
            if token not in self._stop_tokens:  # an end-of-turn token is not text
                self._detokenizer.add_token(token)
        if chunk.finish_reason is not None:
            self._detokenizer.finalize()
        text, stopped = self._stops.feed(self._detokenizer.last_segment)
        if stopped:
            self.finish_reason = "stop"
        elif chunk.finish_reason is not None:
            self.finish_reason = chunk.finish_reason
            text += self._stops.flush()
        return text


class _ChatFormat:
    """The chat.completion(.chunk) objects of one response."""

    def __init__(self, model: str) -> None:
        self.ident = ResponseIdentity.new("chatcmpl", model)

    def opening(self) -> list[dict[str, Any]]:
        return [chat_chunk(self.ident, {"role": "assistant", "content": ""})]

    def pieces(self, text: str, finish_reason: str | None) -> list[dict[str, Any]]:
        out = [chat_chunk(self.ident, {"content": text})] if text else []
        if finish_reason is not None:
            out.append(chat_chunk(self.ident, {}, finish_reason))
        return out

    def usage(self, usage: Usage) -> dict[str, Any]:
        return chat_usage_chunk(self.ident, usage)

    def whole(self, text: str, finish_reason: str, usage: Usage) -> dict[str, Any]:
        return chat_completion(self.ident, text, finish_reason, usage)


class _TextFormat:
    """The text_completion objects of one response."""

    def __init__(self, model: str) -> None:
        self.ident = ResponseIdentity.new("cmpl", model)

    def opening(self) -> list[dict[str, Any]]:
        return []

    def pieces(self, text: str, finish_reason: str | None) -> list[dict[str, Any]]:
        return [text_completion(self.ident, text, finish_reason, None)]

    def usage(self, usage: Usage) -> dict[str, Any]:
        return text_usage_chunk(self.ident, usage)

    def whole(self, text: str, finish_reason: str, usage: Usage) -> dict[str, Any]:
        return text_completion(self.ident, text, finish_reason, usage)


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
    ) -> None:
        self._engine = engine
        self._tokenizer = tokenizer
        self._view = view
        self._model_id = model_id
        self._admission = admission
        self._counters = counters
        self._stop_tokens = stop_token_ids(tokenizer)
        self._created = int(time.time())

    # --- OpenAI endpoints -------------------------------------------------------------------

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        max_context = self._engine.max_context
        chat = parse_chat_request(
            await request.read(), model_id=self._model_id, max_context=max_context
        )
        fmt = _ChatFormat(chat.params.model)
        return await self._generate(request, self._chat_prompt(chat), chat.params, fmt)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        max_context = self._engine.max_context
        completion = parse_completion_request(
            await request.read(), model_id=self._model_id, max_context=max_context
        )
        fmt = _TextFormat(completion.params.model)
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

    def _chat_prompt(self, chat: ChatRequest) -> tuple[int, ...]:
        messages = [{"role": m.role, "content": m.content} for m in chat.messages]
        try:
            ids = self._tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True
            )
        except TemplateError as exc:  # templates reject e.g. a conversation in a bad order
            raise ApiError(400, f"the chat template rejected the messages: {exc}") from exc
        return tuple(int(token) for token in ids)

    def _text_prompt(self, completion: CompletionRequest) -> tuple[int, ...]:
        if isinstance(completion.prompt, str):
            return tuple(self._tokenizer.encode(completion.prompt))
        vocab = len(self._tokenizer)
        if any(token >= vocab for token in completion.prompt):
            raise ApiError(400, f"prompt token ids must be < {vocab}", param="prompt")
        return completion.prompt

    def _generation_request(
        self, prompt: tuple[int, ...], params: CommonParams
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
        options = RequestOptions(sampling=params.sampling, mtp=params.mtp)
        stop_tokens = frozenset() if params.ignore_eos else self._stop_tokens
        try:
            return GenerationRequest(prompt, max_tokens, options, stop_tokens)
        except RequestError as exc:
            raise ApiError(400, str(exc), code="invalid_request") from exc

    async def _generate(
        self,
        request: web.Request,
        prompt: tuple[int, ...],
        params: CommonParams,
        fmt: _Format,
    ) -> web.StreamResponse:
        generation = self._generation_request(prompt, params)
        async with self._admission.slot():
            self._counters.in_flight += 1
            self._counters.prompt_tokens_total += len(prompt)
            stream = TextStream(self._engine, self._tokenizer, generation, params.stop)
            try:
                if params.stream:
                    return await self._send_events(request, stream, params, fmt, len(prompt))
                return await self._send_whole(request, stream, fmt, len(prompt))
            finally:
                await stream.aclose()  # cancels the request on every node if still running
                self._counters.in_flight -= 1
                self._counters.completion_tokens_total += stream.completion_tokens

    async def _send_whole(
        self, request: web.Request, stream: TextStream, fmt: _Format, prompt_tokens: int
    ) -> web.Response:
        pieces: list[str] = []
        while (text := await stream.next_text()) is not None:
            pieces.append(text)
            if _client_gone(request):
                log.info("client went away; cancelling its request")
                break
        usage = _usage(prompt_tokens, stream)
        body = fmt.whole("".join(pieces), stream.finish_reason or "stop", usage)
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
                for obj in fmt.pieces(text, stream.finish_reason):
                    await _send_event(response, obj)
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
    return Usage(prompt_tokens, stream.completion_tokens, stream.drafted, stream.accepted)


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
