"""The OpenAI wire format: request bodies in, response objects out, errors as OpenAI bodies.

Parsing is strict: a field we do not know, or one we cannot honour as asked, is refused
rather than silently dropped (OpenAI itself refuses unknown fields); it is lenient only where
nothing is lost (an omitted `model` on a single-model server, a penalty of 0). Every refusal is
an `ApiError`, rendered as the body that OpenAI clients know how to surface:
`{"error": {"message", "type", "param", "code"}}`. The chat body's own fields (messages,
tools, templates) are read in `coordinator.chat_request`.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from cluster.messages import MAX_MTP_DEPTH, MAX_TOP_LOGPROBS, MtpDepth, RequestError, SamplingParams

MAX_STOP_STRINGS = 4  # OpenAI's limit; each one costs a scan of the held-back text
# The fields both endpoints read; each endpoint adds its own (see `check_fields`).
COMMON_FIELDS = frozenset({
    "model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stream",
    "stream_options", "n", "user", "frequency_penalty", "presence_penalty", "logit_bias",
    "mtp_depth", "mtp", "ignore_eos",
})  # fmt: skip


class ApiError(Exception):
    """A request the API refuses or could not serve, with its HTTP status and OpenAI body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


@dataclass(frozen=True, slots=True)
class CommonParams:
    """What chat and text completions share: sampling, limits, stop strings, streaming."""

    model: str
    max_tokens: int | None  # None: as many as the context allows
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage
    ignore_eos: bool = False  # vLLM's extension: generate max_tokens, stop tokens or not
    mtp: bool = True  # this cluster's extension: False runs the request without the MTP head
    top_logprobs: int | None = None  # None: no logprobs; n: the token's and the n likeliest
    mtp_depth: MtpDepth | None = None  # MTP drafts per step (an extension); None: the server's


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    prompt: str | tuple[int, ...]  # text, or token ids as OpenAI also accepts
    params: CommonParams


def parse_completion_request(raw: bytes, *, model_id: str, max_context: int) -> CompletionRequest:
    """Parse a `/v1/completions` body (one prompt: a string or a list of token ids)."""
    body = json_object(raw)
    check_fields(body, COMMON_FIELDS | {"prompt", "logprobs", "echo", "suffix", "best_of"})
    if body.get("best_of") not in (None, 1):
        raise invalid("'best_of' must be 1", "best_of")
    if body.get("echo") not in (None, False):
        raise unsupported("echo is not supported by this server", "echo")
    if body.get("suffix") not in (None, ""):
        raise unsupported("suffix is not supported by this server", "suffix")
    prompt = _prompt(body.get("prompt"))
    params = common_params(body, model_id=model_id, max_context=max_context)
    top = optional(body, "logprobs", int, None)  # completions: the number of alternatives
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise invalid(f"'logprobs' must be in [0, {MAX_TOP_LOGPROBS}]", "logprobs")
    return CompletionRequest(prompt, replace(params, top_logprobs=top))


def check_fields(body: Mapping[str, Any], known: frozenset[str]) -> None:
    """Refuse a field this server does not read: dropping it would change what was asked."""
    for name in body:
        if name not in known:
            raise ApiError(
                400,
                f"Unrecognized request argument supplied: {name}",
                param=name,
                code="unknown_parameter",
            )


def json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError) as exc:
        raise invalid(f"the request body is not valid JSON: {exc}", None) from exc
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object", None)
    return body


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON")


def _prompt(prompt: object) -> str | tuple[int, ...]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise invalid("'prompt' must not be empty", "prompt")
        return prompt
    if isinstance(prompt, list) and prompt and all(is_int(t) and t >= 0 for t in prompt):
        return tuple(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise invalid("only one prompt per request is supported", "prompt")
    raise invalid("'prompt' must be a non-empty string or array of token ids", "prompt")


def common_params(body: dict[str, Any], *, model_id: str, max_context: int) -> CommonParams:
    """What both endpoints read alike; no logprobs (each endpoint asks for them its own way)."""
    model = _model(body.get("model"), model_id)
    if body.get("n") not in (None, 1):
        raise invalid("'n' must be 1", "n")
    max_tokens = _max_tokens(body, max_context)
    stream = optional(body, "stream", bool, False)
    options = optional(body, "stream_options", dict, {})
    if set(options) - {"include_usage"}:
        unknown = sorted(set(options) - {"include_usage"})
        raise invalid(
            f"'stream_options' takes only 'include_usage', not {unknown}", "stream_options"
        )
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise invalid("'stream_options.include_usage' must be a boolean", "stream_options")
    sampling = _sampling(body)
    _no_op_only(body)
    ignore_eos = optional(body, "ignore_eos", bool, False)
    if ignore_eos and max_tokens is None:
        raise invalid("'ignore_eos' needs 'max_tokens'", "ignore_eos")
    return CommonParams(
        model, max_tokens, sampling, _stop(body.get("stop")), stream, include_usage,
        ignore_eos=ignore_eos, mtp=optional(body, "mtp", bool, True),
        mtp_depth=_mtp_depth(body.get("mtp_depth")),
    )  # fmt: skip


def _mtp_depth(value: object) -> MtpDepth | None:
    """This server's extension: MTP drafts per step, 0..MAX_MTP_DEPTH or "auto"."""
    if value is None:
        return None
    if value == "auto" or (is_int(value) and 0 <= value <= MAX_MTP_DEPTH):
        return value
    raise invalid(f"'mtp_depth' must be an integer in [0, {MAX_MTP_DEPTH}] or 'auto'", "mtp_depth")


def _no_op_only(body: dict[str, Any]) -> None:
    """Fields we accept only at their no-op value; any other value would be ignored."""
    for name in ("frequency_penalty", "presence_penalty"):
        if optional_number(body, name, 0.0) != 0.0:
            raise unsupported(f"'{name}' is not supported by this server (only 0)", name)
    if body.get("logit_bias") not in (None, {}):
        raise unsupported("'logit_bias' is not supported by this server", "logit_bias")
    optional(body, "user", str, None)  # an end-user id for the operator's logs; no effect


def _model(model: object, model_id: str) -> str:
    if model is None:
        return model_id  # one model is served, so an omitted model is unambiguous
    if not isinstance(model, str):
        raise invalid("'model' must be a string", "model")
    if model != model_id:
        raise ApiError(
            404,
            f"The model '{model}' does not exist; this server serves '{model_id}'",
            param="model",
            code="model_not_found",
        )
    return model


def _max_tokens(body: dict[str, Any], max_context: int) -> int | None:
    """`max_completion_tokens` is the current name and wins over the deprecated `max_tokens`."""
    for name in ("max_completion_tokens", "max_tokens"):
        value = body.get(name)
        if value is None:
            continue
        if not is_int(value) or value < 1:
            raise invalid(f"'{name}' must be a positive integer", name)
        if value > max_context:
            raise invalid(
                f"'{name}' is {value}, beyond --max-context {max_context}: this cluster "
                f"serves requests of at most {max_context} tokens, prompt and completion "
                "together",
                name,
                code="context_length_exceeded",
            )
        return value
    return None


def _sampling(body: dict[str, Any]) -> SamplingParams:
    temperature = optional_number(body, "temperature", 1.0)
    if temperature < 0 or temperature > 2:
        raise invalid("'temperature' must be in [0, 2]", "temperature")
    top_p = optional_number(body, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise invalid("'top_p' must be in (0, 1]", "top_p")
    top_k = optional(body, "top_k", int, 0)
    if top_k < -1:
        raise invalid("'top_k' must be >= 0 (or -1 for no limit)", "top_k")
    min_p = optional_number(body, "min_p", 0.0)
    if not 0 <= min_p < 1:
        raise invalid("'min_p' must be in [0, 1)", "min_p")
    seed = body.get("seed")
    if seed is not None and not (is_int(seed) and 0 <= seed < 2**63):
        raise invalid("'seed' must be an integer in [0, 2**63)", "seed")
    try:
        return SamplingParams(temperature, top_p, max(top_k, 0), min_p, seed)
    except RequestError as exc:  # the core's own checks, should they ever be stricter
        raise invalid(str(exc), None) from exc


def _stop(stop: object) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise invalid("'stop' must be a string or an array of strings", "stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise invalid(f"'stop' may hold at most {MAX_STOP_STRINGS} strings", "stop")
    if any(not s for s in stops):
        raise invalid("'stop' strings must not be empty", "stop")
    return tuple(dict.fromkeys(stops))


def optional(body: dict[str, Any], name: str, kind: type, default: Any) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if kind is int and not is_int(value):
        raise invalid(f"'{name}' must be an integer", name)
    if not isinstance(value, kind):
        raise invalid(f"'{name}' must be of type {_JSON_TYPE[kind]}", name)
    return value


def optional_number(body: dict[str, Any], name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise invalid(f"'{name}' must be a number", name)
    return float(value)


def is_int(value: object) -> bool:
    """JSON integers only: Python's bool is an int, but `true` is not a token count."""
    return isinstance(value, int) and not isinstance(value, bool)


_JSON_TYPE = {bool: "boolean", dict: "object", int: "integer", str: "string"}


def invalid(message: str, param: str | None, *, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def unsupported(message: str, param: str) -> ApiError:
    return ApiError(400, message, param=param, code="unsupported_parameter")


# --- responses ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts; MTP drafts are OpenAI's prediction tokens (accepted or rejected).

    The drafts' counts (`completion_tokens_details`) are there whenever the request asked for
    MTP (`mtp`), 0 and 0 when nothing was drafted (a model without an MTP head), so that a
    client can tell "no drafts" from "not asked"; and whenever something was drafted.
    """

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens served from the conversation cache
    drafted: int = 0
    accepted: int = 0
    mtp: bool = False  # the request asked for MTP drafts

    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }
        if self.drafted or self.mtp:
            body["completion_tokens_details"] = {
                "accepted_prediction_tokens": self.accepted,
                "rejected_prediction_tokens": self.drafted - self.accepted,
            }
        return body


@dataclass(frozen=True, slots=True)
class ResponseIdentity:
    """What every object of one response carries alike: chunks of a stream share id and time."""

    id: str
    created: int
    model: str

    @classmethod
    def new(cls, prefix: str, model: str) -> ResponseIdentity:
        return cls(f"{prefix}-{uuid.uuid4().hex}", int(time.time()), model)

    def header(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}


def chat_completion(
    ident: ResponseIdentity,
    message: str | dict[str, Any],
    finish_reason: str,
    usage: Usage,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A whole chat completion; `message` is the assistant's text or its whole message."""
    if isinstance(message, str):
        message = {"role": "assistant", "content": message}
    choice = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}
    return {**ident.header("chat.completion"), "choices": [choice], "usage": usage.body()}


def chat_chunk(
    ident: ResponseIdentity,
    delta: dict[str, Any],
    finish_reason: str | None = None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One streamed choice delta: `{"role": ...}` first, then content, reasoning or calls."""
    choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    return {**ident.header("chat.completion.chunk"), "choices": [choice]}


def chat_usage_chunk(ident: ResponseIdentity, usage: Usage) -> dict[str, Any]:
    """The last chunk when `stream_options.include_usage` is set: no choices, only usage."""
    return {**ident.header("chat.completion.chunk"), "choices": [], "usage": usage.body()}


def text_completion(
    ident: ResponseIdentity,
    text: str,
    finish_reason: str | None,
    usage: Usage | None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A whole text completion, or (usage None) one streamed piece of it: same object type."""
    choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    body = {**ident.header("text_completion"), "choices": [choice]}
    if usage is not None:
        body["usage"] = usage.body()
    return body


def text_usage_chunk(ident: ResponseIdentity, usage: Usage) -> dict[str, Any]:
    return {**ident.header("text_completion"), "choices": [], "usage": usage.body()}


def model_list(model_id: str, created: int) -> dict[str, Any]:
    entry = {"id": model_id, "object": "model", "created": created, "owned_by": "cluster"}
    return {"object": "list", "data": [entry]}
