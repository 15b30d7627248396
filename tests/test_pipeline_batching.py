"""take_batch: one step per request per batch, a position limit, arrival order kept."""

from __future__ import annotations

from collections import deque

from cluster.decode.pipeline import take_batch


def _take(queue: deque[tuple[str, int]], limit: int) -> list[tuple[str, int]]:
    return take_batch(queue, limit, ids=lambda item: (item[0],), size=lambda item: item[1])


def test_one_step_per_request_in_arrival_order() -> None:
    queue = deque([("a", 4), ("a", 4), ("b", 1), ("c", 2)])
    assert _take(queue, 100) == [("a", 4), ("b", 1), ("c", 2)]
    assert list(queue) == [("a", 4)]  # a's next chunk waits for the next batch
    assert _take(queue, 100) == [("a", 4)] and not queue


def test_position_limit_defers_but_always_takes_the_first() -> None:
    queue = deque([("a", 10), ("b", 3), ("c", 1)])
    assert _take(queue, 4) == [("a", 10)]
    assert _take(queue, 4) == [("b", 3), ("c", 1)]
