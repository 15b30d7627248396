"""The coordinator's HTTP face: the OpenAI API, health, Prometheus metrics and the dashboard.

One request's path: parse and validate the body (`openai_schema`, `chat_request`), turn it
into prompt token ids, wait for an admission slot, then read the engine's generation as text
(`text_stream`) and send it as OpenAI's objects (`response_objects`), streamed or whole.

Whatever way a request ends (finished, stop string, client gone, error), the engine's stream
is closed explicitly with `aclose()`, which is what frees the request's caches on every node.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web

from cluster.decode.engine import GenerationRequest
from cluster.decode.mtp_depth import served_depth
from cluster.decode.token_mask import TokenConstraint
from cluster.messages import MtpDepth, RequestError, RequestOptions
from cluster.model.loading import NO_MTP_HEAD
from coordinator.admission import AdmissionController, OverCapacity
from coordinator.api_keys import ApiKeys, api_key_middleware
from coordinator.chat_prompt import render_chat_prompt
from coordinator.chat_reply import ChatReply
from coordinator.chat_request import parse_chat_request
from coordinator.history import History
from coordinator.logprobs import TokenText
from coordinator.metrics import ClusterView, RequestCounters, cluster_json, render_prometheus
from coordinator.openai_schema import (
    ApiError,
    CommonParams,
    CompletionRequest,
    Usage,
    model_list,
    parse_completion_request,
)
from coordinator.response_format import JsonGrammars
from coordinator.response_objects import ChatFormat, ResponseObjects, TextFormat
from coordinator.text_stream import Engine, TextStream, stop_token_ids

if TYPE_CHECKING:
    from cluster.decode.warmup import WarmupProgress

log = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).with_name("static")
SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # a reverse proxy must not sit on the tokens
}
PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(frozen=True, slots=True)
class ServedModel:
    """What the API serves: the model's id (in /v1/models and every reply), the MTP drafts per
    step of a request that names none, and whether the model has an MTP head at all (without
    one, a checkpoint whose `mtp.*` were dropped, no request drafts)."""

    model_id: str
    mtp_depth: MtpDepth = "auto"
    mtp_head: bool = True


@dataclass(frozen=True, slots=True)
class Monitoring:
    """What the app reports beside the API: the request `counters` (the same ones the
    `ClusterView` reports in its stats), the coordinator's `warmup` where it has one, and the
    `history` behind the dashboard's charts (None: one that nobody samples)."""

    counters: RequestCounters = field(default_factory=RequestCounters)
    warmup: WarmupProgress | None = None
    history: History | None = None


def create_app(
    engine: Engine,
    tokenizer: Any,
    view: ClusterView,
    *,
    served: ServedModel,
    admission: AdmissionController,
    api_keys: ApiKeys | None = None,
    monitoring: Monitoring | None = None,
) -> web.Application:
    """The coordinator's aiohttp application.

    `tokenizer` is mlx-lm's `TokenizerWrapper`. The `monitoring`'s counters must be those the
    `ClusterView` reports in its `ClusterStats`, so that the requests counted here show there.
    Run it with `handler_cancellation=True` (AppRunner / run_app) so that a client that hangs
    up cancels its request at once, not only at the next write. With `api_keys`, the routes
    they guard need `Authorization: Bearer KEY`. `served` names the model and its MTP default
    (`ServedModel`); without an MTP head every request is served without drafts, and
    /api/cluster says so. While the `monitoring`'s warm-up says "warming", /health answers 503
    "warming"; /api/cluster and /metrics show its progress.
    Its `history` keeps the dashboard's charts (/api/history): the requests served here report
    their tokens and latencies to its recorder, and whoever owns it runs its sampler (the
    coordinator does). Without one, the app keeps a history that nobody samples.
    """
    monitoring = monitoring or Monitoring()
    api = _Api(engine, tokenizer, view, served, admission, monitoring.counters)
    api.warmup = monitoring.warmup
    api.history = monitoring.history or History(view)
    keys = api_keys or ApiKeys()
    app = web.Application(middlewares=[_openai_errors, api_key_middleware(keys)])
    app.router.add_post("/v1/chat/completions", api.counted(api.chat_completions))
    app.router.add_post("/v1/completions", api.counted(api.completions))
    app.router.add_get("/v1/models", api.models)
    app.router.add_get("/health", api.health)
    app.router.add_get("/metrics", api.metrics)
    app.router.add_get("/api/cluster", api.cluster)
    app.router.add_get("/api/history", _guarded_as("/api/cluster", keys, api.history_json))
    app.router.add_get("/", _dashboard)
    app.router.add_static("/static/", STATIC_DIR)
    return app


_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class _Api:
    """The handlers, sharing the engine, tokenizer, view, admission and counters."""

    warmup: WarmupProgress | None = None  # the coordinator's warm-up, where it has one
    history: History  # the dashboard's charts; each request's tokens and latencies go to it

    def __init__(
        self,
        engine: Engine,
        tokenizer: Any,
        view: ClusterView,
        served: ServedModel,
        admission: AdmissionController,
        counters: RequestCounters,
    ) -> None:
        self._engine = engine
        self._tokenizer = tokenizer
        self._view = view
        self._model_id = served.model_id
        self._admission = admission
        self._counters = counters
        self._stop_tokens = stop_token_ids(tokenizer)
        self._token_text = TokenText(tokenizer)
        self._grammars = JsonGrammars(tokenizer, self._stop_tokens)
        self._created = int(time.time())
        self._mtp_depth = served.mtp_depth  # for requests that do not name theirs
        self._mtp_head = served.mtp_head  # False: the model has no MTP head, no request drafts

    # --- OpenAI endpoints -------------------------------------------------------------------

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        max_context = self._engine.max_context
        chat = parse_chat_request(
            await request.read(), model_id=self._model_id, max_context=max_context
        )
        prompt = render_chat_prompt(self._tokenizer, chat)
        reply = ChatReply(prompt, chat.offered_tools, single_call=not chat.parallel_tool_calls)
        fmt = ChatFormat(chat.params.model, reply, self._token_text)
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
        return await self._generate(
            request, prompt.tokens, chat.params, fmt, constraint, prompt.boundaries
        )

    async def completions(self, request: web.Request) -> web.StreamResponse:
        max_context = self._engine.max_context
        completion = parse_completion_request(
            await request.read(), model_id=self._model_id, max_context=max_context
        )
        params = completion.params
        fmt = TextFormat(params.model, self._token_text, params.top_logprobs or 0)
        return await self._generate(request, self._text_prompt(completion), completion.params, fmt)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(model_list(self._model_id, self._created))

    # --- cluster endpoints ------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        """200 "ok" when every node is up and warm; 503 "degraded" while one is not up (the
        pipeline needs all), else 503 "warming" (with its progress) while they warm up."""
        nodes = self._view.node_statuses()
        healthy = bool(nodes) and all(node.up for node in nodes)
        body = {
            "status": "ok" if healthy else "degraded",
            "model": self._model_id,
            "nodes": [{"node_id": n.node_id, "address": n.address, "up": n.up} for n in nodes],
        }
        if healthy and self.warmup is not None and self.warmup.state == "warming":
            healthy = False
            body |= {"status": "warming", "warmup": self.warmup.as_json()}
        return web.json_response(body, status=200 if healthy else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        text = render_prometheus(
            self._view,
            self._counters,
            requests_queued=self._admission.queued,
            requests_running=self._admission.running,
        )
        if self.warmup is not None:
            text += self.warmup.prometheus()
        return web.Response(body=text.encode(), headers={"Content-Type": PROMETHEUS_CONTENT_TYPE})

    async def cluster(self, request: web.Request) -> web.Response:
        body = cluster_json(self._view)
        if self.warmup is not None:
            body["warmup"] = self.warmup.as_json()
        body["admission"] = {
            "running": self._admission.running,
            "queued": self._admission.queued,
            "max_running": self._admission.max_running,
            "max_queued": self._admission.max_queued,
            "max_context": self._engine.max_context,
        }
        body["model"] = {
            "id": self._model_id,
            "mtp_head": self._mtp_head,
            "note": None if self._mtp_head else NO_MTP_HEAD,
        }
        return web.json_response(body, headers={"Cache-Control": "no-store"})

    async def history_json(self, request: web.Request) -> web.Response:
        body = self.history.as_json()
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
        boundaries: tuple[int, ...] = (),
    ) -> GenerationRequest:
        """Check the context budget here, before a slot is taken, and build the request.

        The limit is the longest request served (`--max-context`: the nodes' memory is planned
        for it), so a request beyond it is refused here and never runs a node out of memory."""
        max_context = self._engine.max_context
        room = max_context - len(prompt)
        max_tokens = params.max_tokens if params.max_tokens is not None else room
        if max_tokens > room or room < 1:
            asked = (
                f"max_tokens ({max_tokens})"
                if params.max_tokens is not None
                else "at least one token to generate"
            )
            raise ApiError(
                400,
                f"prompt ({len(prompt)} tokens) + {asked} exceeds --max-context {max_context}: "
                f"this cluster serves requests of at most {max_context} tokens, prompt and "
                "completion together",
                param="max_tokens" if params.max_tokens is not None else "prompt",
                code="context_length_exceeded",
            )
        depth = self._depth(params)
        if not self._mtp_head:  # asked or not, nothing to draft with: no drafts, no MTP steps
            depth = 0
        options = RequestOptions(
            sampling=params.sampling,
            mtp=params.mtp and self._mtp_head,
            logprobs=params.top_logprobs is not None,
            top_logprobs=params.top_logprobs or 0,
            mtp_depth=depth,
        )
        stop_tokens = frozenset() if params.ignore_eos else self._stop_tokens
        try:
            return GenerationRequest(
                prompt,
                max_tokens,
                options,
                stop_tokens,
                constraint=constraint,
                boundaries=boundaries,
            )
        except RequestError as exc:
            raise ApiError(400, str(exc), code="invalid_request") from exc

    async def _generate(
        self,
        request: web.Request,
        prompt: tuple[int, ...],
        params: CommonParams,
        fmt: ResponseObjects,
        constraint: TokenConstraint | None = None,
        boundaries: tuple[int, ...] = (),
    ) -> web.StreamResponse:
        generation = self._generation_request(prompt, params, constraint, boundaries)
        # Timed from here: the wait for a slot is part of the client's time to first token.
        timed = self.history.recorder.timed(self._engine)
        async with self._admission.slot():
            self._counters.in_flight += 1
            self._counters.prompt_tokens_total += len(prompt)
            stream = TextStream(timed, self._tokenizer, generation, params.stop)
            try:
                if params.stream:
                    return await self._send_events(request, stream, params, fmt, len(prompt))
                mtp = self._mtp_asked(params)
                return await self._send_whole(request, stream, fmt, len(prompt), mtp)
            finally:
                try:
                    # Cancels the request on every node if still running, else releases it
                    # (keeping the conversation's snapshot). A client that hangs up once the
                    # response is out cancels this handler: that must not cut the release short.
                    await asyncio.shield(stream.aclose())
                finally:
                    self._counters.in_flight -= 1
                    self._counters.completion_tokens_total += stream.completion_tokens
                    self.history.recorder.finished(timed)

    def _mtp_asked(self, params: CommonParams) -> bool:
        """Whether the request asked for MTP drafts (on, at its own depth or the server's
        above 0): its usage then reports them, 0 where none came (a model without a head)."""
        return params.mtp and self._depth(params) != 0

    def _depth(self, params: CommonParams) -> MtpDepth:
        """The request's MTP depth: its own, else the server's for its sampling."""
        if params.mtp_depth is not None:
            return params.mtp_depth
        return served_depth(self._mtp_depth, params.sampling)

    async def _send_whole(
        self,
        request: web.Request,
        stream: TextStream,
        fmt: ResponseObjects,
        prompt_tokens: int,
        mtp: bool = False,
    ) -> web.Response:
        while (text := await stream.next_text()) is not None:
            fmt.absorb(text)
            if fmt.complete:  # the rest would not be part of the reply: stop generating
                break
            if _client_gone(request):
                log.info("client went away; cancelling its request")
                break
        usage = _usage(prompt_tokens, stream, mtp)
        body = fmt.whole(stream.finish_reason or "stop", usage, stream.logprobs)
        return web.json_response(body)

    async def _send_events(
        self,
        request: web.Request,
        stream: TextStream,
        params: CommonParams,
        fmt: ResponseObjects,
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
                usage = _usage(prompt_tokens, stream, self._mtp_asked(params))
                await _send_event(response, fmt.usage(usage))
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


def _usage(prompt_tokens: int, stream: TextStream, mtp: bool) -> Usage:
    return Usage(
        prompt_tokens,
        stream.completion_tokens,
        stream.cached_tokens,
        stream.drafted,
        stream.accepted,
        mtp=mtp,
    )


def _guarded_as(path: str, keys: ApiKeys, handler: _Handler) -> _Handler:
    """`handler` needing the key that `path` needs, whatever its own path: the dashboard's
    history is as private as the rest of its data (`/api/cluster`), whether or not
    `api_keys.MONITORING_PATHS` names its route. The key check is the middleware's own."""
    check = api_key_middleware(keys)

    async def guarded(request: web.Request) -> web.StreamResponse:
        if keys.guards(path) and not keys.guards(request.path):
            return await check(request.clone(rel_url=path), lambda _as_path: handler(request))
        return await handler(request)

    return guarded


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
