"""The interleave chunk's pacing: from the decoding requests' gaps, on a clock the test keeps."""

from __future__ import annotations

import itertools

import pytest

from cluster.decode.interleave import FEWEST, MOST_HELD, SHORTEST_CHUNK, InterleavePacer

QUIET = 0.010  # a decode step alone, seconds


class Clock:
    """One decoding request and a prompt in interleaved chunks, in simulated time."""

    def __init__(self, pacer: InterleavePacer) -> None:
        self.pacer = pacer
        self.now = 0.0
        self.sizes: list[int] = []

    def quiet(self, gaps: int) -> None:
        for _ in range(gaps):
            self.now += QUIET
            self.pacer.decoded("stream", self.now)

    def chunk(self, gap_of) -> None:
        """One interleaved chunk in flight for one of the stream's gaps, of `gap_of(size)`."""
        size = self.pacer.size
        self.sizes.append(size)
        self.pacer.sent(interleaved=True)
        self.now += gap_of(size)
        self.pacer.decoded("stream", self.now)
        self.pacer.returned(self.now, interleaved=True)


def started(size: int = 8, largest: int = 512) -> Clock:
    clock = Clock(InterleavePacer(size, largest))
    clock.pacer.decoded("stream", 0.0)
    clock.quiet(10)
    return clock


def test_chunks_whose_gaps_run_over_the_budget_halve_down_to_the_shortest_warmed() -> None:
    clock = started(32)
    for _ in range(6 * FEWEST):
        clock.chunk(lambda size: 3 * QUIET)
    assert clock.sizes[:FEWEST] == [32] * FEWEST  # judged once it has seen FEWEST gaps
    assert clock.sizes[FEWEST] == 16 and clock.pacer.size == SHORTEST_CHUNK
    assert [(c.before, c.after) for c in clock.pacer.trace] == [(32, 16), (16, 8), (8, 4)]


def test_one_slow_step_in_a_window_moves_nothing() -> None:
    clock = started(8)
    gaps = iter([2 * QUIET] * 3 + [20 * QUIET] + [2 * QUIET] * (4 * FEWEST))
    for _ in range(4 * FEWEST):
        clock.chunk(lambda size: next(gaps))
    assert clock.pacer.size == 8 and not clock.pacer.trace


def test_chunks_well_within_the_budget_double_up_to_the_prompt_chunk() -> None:
    clock = started(4, largest=64)
    for _ in range(10 * FEWEST):
        clock.chunk(lambda size: 1.2 * QUIET)
    assert clock.pacer.size == 64
    assert sorted(set(clock.sizes)) == [4, 8, 16, 32, 64]


def test_a_longer_chunk_that_failed_is_tried_again_ever_more_rarely() -> None:
    """Chunks of up to 16 tokens keep the gaps well within the budget, 32 tokens do not.
    The pacer settles on 16 and tries 32 again ever more rarely."""
    clock = started(4)
    for _ in range(120 * FEWEST):
        clock.chunk(lambda size: (1.5 if size <= 16 else 3) * QUIET)
    tail = clock.sizes[len(clock.sizes) // 2 :]
    assert set(tail) <= {16, 32}
    assert tail.count(32) * (MOST_HELD // 2) <= tail.count(16)  # long waits between tries
    tries = [c.time for c in clock.pacer.trace if c.after == 32]
    waits = [b - a for a, b in itertools.pairwise(tries)]
    assert waits[-1] > 4 * waits[0]


def test_the_chunk_settles_in_between_where_the_gaps_are_within_the_budget() -> None:
    clock = started(4)
    for _ in range(40 * FEWEST):
        clock.chunk(lambda size: (1 + size / 16) * QUIET)  # 8: 1.5x, 16: 2x, 32: 3x
    assert set(clock.sizes[len(clock.sizes) // 4 :]) == {16}


def test_gaps_beside_whole_prefills_are_not_the_chunks_and_not_quiet() -> None:
    """A prompt prefilled whole (nobody decoding when it came) makes the request that starts
    decoding meanwhile wait: such gaps move neither the chunk nor the quiet median."""
    clock = started(8)
    clock.pacer.sent(interleaved=False)
    for _ in range(4 * FEWEST):
        clock.now += 100 * QUIET
        clock.pacer.decoded("stream", clock.now)
    clock.pacer.returned(clock.now, interleaved=False)
    clock.now += 100 * QUIET
    clock.pacer.decoded("stream", clock.now)  # began during it
    assert clock.pacer.quiet_gap_s() == pytest.approx(QUIET)
    for _ in range(FEWEST):
        clock.chunk(lambda size: 2 * QUIET)  # within the budget, not within GROW_BELOW
    assert clock.pacer.size == 8 and not clock.pacer.trace


def test_without_quiet_gaps_it_judges_by_the_measured_step_or_not_at_all() -> None:
    pacer = InterleavePacer(8, 512)
    clock = Clock(pacer)
    pacer.decoded("stream", 0.0)
    for _ in range(2 * FEWEST):
        clock.chunk(lambda size: 3 * QUIET)
    assert pacer.size == 8  # nothing to judge by
    pacer.fallback_gap_s = QUIET
    for _ in range(FEWEST):
        clock.chunk(lambda size: 3 * QUIET)
    assert pacer.size == 4


def test_a_fixed_chunk_stays_and_a_finished_request_leaves_no_gap() -> None:
    clock = started(8)
    clock.pacer.adaptive = False
    for _ in range(4 * FEWEST):
        clock.chunk(lambda size: 5 * QUIET)
    assert clock.pacer.size == 8
    clock.pacer.finished("stream")
    clock.now += 1.0
    clock.pacer.decoded("stream", clock.now)  # a new first result, not a 1 s gap
    assert clock.pacer.quiet_gap_s() == pytest.approx(QUIET)


def test_an_interleave_chunk_outside_1_to_the_prompt_chunk_is_refused() -> None:
    with pytest.raises(ValueError, match=r"within 1\.\.16"):
        InterleavePacer(32, 16)
    with pytest.raises(ValueError, match=r"within 1\.\.16"):
        InterleavePacer(0, 16)
