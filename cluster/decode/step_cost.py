"""What a batch costs this node, by its number of positions, from the node's own counters.

Every decode batch a shard runs is timed (from its start to its evaluated output) and
recorded under its number of positions, as a running mean that follows the machine's load.
The curve is what the adaptive MTP depth (cluster.decode.mtp_depth) weighs drafts against:
on a GPU bound by reading the weights a step over 2-8 positions costs about what one costs,
on this project's CPU test machine every extra row costs about half of what the first does.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

SMOOTHING = 0.2  # weight of a new sample in the running mean


@dataclass(slots=True)
class StepCost:
    """Running mean seconds of a batch by number of positions."""

    smoothing: float = SMOOTHING
    _positions: list[int] = field(default_factory=list)  # measured counts, sorted
    _seconds: dict[int, float] = field(default_factory=dict)
    _samples: dict[int, int] = field(default_factory=dict)
    # Every batch recorded, whatever its size: what a benchmark sets against its wall time.
    total_seconds: float = 0.0
    total_batches: int = 0

    def record(self, positions: int, seconds: float) -> None:
        if positions < 1 or seconds < 0:
            raise ValueError(f"a batch of {positions} positions in {seconds} s")
        self.total_seconds += seconds
        self.total_batches += 1
        old = self._seconds.get(positions)
        if old is None:
            bisect.insort(self._positions, positions)
            self._seconds[positions] = seconds
        else:
            self._seconds[positions] = old + self.smoothing * (seconds - old)
        self._samples[positions] = self._samples.get(positions, 0) + 1

    def measured(self, positions: int) -> bool:
        return positions in self._seconds

    def seconds(self, positions: int) -> float | None:
        """The expected seconds of a batch of `positions`; None before any measurement.

        Between measured counts the curve is linear; below the smallest it is flat; above the
        largest it grows per row at the slope of the last two measured counts (flat when only
        one is known: an unmeasured count is assumed cheap until measured, so that a policy
        reading it tries it once).
        """
        if not self._positions:
            return None
        if positions in self._seconds:
            return self._seconds[positions]
        i = bisect.bisect_left(self._positions, positions)
        if i == 0:
            return self._seconds[self._positions[0]]
        if i == len(self._positions):
            if len(self._positions) == 1:
                return self._seconds[self._positions[-1]]
            lo, hi = self._positions[-2], self._positions[-1]
        else:
            lo, hi = self._positions[i - 1], self._positions[i]
        slope = (self._seconds[hi] - self._seconds[lo]) / (hi - lo)
        return max(self._seconds[lo] + slope * (positions - lo), 0.0)

    def curve(self) -> dict[int, tuple[float, int]]:
        """{positions: (mean seconds, samples)} of what was measured."""
        return {p: (self._seconds[p], self._samples[p]) for p in self._positions}
