"""take_batch: one step per request per batch, position and request limits, arrival order
kept; a head node's micro-batches."""

from __future__ import annotations

import asyncio
from collections import deque
from types import SimpleNamespace
from typing import cast

from cluster.decode.pipeline import take_batch
from cluster.decode.runner import ShardRunner
from cluster.decode.worker import MLXWorker
from cluster.model.shard import ShardSpec
from node.stage import Stage, Subscribers
from proto import cluster_pb2 as pb


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


def test_request_limit_defers_but_always_takes_the_first() -> None:
    queue = deque([("a", 1), ("b", 1), ("c", 1), ("a", 1), ("d", 1)])
    take = lambda: take_batch(  # noqa: E731
        queue, 100, ids=lambda item: (item[0],), size=lambda item: item[1], max_requests=2
    )
    assert take() == [("a", 1), ("b", 1)]
    assert take() == [("c", 1), ("a", 1)]
    assert take() == [("d", 1)] and not queue


def _stage(is_head: bool, live: str, micro_batches: int) -> Stage:
    runner = SimpleNamespace(
        spec=ShardSpec(0, 4, is_head=is_head, is_tail=False),
        requests=dict.fromkeys(live),
        close=lambda: None,
    )
    stage = Stage(
        cast(ShardRunner, runner),
        MLXWorker(),
        Subscribers(),
        next_node="127.0.0.1:9",
        token="t",
        micro_batches=micro_batches,
    )
    stage._task.cancel()  # the test takes batches itself
    return stage


def _queue_steps(stage: Stage, request_ids: str) -> None:
    for rid in request_ids:
        entry = pb.StepEntry(request_id=rid, tokens=[1], position=4)
        stage.accept(pb.StepBatch(entries=[entry]), lambda _event: None)


def _taken(stage: Stage) -> list[str]:
    return [rid for item in stage._take() for rid in sorted(item.request_ids)]


def test_the_head_lets_its_share_of_the_live_requests_in_at_a_time() -> None:
    async def go() -> None:
        head = _stage(is_head=True, live="abcdefgh", micro_batches=2)
        try:
            _queue_steps(head, "abcdefgh")
            assert _taken(head) == list("abcd")  # 8 live requests in 2 groups
            assert _taken(head) == list("efgh")
            _queue_steps(head, "abc")  # fewer queued than the share: all of them
            assert _taken(head) == list("abc")
            _queue_steps(head, "xyz")  # requests not held yet count as live too: 11 in all
            assert _taken(head) == list("xyz")
            _queue_steps(head, "abcdefgxyz")
            assert _taken(head) == list("abcdef")
            head.runner.requests.clear()  # all released: the 4 queued are all that is live
            assert _taken(head) == list("gx")
        finally:
            await head.close()
        middle = _stage(is_head=False, live="abcdefgh", micro_batches=2)
        try:  # a later node computes each batch as it comes
            _queue_steps(middle, "abcdefgh")
            assert _taken(middle) == list("abcdefgh")
        finally:
            await middle.close()

    asyncio.run(go())
