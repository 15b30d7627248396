"""What a batch costs this node, by its number of positions and its context, from the node's
own counters.

Every decode batch a shard runs is timed (from its start to its evaluated output), and on the
tail each request set's round too (from one of its batches to the next, `RoundClock`); each
is recorded under the batch's number of positions and context bucket (the batch's longest
context, by powers of two from SHORT_CONTEXT: attention reads every cached position, so a
step's cost grows with the context), as a running mean that follows the machine's load. The
round curves are what the adaptive MTP depth (cluster.decode.mtp_depth) weighs drafts
against: on a GPU bound by reading the
weights a step over 2-8 positions costs about what one costs, on this project's CPU test
machine every extra row costs about half of what the first does, and at a long context the
extra rows' attention costs more.

A count not measured in the asked bucket is read off the nearest bucket that measured it,
scaled by what the two buckets measured at a count they share (the shape of a curve moves
slowly with the context, its level does not); without such a count, as the nearest bucket
says. Reading is a few dictionary look-ups: the policy reads it per request per step.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

SMOOTHING = 0.2  # weight of a new sample in the running mean
# Contexts shorter than this share one bucket. There a step's attention costs little beside
# reading the weights, and curves split by powers of two only spread the samples thin: a
# bucket's first few samples on a busy machine can make a second row look twice its price,
# and `auto` stop drafting where it pays.
SHORT_CONTEXT = 2048
# A count is read from its own bucket once it has this many samples; before, a neighbouring
# bucket's (scaled) is preferred: one sample on a loaded machine can invert two counts.
TRUSTED_SAMPLES = 3


def context_bucket(context: int) -> int:
    """The bucket of a context of `context` positions: [2^(b-1), 2^b) is bucket b, and every
    context shorter than SHORT_CONTEXT is that one's bucket below it."""
    return max(context, SHORT_CONTEXT - 1).bit_length()


def batch_context(ends: Iterable[int]) -> int:
    """The context a batch is costed at: its longest request's (the positions after its
    step), what its attention reads most of."""
    return max(ends, default=0)


@dataclass(slots=True)
class _Curve:
    """Running mean seconds of a batch by number of positions, in one context bucket."""

    positions: list[int] = field(default_factory=list)  # measured counts, sorted
    seconds: dict[int, float] = field(default_factory=dict)
    samples: dict[int, int] = field(default_factory=dict)
    first_seen: set[int] = field(default_factory=set)  # counts whose first batch was dropped

    def record(self, positions: int, seconds: float, smoothing: float, drop_first: bool) -> None:
        if drop_first and positions not in self.first_seen:
            self.first_seen.add(positions)
            return
        old = self.seconds.get(positions)
        samples = self.samples.get(positions, 0) + 1
        self.samples[positions] = samples
        if old is None:
            bisect.insort(self.positions, positions)
            self.seconds[positions] = seconds
        else:  # the plain mean of the first samples (no first one weighs more), then running
            weight = max(smoothing, 1.0 / samples)
            self.seconds[positions] = old + weight * (seconds - old)

    def counts(self, trusted: bool) -> list[int]:
        """The measured counts; `trusted`: those with at least TRUSTED_SAMPLES samples."""
        if not trusted:
            return self.positions
        return [p for p in self.positions if self.samples[p] >= TRUSTED_SAMPLES]

    def within(self, positions: int, counts: list[int]) -> float | None:
        """Measured, or linear between two measured `counts`; None outside them."""
        i = bisect.bisect_left(counts, positions)
        if i < len(counts) and counts[i] == positions:
            return self.seconds[positions]
        if i == 0 or i == len(counts):
            return None
        lo, hi = counts[i - 1], counts[i]
        slope = (self.seconds[hi] - self.seconds[lo]) / (hi - lo)
        return self.seconds[lo] + slope * (positions - lo)

    def extrapolated(self, positions: int, counts: list[int]) -> float | None:
        """Beyond the measured `counts`, at the slope of the two nearest (never falling);
        None with fewer than two."""
        if len(counts) < 2:
            return None
        lo, hi = (counts[0], counts[1]) if positions < counts[0] else (counts[-2], counts[-1])
        slope = max((self.seconds[hi] - self.seconds[lo]) / (hi - lo), 0.0)
        return max(self.seconds[lo] + slope * (positions - lo), 0.0)


@dataclass(slots=True)
class StepCost:
    """Running mean seconds of a batch by number of positions and context bucket.

    `drop_first`: a count's first batch in a bucket is not recorded. A node's first batch of a
    shape pays for building it (kernels, compiled graphs, buffers of a new size), which says
    nothing of what the next ones cost and would weigh like a whole sample in the mean."""

    smoothing: float = SMOOTHING
    drop_first: bool = False
    _curves: dict[int, _Curve] = field(default_factory=dict)
    _buckets: list[int] = field(default_factory=list)  # sorted
    _nearest: dict[int, list[int]] = field(default_factory=dict)  # `_by_distance`, kept
    # Every batch recorded, whatever its size: what a benchmark sets against its wall time.
    total_seconds: float = 0.0
    total_batches: int = 0

    def record(self, positions: int, seconds: float, context: int = 0) -> None:
        if positions < 1 or seconds < 0:
            raise ValueError(f"a batch of {positions} positions in {seconds} s")
        self.total_seconds += seconds
        self.total_batches += 1
        bucket = context_bucket(context)
        curve = self._curves.get(bucket)
        if curve is None:
            curve = self._curves[bucket] = _Curve()
            bisect.insort(self._buckets, bucket)
            self._nearest.clear()
        curve.record(positions, seconds, self.smoothing, self.drop_first)

    def measured(self, positions: int, context: int = 0) -> bool:
        curve = self._curves.get(context_bucket(context))
        return curve is not None and positions in curve.seconds

    def seconds(self, positions: int, context: int = 0) -> float | None:
        """The expected seconds of a batch of `positions` at `context`; None where nothing
        measured tells (no bucket measured the count, nor two counts to extrapolate from).

        In the context's bucket: measured, or linear between two measured counts. Else the
        nearest bucket that has it that way, scaled to this bucket at a count both measured.
        Else extrapolated in this bucket at the slope of its two nearest counts; else in the
        nearest bucket that can, scaled the same way. All of it first from counts with
        `TRUSTED_SAMPLES` samples, then from any.
        """
        bucket = context_bucket(context)
        own = self._curves.get(bucket)
        nearest = self._by_distance(bucket)
        for trusted in (True, False):
            own_counts = own.counts(trusted) if own is not None else []
            value = own.within(positions, own_counts) if own is not None else None
            if value is not None:
                return value
            for extrapolate in (False, True):
                for other_bucket in nearest:
                    other = self._curves[other_bucket]
                    counts = other.counts(trusted)
                    read = other.extrapolated if extrapolate else other.within
                    value = read(positions, counts)
                    if value is None:
                        continue
                    shared = [p for p in own_counts if p in counts]
                    if not shared:
                        return value
                    at = min(shared, key=lambda p: abs(p - positions))
                    return value * own.seconds[at] / max(other.seconds[at], 1e-12)
                if own is not None and not extrapolate:
                    value = own.extrapolated(positions, own_counts)
                    if value is not None:
                        return value
        return None

    def _by_distance(self, bucket: int) -> list[int]:
        """The other measured buckets, nearest `bucket` first (the lower one on a tie)."""
        nearest = self._nearest.get(bucket)
        if nearest is None:
            others = (b for b in self._buckets if b != bucket)
            nearest = self._nearest[bucket] = sorted(others, key=lambda b: (abs(b - bucket), b))
        return nearest

    def curve(self) -> dict[int, dict[int, tuple[float, int]]]:
        """{context bucket: {positions: (mean seconds, samples)}} of what was measured."""
        return {
            b: {p: (c.seconds[p], c.samples[p]) for p in c.positions}
            for b, c in sorted(self._curves.items())
        }


# Request sets whose last batch `RoundClock` remembers: more than the groups a pipeline runs
# its requests in at once.
ROUNDS_KEPT = 64


@dataclass(slots=True)
class RoundClock:
    """The time from one batch of a set of requests to their next batch on this node, recorded
    into `cost` by the batch's positions and context.

    On the tail (or a whole model in one process) that is a request's round: its step through
    every node and hop, the driver's work and the tail's own (sampling, verifying, drafting),
    what the request waits per step at that shape. It is what `auto` weighs a depth's tokens
    against, rather than the tail's compute alone: the round's fixed share (other nodes, hops,
    host work) makes a row more cost less of it, and a step the tail builds ahead of its input
    costs less than its compute. Only a round between two steady batches (`steady`) of the
    same requests and positions is recorded: one where a request joined, left or changed its
    depth measures the change, not the shape."""

    cost: StepCost
    _last: OrderedDict[tuple[str, ...], tuple[float, int | None]] = field(
        default_factory=OrderedDict
    )

    def batch(
        self, requests: tuple[str, ...], positions: int | None, context: int, now: float
    ) -> None:
        """A batch of `requests` finished at `now` (seconds, monotonic); `positions`: its
        positions if it was steady, else None."""
        previous = self._last.pop(requests, None)
        if previous is not None and positions is not None and previous[1] == positions:
            self.cost.record(positions, now - previous[0], context)
        self._last[requests] = (now, positions)
        if len(self._last) > ROUNDS_KEPT:
            self._last.popitem(last=False)
