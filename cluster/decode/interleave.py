"""How long a prompt's chunks may be while other requests decode, kept by what they cost.

A decode step that meets a prefill chunk on a node waits for it, so the running streams' gaps
between tokens grow with the chunk, and what a chunk of n tokens adds depends on the machine
(on a GPU a chunk costs its step's fixed costs, on a Mac or a CPU its tokens), on the batch
it meets and on the context. `InterleavePacer` watches the gaps themselves: every decoding
request's time from one result to the next, quiet (no prefill in flight at any moment of it)
or beside interleaved chunks. After each chunk it compares a high quantile of the recent
gaps beside chunks with the median quiet gap, halves the chunk where they run over the
budget and doubles it where they keep well within it, between SHORTEST_CHUNK and the prompt
chunk, in powers of two: the shapes the warm-up ran (a shape met for the first time stalls a
GPU for hundreds of milliseconds, far more than the chunk saves). A prompt then prefills as
fast as the running streams' gaps allow on this machine, for this batch, at this length.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

# The gaps beside chunks, as a multiple of the median quiet gap: above SHRINK_ABOVE at the
# quantile the chunk halves, below GROW_BELOW it doubles; in between it stays, so a chunk
# at the edge does not flip each time. The quantile stands for the gaps' p99, which must stay
# within 3x their median: with a few dozen gaps a window, its 90th percentile is the
# highest one that noise does not decide, and never the highest gap (one slow step).
QUANTILE = 0.9
SHORTEST_CHUNK = 4  # the shortest prefill the warm-up runs
SHRINK_ABOVE = 2.4
GROW_BELOW = 1.7
# Gaps beside chunks judged at once (older ones are of an older chunk), and how many new ones
# each judgement waits for: a window holds several chunks' worth, so one slow step moves
# nothing.
WINDOW = 24
FEWEST = 8
# A longer chunk that ran over the budget is tried again only after this many calm windows
# (1, 2, 4, ... each time it fails again, up to MOST_HELD): probing costs the streams a
# window of long gaps each time, which a p99 sees.
MOST_HELD = 16
QUIET_KEPT = 32  # quiet gaps the median is taken over
TRACE_KEPT = 256  # the latest changes, kept for benchmarks


@dataclass(frozen=True, slots=True)
class PaceChange:
    """A change of the chunk: at `time`, from `before` to `after` tokens, for gaps whose
    quantile was `ratio` times the quiet median."""

    time: float
    before: int
    after: int
    ratio: float


class InterleavePacer:
    """The chunk for prompts that arrive while others decode (`size`), adjusted from the
    decoding requests' gaps. The engine reports each decode result (`decoded`), each
    request that stops decoding (`finished`), and each prefill chunk it sends and gets
    back (`sent`, `returned`); all on the event loop's thread, times in seconds of one
    clock."""

    def __init__(
        self, size: int, largest: int, fallback_gap_s: float = 0.0, *, adaptive: bool = True
    ):
        if not 1 <= size <= largest:
            raise ValueError(f"the interleave chunk must be within 1..{largest}, got {size}")
        self.largest = largest
        self.smallest = min(SHORTEST_CHUNK, size)
        self.size = size
        self.adaptive = adaptive  # False: `size` stays (a benchmark's fixed chunk)
        # The gap to judge by before any quiet one was seen (a decode step measured after
        # the warm-up; 0: none, and no change until quiet gaps come).
        self.fallback_gap_s = fallback_gap_s
        self._last: dict[str, float] = {}  # request -> its latest result
        self._quiet: deque[float] = deque(maxlen=QUIET_KEPT)
        self._beside: deque[float] = deque(maxlen=WINDOW)
        self._fresh = 0  # gaps beside chunks since the last judgement
        self._calm = 0  # judgements in a row within GROW_BELOW
        self._held: dict[int, int] = {}  # chunk -> calm judgements it waits for, once failed
        self._probing = False  # the chunk was just made longer, and not yet judged
        # Prefill chunks in flight, interleaved or not, and when the last of each ended.
        self._interleaved = 0
        self._whole = 0
        self._interleaved_end = float("-inf")
        self._whole_end = float("-inf")
        self.trace: deque[PaceChange] = deque(maxlen=TRACE_KEPT)
        self.changes = 0

    # -- what the engine reports ---------------------------------------------------------

    def decoded(self, request_id: str, now: float) -> None:
        """A result of `request_id` arrived at `now` (its prefill's last one included)."""
        last = self._last.get(request_id)
        self._last[request_id] = now
        if last is None:
            return
        whole = self._whole > 0 or self._whole_end > last
        interleaved = self._interleaved > 0 or self._interleaved_end > last
        if not whole and not interleaved:
            self._quiet.append(now - last)
        elif interleaved and not whole:  # whole prefills' gaps say nothing of the chunk
            self._beside.append(now - last)
            self._fresh += 1

    def finished(self, request_id: str) -> None:
        self._last.pop(request_id, None)

    def sent(self, *, interleaved: bool) -> None:
        if interleaved:
            self._interleaved += 1
        else:
            self._whole += 1

    def returned(self, now: float, *, interleaved: bool) -> None:
        """A chunk came back; after an interleaved one, the chunk may change."""
        if not interleaved:
            self._whole -= 1
            self._whole_end = now
            return
        self._interleaved -= 1
        self._interleaved_end = now
        self._adjust(now)

    # -- the rule --------------------------------------------------------------------------

    def quiet_gap_s(self) -> float:
        return statistics.median(self._quiet) if self._quiet else self.fallback_gap_s

    def _adjust(self, now: float) -> None:
        quiet = self.quiet_gap_s()
        if not self.adaptive or self._fresh < FEWEST or quiet <= 0:
            return
        self._fresh = 0
        gaps = sorted(self._beside)
        ratio = gaps[min(len(gaps) - 2, int(QUANTILE * len(gaps)))] / quiet
        probing, self._probing = self._probing, False
        if ratio > SHRINK_ABOVE and self.size > self.smallest:
            if probing:  # it does not fit: wait longer before the next try
                self._held[self.size] = min(2 * self._held.get(self.size, 0) or 1, MOST_HELD)
            self._change(now, max(self.size // 2, self.smallest), ratio)
        elif ratio < GROW_BELOW and self.size < self.largest:
            self._calm += 1
            longer = min(2 * self.size, self.largest)
            if self._calm > self._held.get(longer, 0):
                self._change(now, longer, ratio)
                self._probing = True
        else:
            self._calm = 0

    def _change(self, now: float, size: int, ratio: float) -> None:
        self.trace.append(PaceChange(now, self.size, size, ratio))
        self.changes += 1
        self.size = size
        self._beside.clear()  # the next judgement is of the new chunk alone
        self._calm = 0
