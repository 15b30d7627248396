"""A node's next step built on a doorbell (`ShardRunner.build_ahead`): a head and a tail
shard in one process, stepped as two nodes step them (each on its own MLX thread, rung from
this one), must emit the tokens of the same shards stepped without it, and a step built ahead
that the node does not get must leave no trace. The doorbell is the one `cluster node
--build-ahead on` takes on the CPU (and Metal), a `HostLateInput` (built ahead, evaluated after
the ring). On MLX CUDA the `PinnedLateInput` is tested alone here, and across node processes by
tests/test_pipeline.py."""

from __future__ import annotations

import asyncio
import itertools
import time

import mlx.core as mx
import numpy as np
import pytest
from conftest import CODE_PROMPTS
from test_rollback import _layer_arrays

from cluster.decode.late_input import PinnedLateInput, late_input_for
from cluster.decode.runner import ShardRunner
from cluster.decode.worker import MLXWorker
from cluster.messages import RequestOptions, SamplingParams, StepRequest
from cluster.model.loading import load_shard
from cluster.model.shard import ShardSpec
from cluster.transport.wire import results_from_proto, step_batch_bytes
from node.stage import AHEAD_WAIT_S, Stage, Subscribers
from proto import cluster_pb2 as pb

STEPS = 12


ON_CUDA = mx.default_device() == mx.gpu and mx.cuda.is_available()
# On MLX CUDA two runners of one process share the device: a step launched behind one's
# pinned doorbell holds up the other's work until it is rung, which this process (waiting for
# the other) never does. Nodes are separate processes there; these run on the CPU and Metal.
two_runners = pytest.mark.skipif(ON_CUDA, reason="two runners in one process on one GPU")


@pytest.fixture(scope="module")
def shards(model_dir):
    layers = load_shard(model_dir, for_decoding=True).spec.end
    head_spec = ShardSpec(0, layers // 2, is_head=True, is_tail=False)
    tail_spec = ShardSpec(layers // 2, layers, is_head=False, is_tail=True)
    head = load_shard(model_dir, head_spec, for_decoding=True)
    tail = load_shard(model_dir, tail_spec, mtp=False, for_decoding=True)
    return head, tail


def _hidden_bytes(hidden: mx.array) -> bytes:
    return bytes(memoryview(hidden))


class TwoNodes:
    """A head runner and a tail runner, each with its own MLX thread and doorbell (or none),
    stepped as the node stages step them: after each plain batch the next one is built on the
    doorbell, which the step's input rings when it comes."""

    def __init__(self, shards, doorbells: bool):
        head, tail = shards
        self.workers = [MLXWorker(spin_s=0), MLXWorker(spin_s=0)]
        self.runners = [ShardRunner(head), ShardRunner(tail)]
        self.doorbells = [late_input_for("on"), late_input_for("on")] if doorbells else [None, None]
        self.built = [0, 0]

    def step(self, steps: list[StepRequest]) -> list:
        out = self._run(0, steps, None, self._tokens(steps))
        return self._run(1, steps, out.hidden, _hidden_bytes(out.hidden)).results

    @staticmethod
    def _tokens(steps: list[StepRequest]) -> bytes:
        return np.array([s.tokens[0] for s in steps], dtype=np.uint32).tobytes()

    def _run(self, node: int, steps, hidden, data: bytes):
        runner, doorbell, worker = self.runners[node], self.doorbells[node], self.workers[node]
        if doorbell is not None and doorbell.pending is not None:
            doorbell.ring(data if all(len(s.tokens) == 1 for s in steps) else None)
        out = worker.call(runner.run, steps, hidden)
        if doorbell is not None:
            successors = worker.call(runner.plain_successors, out.steps)
            if successors is not None:
                seq = doorbell.prepare(runner.input_nbytes(successors))
                worker.submit(runner.build_ahead, successors, doorbell, seq)
                doorbell.arm(seq)
                self.built[node] += 1
        return out

    def release(self, request_id: str) -> None:
        nodes = zip(self.runners, self.doorbells, self.workers, strict=True)
        for runner, doorbell, worker in nodes:
            if doorbell is not None:
                doorbell.ring(None)
            worker.call(runner.release, request_id)

    def caches(self, request_id: str) -> list[tuple[int, list[list[np.ndarray]]]]:
        """Each node's caches of the request: its position and every layer's contents, read on
        the node's own thread (its arrays live on that thread's stream)."""

        def read(runner: ShardRunner) -> tuple[int, list[list[np.ndarray]]]:
            cache = runner.requests[request_id].cache
            return cache.position, [_layer_arrays(layer) for layer in cache.layers]

        return [w.call(read, r) for w, r in zip(self.workers, self.runners, strict=True)]


def _assert_same_caches(a: list, b: list) -> None:
    for (position, layers), (position_b, layers_b) in zip(a, b, strict=True):
        assert position == position_b
        for x, y in zip(itertools.chain(*layers), itertools.chain(*layers_b), strict=True):
            np.testing.assert_array_equal(x, y)


def _decode(nodes: TwoNodes, prompts: dict[str, tuple[int, ...]], options) -> dict:
    """Each prompt prefilled, then greedy steps of all requests together."""
    out: dict[str, list[int]] = {rid: [] for rid in prompts}
    positions = {}
    for rid, prompt in prompts.items():
        (result,) = nodes.step([StepRequest(rid, prompt, 0, options=options)])
        out[rid].append(result.tokens[-1])
        positions[rid] = len(prompt)
    for _ in range(STEPS):
        steps = [StepRequest(rid, (out[rid][-1],), positions[rid]) for rid in prompts]
        for rid, result in zip(prompts, nodes.step(steps), strict=True):
            out[rid].append(result.tokens[-1])
            positions[rid] += 1
    return out


@two_runners
def test_steps_built_on_a_doorbell_emit_the_same_tokens(shards, tokenizer) -> None:
    prompts = {f"r{i}": tuple(tokenizer.encode(p)) for i, p in enumerate(CODE_PROMPTS[:2])}
    # One whose decoding crosses the attention caches' growth (every 256 positions).
    prompts["long"] = tuple(tokenizer.encode("\n".join(CODE_PROMPTS) * 20))[: 256 - STEPS // 2]
    for options in (
        RequestOptions(mtp=False),
        RequestOptions(SamplingParams(temperature=0.8, top_k=40, seed=3), mtp=False),
    ):
        plain = _decode(TwoNodes(shards, doorbells=False), prompts, options)
        nodes = TwoNodes(shards, doorbells=True)
        assert _decode(nodes, prompts, options) == plain
        # Every decode batch after the first came from the doorbell, on both nodes.
        for runner, built in zip(nodes.runners, nodes.built, strict=True):
            assert runner.steps_ahead_used == STEPS - 1
            assert built == STEPS  # the last batch's successor too


def _two_steps_in(shards, prompt: tuple[int, ...]) -> tuple[TwoNodes, TwoNodes, object]:
    """Request "a" prefilled and stepped once, with doorbells (the next step built ahead) and
    without; and the result of that step."""
    options = RequestOptions(mtp=False)
    nodes, reference = TwoNodes(shards, doorbells=True), TwoNodes(shards, doorbells=False)
    for pair in (nodes, reference):
        (first,) = pair.step([StepRequest("a", prompt, 0, options=options)])
        (second,) = pair.step([StepRequest("a", (first.tokens[-1],), len(prompt))])
    return nodes, reference, second


@two_runners
def test_a_step_built_ahead_and_not_asked_for_leaves_no_trace(shards, tokenizer) -> None:
    prompt = tuple(tokenizer.encode(CODE_PROMPTS[0]))
    options = RequestOptions(mtp=False)
    nodes, reference, second = _two_steps_in(shards, prompt)
    # Another request joins: the batch differs, so the step built ahead is undone, the
    # doorbell released, and both requests step as they would have.
    steps = [
        StepRequest("a", (second.tokens[-1],), len(prompt) + 1),
        StepRequest("b", prompt[:5], 0, options=options),
    ]
    got = nodes.step(steps)
    want = reference.step(steps)
    assert [r.tokens for r in got] == [r.tokens for r in want]
    assert [r.steps_ahead_undone for r in nodes.runners] == [1, 1]
    _assert_same_caches(nodes.caches("a"), reference.caches("a"))
    # A step with a draft (greedy: any draft verifies) is not the plain step built ahead.
    nodes.release("b")
    reference.release("b")
    steps = [StepRequest("a", (got[0].tokens[-1],), len(prompt) + 2)]
    assert [r.tokens for r in nodes.step(steps)] == [r.tokens for r in reference.step(steps)]
    steps = [StepRequest("a", (5, 6), len(prompt) + 3, draft_len=1)]
    assert [r.tokens for r in nodes.step(steps)] == [r.tokens for r in reference.step(steps)]
    assert [r.steps_ahead_undone for r in nodes.runners] == [2, 2]
    _assert_same_caches(nodes.caches("a"), reference.caches("a"))


@two_runners
def test_a_doorbell_rung_without_data_is_not_used(shards, tokenizer) -> None:
    prompt = tuple(tokenizer.encode(CODE_PROMPTS[1]))
    nodes, reference, second = _two_steps_in(shards, prompt)
    for doorbell in nodes.doorbells:
        doorbell.ring(None)  # e.g. a release of another request reached the node first
    steps = [StepRequest("a", (second.tokens[-1],), len(prompt) + 1)]
    assert [r.tokens for r in nodes.step(steps)] == [r.tokens for r in reference.step(steps)]
    assert [r.steps_ahead_undone for r in nodes.runners] == [1, 1]


async def _tail_stage_tokens(shards, prompt: tuple[int, ...], doorbell: bool) -> list[int]:
    """A tail node's stage (its doorbell 'on', or none) fed the head's step messages: the
    prompt, a plain step, a pause with no message until the step built ahead is released
    (longer than AHEAD_WAIT_S), a plain step."""
    head_shard, tail_shard = shards
    head, head_worker = ShardRunner(head_shard), MLXWorker(spin_s=0)
    runner, worker = ShardRunner(tail_shard), MLXWorker(spin_s=0)
    subscribers = Subscribers()
    results = subscribers.add()
    stage = Stage(runner, worker, subscribers, doorbell=late_input_for("on") if doorbell else None)
    tokens: list[int] = []

    async def step(request: StepRequest) -> None:
        hidden = head_worker.call(head.run, [request]).hidden
        message = pb.StepBatch.FromString(step_batch_bytes([request], hidden, len(tokens)))
        stage.accept(message, lambda event: None)
        (result,), errors = results_from_proto(await asyncio.wait_for(results.get(), 60))
        assert not errors
        tokens.append(result.tokens[-1])

    try:
        await step(StepRequest("a", prompt, 0, options=RequestOptions(mtp=False)))
        # The stage builds the next step ahead after it has sent this one's result, so not
        # before `sent`; the result reaches this coroutine later still, how much later
        # depending on the machine's load.
        sent = time.perf_counter()
        await step(StepRequest("a", (tokens[-1],), len(prompt)))
        if doorbell:  # the next step, built ahead, released by the stage's timer
            assert stage.doorbell.pending is not None
            async with asyncio.timeout(30 * AHEAD_WAIT_S):
                while stage.doorbell.pending is not None:
                    await asyncio.sleep(AHEAD_WAIT_S / 20)
            assert time.perf_counter() - sent >= AHEAD_WAIT_S * 0.99  # one monotonic clock
        else:
            await asyncio.sleep(2 * AHEAD_WAIT_S)  # the same pause, with nothing to release
        await step(StepRequest("a", (tokens[-1],), len(prompt) + 1))
        if doorbell:  # the step built ahead was undone, the one that came ran as it came
            assert (runner.steps_ahead_used, runner.steps_ahead_undone) == (0, 1)
    finally:
        await stage.close()
        worker.close()
        head_worker.close()
    return tokens


@two_runners
def test_a_step_built_ahead_that_no_message_rings_is_released(shards, tokenizer) -> None:
    """A node whose next message does not come within AHEAD_WAIT_S (a driver that paused the
    request) releases the step built ahead, which is then undone at the next step; the
    tokens are those of a node without a doorbell."""
    prompt = tuple(tokenizer.encode(CODE_PROMPTS[2]))
    want = asyncio.run(_tail_stage_tokens(shards, prompt, doorbell=False))
    assert asyncio.run(_tail_stage_tokens(shards, prompt, doorbell=True)) == want


@pytest.mark.skipif(not ON_CUDA, reason="MLX CUDA only")
def test_the_pinned_doorbell_launches_before_its_input_exists() -> None:
    import threading

    doorbell = PinnedLateInput()
    seq = doorbell.prepare(12)
    x = doorbell.input(seq, (3,), mx.uint32)
    doorbell.arm(seq)
    y = x * 2
    mx.async_eval(y)
    ring = threading.Timer(0.05, doorbell.ring, args=(np.array([1, 2, 3], np.uint32).tobytes(),))
    started = time.perf_counter()
    ring.start()
    assert y.tolist() == [2, 4, 6]
    assert time.perf_counter() - started >= 0.04
    assert doorbell.delivered(seq)


@pytest.mark.skipif(ON_CUDA, reason="the CPU's and Metal's settings")
def test_build_ahead_settings() -> None:
    from cluster.decode.late_input import HostLateInput

    assert late_input_for("auto") is None and late_input_for("off") is None
    assert isinstance(late_input_for("on"), HostLateInput)
    with pytest.raises(ValueError, match="not one of"):
        late_input_for("sometimes")
    doorbell = late_input_for("on")
    seq = doorbell.prepare(8)
    doorbell.arm(seq)
    with pytest.raises(RuntimeError, match="still armed"):
        doorbell.prepare(8)
    doorbell.ring(None)  # released without data: nothing delivered
    assert doorbell.pending is None and not doorbell.delivered(seq)
    seq = doorbell.prepare(8)
    x = doorbell.input(seq, (2,), mx.uint32)
    doorbell.arm(seq)
    doorbell.ring(np.array([7, 9], dtype=np.uint32).tobytes())
    assert doorbell.delivered(seq) and x.tolist() == [7, 9]
