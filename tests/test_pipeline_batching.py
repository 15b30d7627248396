"""take_batch: one step per request per batch, position and request limits, arrival order
kept; a head node's micro-batches; the driver's messages, one per group of steps."""

from __future__ import annotations

import asyncio
from collections import deque
from types import SimpleNamespace
from typing import cast

from cluster.decode.pipeline import take_batch
from cluster.decode.remote_pipeline import RemotePipeline
from cluster.decode.runner import ShardRunner
from cluster.decode.worker import MLXWorker
from cluster.messages import StepRequest
from cluster.model.shard import ShardSpec
from node.stage import Stage, Subscribers, Successor
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


def test_no_step_overtakes_an_earlier_one_of_its_request() -> None:
    """Messages carry steps of several requests: one left queued (its "b" already in the
    batch) holds back a later message of its other request, whose first chunk it carries."""
    queue = deque([("b",), ("a", "b"), ("a",), ("c",)])
    take = lambda: take_batch(queue, 100, ids=lambda item: item, size=len)  # noqa: E731
    assert take() == [("b",), ("c",)]
    assert take() == [("a", "b")]
    assert take() == [("a",)] and not queue


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
        successor=Successor("127.0.0.1:9", "t"),
        micro_batches=micro_batches,
    )
    stage._task.cancel()  # the test takes batches itself
    return stage


def _queue_steps(stage: Stage, request_ids: str, tokens: int = 1) -> None:
    """A message per request: a decode step, or a prompt chunk of `tokens` tokens."""
    for rid in request_ids:
        entry = pb.StepEntry(request_id=rid, tokens=[1] * tokens, position=0 if tokens > 1 else 4)
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


def test_the_head_prefills_prompts_queued_together_as_one_batch() -> None:
    """Users arriving at once: their prompts' chunks are not split between micro-batches (the
    first group would start decoding, then wait for the next group's prefill); decode steps
    queued beside them still are, and so is the position limit."""

    async def go() -> None:
        head = _stage(is_head=True, live="a", micro_batches=2)
        try:
            _queue_steps(head, "bcdefgh", tokens=100)
            assert _taken(head) == list("bcdefgh")  # 8 live, a share of 4: all 7 prompts
            _queue_steps(head, "a")
            _queue_steps(head, "xyz", tokens=100)
            _queue_steps(head, "bcdefgh")
            # 11 live, a share of 6: a's step, the 3 prompts, then 5 of the decode steps
            assert _taken(head) == list("axyzbcdef")
            assert _taken(head) == list("gh")
            head.max_batch_positions = 250
            _queue_steps(head, "pqr", tokens=100)
            assert _taken(head) == list("pq")
            assert _taken(head) == list("r")
        finally:
            await head.close()

    asyncio.run(go())


def test_prompt_chunks_count_in_no_share() -> None:
    queue = deque([("a", 1), ("b", 9), ("c", 9), ("d", 1), ("e", 1)])
    taken = take_batch(
        queue, 100, ids=lambda item: (item[0],), size=lambda item: item[1], max_requests=2,
        capped=lambda item: item[1] == 1,
    )  # fmt: skip
    assert taken == [("a", 1), ("b", 9), ("c", 9), ("d", 1)]
    assert list(queue) == [("e", 1)]


class _StepStream:
    """The head's step stream, as the driver's writer sees it: the messages written."""

    def __init__(self) -> None:
        self.messages: list[pb.StepBatch] = []

    async def write(self, message: pb.StepBatch) -> None:
        self.messages.append(message)
        await asyncio.sleep(0)  # a write yields, as gRPC's does

    async def wait_for(self, steps: int) -> None:
        """Until `steps` steps in all were written (the writer runs on the same loop)."""
        for _ in range(100):
            if sum(len(m.entries) for m in self.messages) >= steps:
                return
            await asyncio.sleep(0)  # one turn of the loop, not a wait for time
        raise AssertionError(f"{steps} steps not written: {_sent(self)}")


def _sent(stream: _StepStream) -> list[str]:
    return ["".join(entry.request_id for entry in m.entries) for m in stream.messages]


def test_the_driver_sends_the_steps_of_one_turn_as_one_message_per_group() -> None:
    """Requests woken by one result batch submit in one turn of the event loop: one message
    per micro-batch keeps them one batch on every node (sent one by one, the head started on
    the first alone and the batch split for good)."""

    async def go(micro_batches: int, *submits: str) -> list[str]:
        pipeline = RemotePipeline([], max_context=64, micro_batches=micro_batches)
        stream = _StepStream()
        pipeline._head_call = stream
        writer = asyncio.create_task(pipeline._write_steps())
        waiting = []
        for turn in submits:
            for rid in turn:
                waiting.append(asyncio.ensure_future(pipeline.submit(StepRequest(rid, (1,), 4))))
            await stream.wait_for(len(waiting))
        for task in (writer, *waiting):
            task.cancel()
        return _sent(stream)

    assert asyncio.run(go(1, "abcdefgh")) == ["abcdefgh"]
    assert asyncio.run(go(2, "abcdefgh")) == ["abcd", "efgh"]  # the head's share of 8 live
    # 4 live, then 8: the share grows (the head merges queued groups up to its share).
    assert asyncio.run(go(2, "abcd", "efgh")) == ["ab", "cd", "efgh"]
    assert asyncio.run(go(1, "aba")) == ["ab", "a"]  # a request's next step: the next message


def test_the_driver_sends_prompt_chunks_of_one_turn_in_one_message() -> None:
    """Prompts submitted together travel as one message, not capped by the head's share;
    decode steps submitted beside them keep their groups."""

    async def go(steps: list[StepRequest]) -> list[str]:
        pipeline = RemotePipeline([], max_context=256, micro_batches=2)
        stream = _StepStream()
        pipeline._head_call = stream
        writer = asyncio.create_task(pipeline._write_steps())
        waiting = [asyncio.ensure_future(pipeline.submit(step)) for step in steps]
        await stream.wait_for(len(waiting))
        for task in (writer, *waiting):
            task.cancel()
        return _sent(stream)

    prompts = [StepRequest(rid, (1,) * 100, 0) for rid in "bcdefgh"]
    decode = [StepRequest(rid, (1,), 4) for rid in "aijk"]
    assert asyncio.run(go(prompts)) == ["bcdefgh"]
    assert asyncio.run(go([decode[0], *prompts, *decode[1:]])) == ["aijk", "bcdefgh"]


def test_the_driver_drops_the_queued_step_of_a_released_request() -> None:
    async def go() -> list[str]:
        pipeline = RemotePipeline([], max_context=64)
        stream = _StepStream()
        pipeline._head_call = stream
        writer = asyncio.create_task(pipeline._write_steps())
        waiting = [asyncio.ensure_future(pipeline.submit(StepRequest(r, (1,), 4))) for r in "abc"]
        await asyncio.sleep(0)  # the three submitted, the writer not yet run
        await pipeline.release("b")  # (no nodes to tell here)
        await stream.wait_for(2)
        writer.cancel()
        for future in waiting:
            future.cancel()
        return _sent(stream)

    assert asyncio.run(go()) == ["ac"]
