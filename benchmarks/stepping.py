"""Single decode steps timed side by side: live requests stepped by hand on a bare runner, and
mlx-lm's forward beside them, the kinds interleaved call by call.

What the step-cost benchmarks share (`step_profile`, `mtp_depth_bench`'s steps by
positions). Each kind is its own live requests on one runner, and `interleaved` times the
kinds in turns, so the load of a shared machine falls on all of them alike. The runner is
the engine's (its shard loaded for decoding, as a node loads it) but builds nothing ahead: a
step built ahead for one kind's requests would be undone by the next kind's call and counted
in both.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import TypeVar

import mlx.core as mx

from benchmarks import random_checkpoint
from benchmarks.common import load_tokenizer
from cluster.config import load_model_config
from cluster.decode.runner import ShardRunner
from cluster.messages import RequestOptions, SamplingParams, StepRequest
from cluster.model.fast_path import DecodeFastPath
from cluster.model.loading import load_shard
from cluster.model.shard import ShardSpec

K = TypeVar("K", bound=Hashable)

FRESH_AFTER = 256  # positions: a request's context stays short, its step cost steady


def prompt_ids(model_dir: Path, text: str) -> tuple[int, ...]:
    """`text` through the model's tokenizer; on a random checkpoint, whose synthetic tokenizer
    knows no words of it, the benchmarks' random prompt of 64 ids."""
    if random_checkpoint.is_random_checkpoint(model_dir):
        vocab = load_model_config(model_dir).text.vocab_size
        return random_checkpoint.bench_prompt(vocab, 64)
    return tuple(load_tokenizer(model_dir).encode(text))


def bare_runner(model_dir: Path, fast_path: DecodeFastPath | None = None) -> ShardRunner:
    """The whole model as the engine loads it (its fast path the device's unless given), each
    step timed alone (nothing built ahead)."""
    spec = ShardSpec.whole(load_model_config(model_dir).num_layers)
    shard = load_shard(model_dir, spec, for_decoding=True, fast_path=fast_path)
    return ShardRunner(shard, lookahead=False)


class SteppedRequests:
    """`size` live requests on a bare runner, stepped together by hand and sampled as
    `sampling` says (greedy by default; each request its own seed). Each step feeds every
    request its last token and the tail's own drafts for it (`depth` of them; None: MTP off;
    a tuple: each request's), with the rollback of the drafts the last step rejected. Once
    their context passes `FRESH_AFTER` positions they are released and fresh ones opened on
    the same prompt. A call is one step; it returns the step's seconds."""

    def __init__(
        self,
        runner: ShardRunner,
        ids: tuple[int, ...],
        *,
        size: int = 1,
        depth: int | tuple[int | None, ...] | None = None,
        sampling: SamplingParams | None = None,
        name: str = "stepped",
    ):
        self.runner, self.ids, self.size = runner, ids, size
        self.depths = depth if isinstance(depth, tuple) else (depth,) * size
        if len(self.depths) != size:
            raise ValueError(f"{len(self.depths)} depths for {size} requests")
        self.sampling, self.name = sampling or SamplingParams(), name
        self.opened = 0
        self._open()

    def _options(self, depth: int | None, seed: int) -> RequestOptions:
        sampling = dataclasses.replace(self.sampling, seed=seed)
        if depth is None:
            return RequestOptions(sampling, mtp=False)
        return RequestOptions(sampling, mtp=True, mtp_depth=depth)

    def _open(self) -> None:
        first = self.opened * self.size
        self.opened += 1
        self.steps = [
            StepRequest(f"{self.name}-{n}", self.ids, 0, options=self._options(depth, n))
            for n, depth in enumerate(self.depths, start=first)
        ]
        self.results = self.runner.run(self.steps).results

    def __call__(self) -> float:
        if self.steps[0].position > FRESH_AFTER:
            for step in self.steps:
                self.runner.release(step.request_id)
            self._open()
        steps = []
        for step, result in zip(self.steps, self.results, strict=True):
            tokens = (result.tokens[-1], *result.drafts)
            steps.append(
                StepRequest(
                    step.request_id,
                    tokens,
                    step.position + result.keep,
                    draft_len=len(tokens) - 1,
                    rollback=len(step.tokens) - result.keep,
                )
            )
        t0 = time.perf_counter()
        self.results = self.runner.run(steps).results
        elapsed = time.perf_counter() - t0
        self.steps = steps
        return elapsed


class LMForward:
    """mlx-lm's forward over `size` sequences of `tokens` tokens each on a warm cache (the
    prompt, rebuilt every 64 calls so that the context stays short). A call returns seconds."""

    def __init__(self, model, ids: tuple[int, ...], *, size: int = 1, tokens: int = 1):
        self.model, self.ids, self.size, self.tokens = model, ids, size, tokens
        self.calls = 0

    def __call__(self) -> float:
        from mlx_lm.models.cache import make_prompt_cache

        if self.calls % 64 == 0:
            self.cache = make_prompt_cache(self.model)
            prompt = mx.repeat(mx.array(self.ids)[None], self.size, axis=0)
            mx.eval(self.model(prompt, cache=self.cache))
        self.calls += 1
        x = mx.full((self.size, self.tokens), self.ids[-1], dtype=mx.int32)
        t0 = time.perf_counter()
        mx.eval(self.model(x, cache=self.cache))
        return time.perf_counter() - t0


def interleaved(
    kinds: dict[K, Callable[[], float]],
    iters: int,
    warmup: int = 3,
    seed: int = 0,
    before: Callable[[K], None] | None = None,
) -> dict[K, list[float]]:
    """Every kind called once per round in a shuffled order (a fixed seed), `warmup` rounds
    first; the seconds each call returned, by kind. `before(kind)` runs ahead of each call."""
    times: dict[K, list[float]] = {kind: [] for kind in kinds}
    order, rng = list(kinds), random.Random(seed)
    for i in range(warmup + iters):
        rng.shuffle(order)
        for kind in order:
            if before is not None:
                before(kind)
            elapsed = kinds[kind]()
            if i >= warmup:
                times[kind].append(elapsed)
    return times
