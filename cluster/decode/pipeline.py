"""The engine's view of a pipeline, and the in-process one.

`Pipeline` is all the generation engine knows of where the layers run: submit a step, get the
tail's result; release a request. `LocalPipeline` runs shards in this process (one shard for
the whole model, or several one after the other); the remote pipeline
(`cluster.transport.node_client`) runs them on node daemons. Concurrent submissions are
gathered into packed batches, at most one step per request per batch, so several requests share
each pass over the weights.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Collection, Iterable
from typing import Protocol, TypeVar

from cluster.decode.runner import ShardRunner
from cluster.decode.worker import MLXWorker
from cluster.messages import RequestError, StepRequest, StepResult

T = TypeVar("T")


class Pipeline(Protocol):
    @property
    def max_context(self) -> int: ...

    @property
    def stages(self) -> int:
        """How many of its stages compute at once, on different steps (a prompt's chunks
        stream through them): its nodes, or 1 where one process runs the shards in turn."""
        ...

    async def submit(self, step: StepRequest) -> StepResult: ...

    async def release(self, request_id: str) -> None: ...


def is_prompt_chunk(step: StepRequest) -> bool:
    """Whether `step` (or a step message's entry) prefills a prompt: it confirms more than the
    one token a decode step confirms.

    A head's micro-batches cap decode steps only. Prompts queued together (users arriving at
    once) prefill as one batch: split between micro-batches, the first group's requests would
    start decoding and then wait for the next group's prefill, each such wait a gap many
    decode steps long, while a prefill batch costs about the sum of its prompts either way."""
    return len(step.tokens) - step.draft_len > 1


def take_batch(
    queue: deque[T],
    limit: int,
    ids: Callable[[T], Collection[str]],
    size: Callable[[T], int],
    max_requests: int | None = None,
    capped: Callable[[T], bool] | None = None,
) -> list[T]:
    """The oldest queued items to run as one batch: at most one step per request (a request's
    next chunk waits for the next batch), at most `limit` positions and at most `max_requests`
    requests in the items that `capped` says (all by default); the first item is always taken.
    The rest stay queued, in order: an item that shares a request with one left queued stays
    queued too, so that no request's step overtakes an earlier one (an item may carry steps of
    several requests). Shared by the local pipeline and nodes."""
    batch: list[T] = []
    seen: set[str] = set()
    held: set[str] = set()  # the requests of the items left queued
    counted = 0  # requests of the capped items taken
    deferred: list[T] = []
    positions = 0
    while queue:
        item = queue.popleft()
        item_ids, item_size = ids(item), size(item)
        is_capped = max_requests is not None and (capped is None or capped(item))
        if (
            not seen.isdisjoint(item_ids)
            or not held.isdisjoint(item_ids)
            or (batch and positions + item_size > limit)
            or (batch and is_capped and counted + len(item_ids) > max_requests)
        ):
            deferred.append(item)
            held.update(item_ids)
            continue
        seen.update(item_ids)
        counted += len(item_ids) if is_capped else 0
        positions += item_size
        batch.append(item)
    queue.extendleft(reversed(deferred))
    return batch


class LocalPipeline:
    def __init__(
        self,
        runners: list[ShardRunner],
        worker: MLXWorker,
        *,
        max_context: int,
        max_batch_positions: int = 4096,
    ):
        if not runners or not runners[0].spec.is_head or not runners[-1].spec.is_tail:
            raise ValueError("a pipeline runs from a head shard to a tail shard")
        self.runners = runners
        self.worker = worker
        self._max_context = max_context
        self.max_batch_positions = max_batch_positions
        self._queue: deque[tuple[StepRequest, asyncio.Future]] = deque()
        self._drainer: asyncio.Task | None = None
        # Told the ids of prefix snapshots a shard no longer holds (cluster.decode.prefix_index).
        self.on_prefix_dropped: Callable[[list[int]], None] | None = None

    @property
    def max_context(self) -> int:
        return self._max_context

    @property
    def stages(self) -> int:
        return 1  # its shards run one after another on the process's one MLX thread

    async def submit(self, step: StepRequest) -> StepResult:
        future = asyncio.get_running_loop().create_future()
        self._queue.append((step, future))
        if self._drainer is None or self._drainer.done():
            self._drainer = asyncio.create_task(self._drain())
        return await future

    async def release(self, request_id: str) -> None:
        await self.worker.run(self._release, request_id)

    def _release(self, request_id: str) -> None:
        for runner in self.runners:
            runner.release(request_id)

    async def release_as_prefix(self, request_id: str, snapshot_id: int, positions: int) -> bool:
        """Release, keeping the first `positions` positions as a prefix snapshot on every
        shard; False (and none kept) if a shard cannot keep it."""
        saved, dropped = await self.worker.run(
            self._release_as_prefix, request_id, snapshot_id, positions
        )
        self._report_dropped([i for i in dropped if i != snapshot_id])
        return saved

    def _release_as_prefix(
        self, request_id: str, snapshot_id: int, positions: int
    ) -> tuple[bool, list[int]]:
        replies = [r.release_as_prefix(request_id, snapshot_id, positions) for r in self.runners]
        dropped = {i for _, ids in replies for i in ids}
        saved = all(ok for ok, _ in replies)
        if not saved:
            dropped.add(snapshot_id)
        self._drop_prefixes(dropped)
        return saved, sorted(dropped)

    def _report_dropped(self, snapshot_ids: list[int]) -> None:
        if snapshot_ids and self.on_prefix_dropped is not None:
            self.on_prefix_dropped(snapshot_ids)

    async def drop_prefixes(self, snapshot_ids: Iterable[int]) -> None:
        await self.worker.run(self._drop_prefixes, set(snapshot_ids))

    def _drop_prefixes(self, snapshot_ids: set[int]) -> None:
        for runner in self.runners:
            runner.snapshots.drop(list(snapshot_ids))

    async def _drain(self) -> None:
        while self._queue:
            await asyncio.sleep(0)  # let concurrent submitters join the batch
            # A cancelled submitter's step is dropped, not computed.
            self._queue = deque(item for item in self._queue if not item[1].done())
            batch = take_batch(
                self._queue,
                self.max_batch_positions,
                ids=lambda item: (item[0].request_id,),
                size=lambda item: len(item[0].tokens),
            )
            if not batch:
                continue
            steps = [step for step, _ in batch]
            try:
                results, errors, dropped = await self.worker.run(self._run, steps)
            except Exception as error:  # a failure of the whole batch fails each request
                for _, future in batch:
                    if not future.done():
                        future.set_exception(error)
                continue
            if dropped:
                self._report_dropped(dropped)
            for step, future in batch:
                if future.done():
                    continue
                if step.request_id in errors:
                    future.set_exception(errors[step.request_id])
                else:
                    future.set_result(results[step.request_id])

    def _run(
        self, steps: list[StepRequest]
    ) -> tuple[dict[str, StepResult], dict[str, RequestError], list[int]]:
        errors: dict[str, RequestError] = {}
        hidden = None
        dropped: set[int] = set()
        for runner in self.runners:
            out = runner.run(steps, hidden)
            dropped.update(out.prefix_dropped)
            errors.update(out.errors)
            steps, hidden = out.steps, out.hidden
            if not steps:
                break
        for rid in errors:  # a request that failed on one shard is dropped from all of them
            self._release(rid)
        if dropped:  # a snapshot is usable only while every shard holds it
            self._drop_prefixes(dropped)
        return {r.request_id: r for r in out.results}, errors, sorted(dropped)
