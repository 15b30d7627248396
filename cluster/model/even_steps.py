"""A decode batch whose requests' steps differ in length, run as steps of one length.

A request that drafts (`[y, d]`) beside requests that do not (`[y]`) makes a batch of mixed
step shapes: its attention layers then attend request by request and write each request's keys
on their own, and its GatedDeltaNet layers leave the compiled layer step for a recurrence per
group of one shape. Where a step's cost is its graph's ops (MLX CUDA), that costs such a
batch 2-4x a batch of one shape, and the adaptive depth's probes (`cluster.decode.mtp_depth`)
make it at every concurrency.

`EvenSteps` runs such a batch as one shape: every step is padded to the longest, with zero rows
after its own, and once the layers ran, each padded request's padding is undone as a rejected
draft is (`RequestCache.drop_padding`): its attention caches trim it, and each GatedDeltaNet
layer takes the state it recorded after the request's own positions. For that the steps must
agree on their confirmed tokens (drafts differ): the padded step records the state after each
prefix from there on, so after every request's own length.

The real rows compute what they would alone: the padding follows them, so causal attention and
the recurrence never carry it back into them, and the dense layers work row by row (on the CPU
bit for bit; on CUDA the matmuls of another row count sum in another order, as any batch size
would). What it costs is the padded rows' dense work, which a host-bound step does not feel.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import mlx.core as mx

from cluster.model.compiled_steps import MAX_COMPILED_POSITIONS
from cluster.model.layers import Segment

__all__ = ["EvenSteps"]


@dataclass(frozen=True, slots=True)
class EvenSteps:
    """A batch's steps padded to one length: `segments` as the layers take them, `lengths`
    each step's own."""

    segments: list[Segment]
    lengths: tuple[int, ...]

    @classmethod
    def of(cls, segments: list[Segment]) -> EvenSteps | None:
        """The padded batch where `segments` differ in length, share their confirmed count,
        are short enough for the compiled steps, and carry no verdict still on the device
        (its attention mask covers the step's own positions only); None where not."""
        lengths = tuple(seg.length for seg in segments)
        longest, confirmed = max(lengths), segments[0].n_confirmed
        if (
            len(set(lengths)) == 1
            or longest > MAX_COMPILED_POSITIONS
            or any(seg.n_confirmed != confirmed for seg in segments)
            or any(seg.cache.deferred is not None for seg in segments)
        ):
            return None
        return cls([Segment(seg.cache, longest, confirmed) for seg in segments], lengths)

    @property
    def longest(self) -> int:
        return self.segments[0].length

    def pad(self, x: mx.array) -> mx.array:
        """The packed stream `x` [1, sum(lengths), ...] with each step's zero rows after it."""
        zero = mx.zeros((1, 1, *x.shape[2:]), x.dtype)
        return mx.take(mx.concatenate([x, zero], axis=1), _padded_rows(self.lengths), axis=1)

    def unpad(self, out: mx.array) -> mx.array:
        """The layers' output `out` with each step's own rows only, packed as `x` was."""
        return mx.take(out, _own_rows(self.lengths), axis=1)

    def drop_padding(self) -> None:
        """Undo every padded request's padding in its caches (after the layers ran)."""
        for seg, length in zip(self.segments, self.lengths, strict=True):
            if length < seg.length:
                seg.cache.drop_padding(seg.length - length)


@functools.lru_cache(maxsize=256)
def _padded_rows(lengths: tuple[int, ...]) -> mx.array:
    """For each row of the padded stream, its row of the packed one; padding reads the row
    past the end (the zero row `pad` appends)."""
    longest, zero = max(lengths), sum(lengths)
    rows, start = [], 0
    for length in lengths:
        rows += [*range(start, start + length), *[zero] * (longest - length)]
        start += length
    return mx.array(rows)


@functools.lru_cache(maxsize=256)
def _own_rows(lengths: tuple[int, ...]) -> mx.array:
    longest = max(lengths)
    return mx.array([i * longest + t for i, length in enumerate(lengths) for t in range(length)])
