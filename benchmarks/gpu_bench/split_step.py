"""A decode step split in two halves in one process, as two nodes run it: what the split costs
(`split_steps`), and what a node's idling between its steps costs (`idle_steps`).

Both are `gpu_bench --diagnose` phases; they run on the calling thread (an MLX worker's), one
request, greedy, with no network, so that what they find is the step's own and not a hop's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np

from benchmarks.common import median
from cluster.config import load_model_config
from cluster.decode.worker import busy_without_gil
from cluster.model import shard as model_shard
from cluster.model.cache import RequestCache
from cluster.model.layers import Segment
from cluster.model.loading import load_shard
from cluster.model.shard import ShardSpec

# `ModelShard`'s `async_eval` schedules that `split_steps` sets side by side: (the first
# chunk tapered, the last chunk tapered); "last" is the default.
SCHEDULES = {"every": (False, False), "last": (False, True), "both": (True, True)}


class DecodingShard:
    """A shard with one request's cache, prefilled; `run` steps it (and a tail on to its
    greedy token), evaluated."""

    def __init__(self, path: Path, spec: ShardSpec, x: mx.array) -> None:
        self.shard = load_shard(path, spec, mtp=False, for_decoding=True)
        self.cache = RequestCache.for_layers(self.shard.linear_flags)
        self.output = self.run(self.shard.embed(x) if spec.is_head else x)

    def run(self, x: mx.array) -> mx.array:
        length = x.shape[1]
        self.cache.begin_step(0, length)
        out = self.shard(x, [Segment(self.cache, length, length)])
        if self.shard.spec.is_tail:  # through to the greedy token, as a tail's step
            out = mx.argmax(self.shard.logits(self.shard.norm(out[:, -1])), axis=-1)
        mx.eval(out, self.cache.arrays())
        return out


class SplitModel:
    """The model's two halves, prefilled with `prompt`, stepped as the two nodes step them:
    the head from a token to its output read back as bytes, the tail from those bytes to its
    greedy token."""

    def __init__(self, path: Path, prompt: tuple[int, ...]) -> None:
        layers = load_model_config(path).num_layers
        self.prompt = mx.array(prompt)[None]
        self.head = DecodingShard(path, ShardSpec(0, layers // 2, True, False), self.prompt)
        self.tail = DecodingShard(
            path, ShardSpec(layers // 2, layers, False, True), self.head.output
        )
        self._shape, self._dtype = self.head.output[:, -1:].shape, self.head.output.dtype

    def head_step(self, token: int) -> bytes:
        out = self.head.run(self.head.shard.embed(mx.array([[token]])))
        return bytes(memoryview(out))

    def tail_step(self, sent: bytes) -> int:
        received = mx.array(np.frombuffer(sent, np.uint8)).view(self._dtype)
        return self.tail.run(received.reshape(self._shape)).item()


def _next_token(token: int) -> int:
    """A random checkpoint's greedy tokens can settle into a loop; keep the ids moving."""
    return 5 + token % 4000


def split_steps(path: Path, prompt: tuple[int, ...], rounds: int, iters: int = 30) -> dict:
    """A decode step over the model's two halves as two nodes run them (the head's output
    read back to the host as bytes, the tail's input uploaded from them, its greedy token
    read) against the whole model's, under each of `SCHEDULES` in rotating order, round after
    round: what splitting a step costs beyond the hop, and what tapering buys there."""
    split = SplitModel(path, prompt)
    whole = DecodingShard(path, ShardSpec.whole(load_model_config(path).num_layers), split.prompt)
    rows: dict[str, list[dict[str, float]]] = {name: [] for name in SCHEDULES}
    names = list(SCHEDULES)
    token = 7
    default = model_shard.TAPER_FIRST_CHUNK, model_shard.TAPER_LAST_CHUNK
    try:
        for r in range(rounds + 1):  # round 0 warms every schedule
            for name in names[r % len(names) :] + names[: r % len(names)]:
                model_shard.TAPER_FIRST_CHUNK, model_shard.TAPER_LAST_CHUNK = SCHEDULES[name]
                times: dict[str, list[float]] = {"head": [], "tail": [], "whole": []}
                for _ in range(iters):
                    t0 = time.perf_counter()
                    sent = split.head_step(token)
                    t1 = time.perf_counter()
                    next_token = split.tail_step(sent)
                    t2 = time.perf_counter()
                    whole.run(whole.shard.embed(mx.array([[token]]))).item()
                    t3 = time.perf_counter()
                    for key, seconds in (("head", t1 - t0), ("tail", t2 - t1), ("whole", t3 - t2)):
                        times[key].append(seconds * 1e3)
                    token = _next_token(next_token)
                row = {key: median(v[iters // 5 :]) for key, v in times.items()}
                row["halves_over_whole"] = (row["head"] + row["tail"]) / row["whole"]
                if r:
                    rows[name].append(row)
    finally:
        model_shard.TAPER_FIRST_CHUNK, model_shard.TAPER_LAST_CHUNK = default
    keys = list(rows["every"][0])
    return {
        "rounds": rows,
        "medians": {
            name: {key: median([row[key] for row in runs]) for key in keys}
            for name, runs in rows.items()
        },
        "over_every": {
            name: {
                key: median([t[key] / e[key] for e, t in zip(rows["every"], runs, strict=True)])
                for key in keys
            }
            for name, runs in rows.items()
            if name != "every"
        },
    }


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _spin_without_gil(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        busy_without_gil()


# How the host spends the wait before each half's step in `idle_steps`.
WAITS: dict[str, Callable[[float], None]] = {
    "back_to_back": lambda seconds: None,
    "idle": time.sleep,  # as a node's threads waited for their next message (`--spin-ms 0`)
    "busy": _spin,  # this thread kept running (and the device idle) for as long
    "busy_without_gil": _spin_without_gil,  # as a node's MLX thread waits (`MLXWorker`)
}


def idle_steps(
    path: Path, prompt: tuple[int, ...], rounds: int, iters: int = 30, gap_ms: float | None = None
) -> dict:
    """Each half's step back to back, and after a wait of `gap_ms` (by default one half's
    step, about what a node of two waits while the other computes) spent asleep or spinning,
    the kinds of `WAITS` in rotating order, round after round. A node's step always follows
    such a wait; one process's never does: what the idling costs a node's step, and whether
    it is the host (spinning keeps it running) or the device (idle either way)."""
    split = SplitModel(path, prompt)
    token = 7
    if gap_ms is None:  # one half's step, back to back, once warm
        pairs = []
        for _ in range(8):
            t0 = time.perf_counter()
            token = _next_token(split.tail_step(split.head_step(token)))
            pairs.append(time.perf_counter() - t0)
        gap_ms = median(pairs[3:]) / 2 * 1e3
    gap = gap_ms / 1e3
    names = list(WAITS)
    rows: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    for r in range(rounds + 1):  # round 0 warms every kind
        for name in names[r % len(names) :] + names[: r % len(names)]:
            wait = WAITS[name]
            times: dict[str, list[float]] = {"head": [], "tail": []}
            for _ in range(iters):
                wait(gap)
                t0 = time.perf_counter()
                sent = split.head_step(token)
                t1 = time.perf_counter()
                wait(gap)
                t2 = time.perf_counter()
                token = _next_token(split.tail_step(sent))
                times["head"].append((t1 - t0) * 1e3)
                times["tail"].append((time.perf_counter() - t2) * 1e3)
            if r:
                rows[name].append({key: median(v[iters // 5 :]) for key, v in times.items()})
    medians = {
        name: {key: median([row[key] for row in runs]) for key in ("head", "tail")}
        for name, runs in rows.items()
    }
    return {
        "gap_ms": gap_ms,
        "rounds": rows,
        "medians": medians,
        "over_back_to_back": {
            name: {key: value / medians["back_to_back"][key] for key, value in row.items()}
            for name, row in medians.items()
            if name != "back_to_back"
        },
    }
