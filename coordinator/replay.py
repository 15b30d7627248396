"""Replay: a request whose pipeline failed continues on the next one, losing nothing.

The coordinator keeps, for each running request, what a new pipeline needs to continue it:
the prompt (in the request), the tokens emitted so far, the MTP drafts its next step was to
verify, and its sampling state (the options; seeded sampling is keyed by position, see
cluster.decode.sampling). When a node dies or stops answering, the request's stream meets
`NodeUnavailable`; it then waits until the coordinator has placed the model again and
re-prefills prompt + emitted there (`GenerationEngine.stream(resume=...)`). The client sees a
pause, not an error, and the same tokens as if nothing had happened. Only when the model
cannot be placed again does the request fail, with an error that says why.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Protocol

from cluster.decode.engine import GenerationChunk, GenerationEngine, GenerationRequest, ResumePoint
from cluster.decode.pipeline import Pipeline
from cluster.decode.prefix_index import PrefixIndex
from cluster.transport.node_client import NodeUnavailable

log = logging.getLogger(__name__)


class Replacement(Protocol):
    """Who places the model again (the coordinator)."""

    async def restored(self, failed: Pipeline, error: NodeUnavailable) -> None:
        """Return once a pipeline other than `failed` serves; raise `NodeUnavailable`
        (saying why) when none will."""
        ...


class ReplayingEngine:
    """`GenerationEngine.stream` that survives node losses by replaying on the new pipeline."""

    def __init__(self, engine: GenerationEngine, replacement: Replacement) -> None:
        self.engine = engine
        self.replacement = replacement
        self.replays_total = 0  # requests continued on a new pipeline
        self.replays_failed = 0  # requests that could not be continued

    @property
    def max_context(self) -> int:
        return self.engine.max_context

    @property
    def pipeline(self) -> Pipeline:
        return self.engine.pipeline

    @property
    def prefix_index(self) -> PrefixIndex | None:
        return self.engine.prefix_index

    # A whole request, as GenerationEngine runs it, over the replaying stream.
    generate = GenerationEngine.generate

    async def stream(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        request = with_seed(request)
        point = ResumePoint()
        while True:
            pipeline = self.engine.pipeline
            chunks = self.engine.stream(request, resume=point)
            try:
                async for chunk in chunks:
                    point = ResumePoint(
                        point.emitted + chunk.tokens, chunk.drafts, chunk.drafted, chunk.accepted
                    )
                    yield chunk
                return
            except NodeUnavailable as error:
                lost = error
            finally:
                await chunks.aclose()
            log.info(
                "request %s lost its pipeline after %d token(s): %s",
                request.request_id,
                len(point.emitted),
                lost,
            )
            try:
                await self.replacement.restored(pipeline, lost)
            except NodeUnavailable:
                self.replays_failed += 1
                raise
            self.replays_total += 1
            log.info("replaying request %s on the new placement", request.request_id)


def with_seed(request: GenerationRequest) -> GenerationRequest:
    """A sampled request without a seed gets one here, so that a replay continues it exactly
    too (its tokens are still random: the seed is)."""
    sampling = request.options.sampling
    if sampling.greedy or sampling.seed is not None:
        return request
    seed = int.from_bytes(os.urandom(8), "little") >> 1
    options = replace(request.options, sampling=replace(sampling, seed=seed))
    return replace(request, options=options)
