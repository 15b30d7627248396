"""The internal messages of one pipeline step, shared by the engine, the shards and the wire.

A request moves through the pipeline as a series of steps. Each step feeds some tokens to the
head; every node runs its layers over the positions of those tokens; the tail turns the last
hidden states into tokens. These dataclasses are what the engine, the in-process pipeline and
the gRPC codec (`cluster.transport.wire`) all speak; protobuf never leaks past the codec.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

MAX_MTP_DEPTH = 8  # drafts per step; a GPU step of up to 8 rows costs about what one costs
MtpDepth = int | Literal["auto"]

MAX_TOP_LOGPROBS = 20


class RequestError(ValueError):
    """A request that cannot be served as asked (bad parameters, too long, unknown id...)."""


class UnknownRequestError(RequestError):
    """A request id that this shard does not hold (never seen, released or expired)."""


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How the tail turns a distribution into a token. temperature == 0 means greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k filter
    min_p: float = 0.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise RequestError(f"temperature must be >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise RequestError(f"top_k must be >= 0, got {self.top_k}")
        if not (0.0 <= self.min_p < 1.0):
            raise RequestError(f"min_p must be in [0, 1), got {self.min_p}")
        if self.seed is not None and not (0 <= self.seed < 2**63):
            raise RequestError(f"seed must be in [0, 2**63), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True, slots=True)
class RequestOptions:
    """What the tail must know about a request; sent once, on its first step."""

    sampling: SamplingParams = field(default_factory=SamplingParams)
    mtp: bool = True
    logprobs: bool = False
    top_logprobs: int = 0  # with logprobs: how many of the likeliest tokens come with each
    # Drafts per step when `mtp`: a fixed count (0 feeds the MTP head but never drafts), or
    # "auto": the tail picks the count that pays best (cluster.decode.mtp_depth).
    mtp_depth: MtpDepth = 1

    def __post_init__(self) -> None:
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise RequestError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]")
        if self.top_logprobs and not self.logprobs:
            raise RequestError("top_logprobs needs logprobs")
        depth = self.mtp_depth
        if depth != "auto" and not (
            isinstance(depth, int) and not isinstance(depth, bool) and 0 <= depth <= MAX_MTP_DEPTH
        ):
            raise RequestError(f"mtp_depth must be 0..{MAX_MTP_DEPTH} or 'auto', got {depth!r}")


def parse_mtp_depth(text: str) -> MtpDepth:
    """'auto' or a count, as the command line and the HTTP API take it."""
    if text == "auto":
        return "auto"
    if not text.isdigit():
        raise RequestError(f"mtp_depth must be 0..{MAX_MTP_DEPTH} or 'auto', got {text!r}")
    return RequestOptions(mtp_depth=int(text)).mtp_depth  # validated there


@dataclass(frozen=True, slots=True)
class StepRequest:
    """One request's share of a pipeline step.

    `tokens` are fed at the head at absolute positions `position ...`. The last `draft_len` of
    them are speculative drafts: every GatedDeltaNet layer keeps a snapshot of its state before
    them so that a rejection can be undone. `rollback` is the trim-and-restore signal of the
    previous step: drop that many of its trailing positions before computing this one. It rides
    on the step so that a rejection costs no message of its own.

    `next_token` is set on the last chunk of a replay's prefill (a request re-prefilled on a
    new pipeline after a node loss): the token after the chunk is already known, so the tail
    samples nothing and only makes the MTP draft that the request was about to verify.
    """

    # A new field also takes its default in `step_records._plain_step`, which builds the
    # steps of a records frame without this class's __init__.
    request_id: str
    tokens: tuple[int, ...]
    position: int
    draft_len: int = 0
    rollback: int = 0
    sample: bool = True  # False for a prefill chunk that is not the prompt's last
    options: RequestOptions | None = None  # set on the first step of a request only
    # A constrained request's allowed tokens (cluster.decode.token_mask), one bitmask per
    # sampled position: after the confirmed tokens, then after each draft.
    token_masks: tuple[bytes, ...] = ()
    # The conversation cache (cluster.decode.snapshots): open the request from the prefix
    # snapshot of this id, which holds the `position` positions before this step; keep a
    # snapshot of this id of the caches after this step. 0: none.
    prefix_from: int = 0
    prefix_save: int = 0
    next_token: int | None = None

    def __post_init__(self) -> None:
        if not self.tokens:
            raise RequestError("a step needs at least one token")
        if self.next_token is not None and (self.sample or self.draft_len):
            raise RequestError("a step with a next_token samples nothing and has no draft")
        if self.position < 0 or self.rollback < 0:
            raise RequestError("position and rollback must be >= 0")
        if not (0 <= self.draft_len < len(self.tokens)):
            raise RequestError("draft_len must leave at least one confirmed token")
        if self.token_masks and (not self.sample or len(self.token_masks) != self.draft_len + 1):
            raise RequestError("token_masks needs one mask per sampled position")
        if self.prefix_from < 0 or self.prefix_save < 0:
            raise RequestError("prefix snapshot ids must be >= 0")
        if self.prefix_from and self.position == 0:
            raise RequestError("a step that starts from a prefix snapshot has position > 0")
        if self.prefix_save and self.draft_len:
            raise RequestError("a prefix snapshot is taken after a step without drafts")

    @property
    def n_confirmed(self) -> int:
        return len(self.tokens) - self.draft_len


@dataclass(frozen=True, slots=True)
class StepResult:
    """What the tail answers for one request's step.

    `tokens` are the newly emitted tokens (accepted drafts, then the correction or bonus
    token); empty for an intermediate prefill chunk. `keep` is how many of the step's positions
    stay in the caches; the engine sends `len(step.tokens) - keep` as the next step's rollback.
    `drafts` are the MTP head's proposals for the tokens after the last emitted one (as many
    as the request's depth asks for this step; none without MTP).
    """

    request_id: str
    tokens: tuple[int, ...]
    keep: int
    drafts: tuple[int, ...] = ()
    drafted: int = 0
    accepted: int = 0
    logprobs: tuple[float, ...] | None = None
    # Per emitted token, the likeliest (token, logprob) pairs, likeliest first, when asked.
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] | None = None


@dataclass(frozen=True, slots=True)
class Release:
    """Free a request's state on every node (finished, cancelled or failed)."""

    request_id: str
