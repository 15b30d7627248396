"""A node's memory: reported, bounded, and freed when a driver goes away.

One `cluster node` process with a 1 s idle timeout and a cache budget:
- Info reports the pipeline epoch and MLX's active, cached and peak memory, and the buffer
  cache limit the node set from its budget;
- a driver that vanishes mid-request (a coordinator restart) leaves state that the node
  frees on its idle timeout, back to the memory it used before, and a new driver is served;
- a step of another epoch (a late answer from an old placement) is refused, not computed;
- reloading the shard while an old driver's step stream stays open does not keep the old
  shard's weights alive.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from conftest import run

from cluster.decode.engine import GenerationEngine, GenerationRequest
from cluster.decode.remote_pipeline import PipelineSettings, RemotePipeline, load_pipeline
from cluster.messages import StepRequest
from cluster.transport.node_client import NodeClient, NodeRequestError
from node.server import MIN_MLX_CACHE_BYTES
from tests.daemons import LISTENING, Daemon

TOKEN = "test-node-memory-secret"
BUDGET_GB = 0.0625  # 64 MiB of request caches
IDLE_TIMEOUT_S = 1.0
FREE_DEADLINE_S = 15.0  # the idle timeout plus the node's sweep period (5 s), with room
MiB = 2**20


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("node-memory") / "node.log"
    daemon = Daemon.start(
        log,
        TOKEN,
        *("-v", "node", "--host", "127.0.0.1", "--port", "0", "--no-advertise"),
        *("--idle-timeout", str(IDLE_TIMEOUT_S), "--cache-budget-gb", str(BUDGET_GB)),
    )
    try:
        port = daemon.wait_for(LISTENING)
        yield f"127.0.0.1:{port}", daemon
    finally:
        daemon.stop()


async def _info(address: str):
    client = NodeClient(address, TOKEN)
    try:
        for _ in range(100):  # the node may still be starting
            try:
                return await client.info()
            except Exception:
                await asyncio.sleep(0.1)
        return await client.info()
    finally:
        await client.close()


async def _until_info(address: str, condition, what: str, deadline_s: float = FREE_DEADLINE_S):
    deadline = time.monotonic() + deadline_s
    while True:
        info = await _info(address)
        if condition(info):
            return info
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}; last info:\n{info}")
        await asyncio.sleep(0.2)


def test_node_memory_is_reported_bounded_and_freed(node, model_dir, tokenizer) -> None:
    address, _ = node
    prompt = tuple(tokenizer.encode("def merge_sort(items):\n"))

    async def go():
        first = await load_pipeline(model_dir, [address], PipelineSettings(TOKEN), epoch=7)
        info = await _info(address)
        assert info.epoch == 7
        assert info.mlx_active_bytes > 0 and info.mlx_peak_bytes >= info.mlx_active_bytes
        # The buffer cache keeps a batch step's buffers, within what the node's memory has
        # left beyond its weights and its caches' budgets.
        room = info.memory_total_bytes - info.weights_bytes - int(BUDGET_GB * 2**30)
        assert MIN_MLX_CACHE_BYTES <= info.mlx_cache_limit_bytes <= room - info.prefix_budget_bytes
        engine = GenerationEngine(first)
        expected = (await engine.generate(GenerationRequest(prompt, 16))).tokens
        baseline = (
            await _until_info(address, lambda i: i.active_requests == 0, "idle")
        ).mlx_active_bytes

        # The driver vanishes mid-request: no release ever comes.
        stream = engine.stream(GenerationRequest(prompt, 4000))
        await anext(stream)
        await anext(stream)
        held = await _info(address)
        assert held.active_requests == 1 and held.cache_bytes > 0
        first.release = _never_release  # nothing reaches the node any more
        await first.close()
        freed = await _until_info(
            address, lambda i: i.active_requests == 0, "the orphaned request's state freed"
        )
        assert freed.cache_bytes == 0
        assert freed.mlx_active_bytes <= baseline + 1 * MiB, (baseline, freed.mlx_active_bytes)

        # The next driver (a restarted coordinator) is served, with its own epoch.
        second = await load_pipeline(model_dir, [address], PipelineSettings(TOKEN), epoch=8)
        try:
            again = await GenerationEngine(second).generate(GenerationRequest(prompt, 16))
            assert again.tokens == expected
            # A step of the old epoch is refused, not computed.
            stale_client = NodeClient(address, TOKEN)
            stale = RemotePipeline([stale_client], max_context=second.max_context, epoch=7)
            await stale.start()
            try:
                with pytest.raises(NodeRequestError) as refused:
                    await asyncio.wait_for(
                        stale.submit(StepRequest("stale", prompt, position=0)), 10
                    )
                assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
                assert "epoch" in str(refused.value)
                # The stale stream stays open while the shard is loaded again, twice: the old
                # stages' weights must not stay alive with it.
                loaded = (await _info(address)).mlx_active_bytes
                for epoch in (9, 10):
                    settings = PipelineSettings(TOKEN)
                    reloaded = await load_pipeline(model_dir, [address], settings, epoch=epoch)
                    await reloaded.close()
                after = await _info(address)
                assert after.epoch == 10
                assert after.mlx_active_bytes <= loaded + 1 * MiB, (loaded, after.mlx_active_bytes)
            finally:
                await stale.close()
        finally:
            await second.close()
        # Still serving after all of it.
        final = await load_pipeline(model_dir, [address], PipelineSettings(TOKEN), epoch=11)
        try:
            assert (
                await GenerationEngine(final).generate(GenerationRequest(prompt, 16))
            ).tokens == expected
        finally:
            await final.close()

    run(go())


async def _never_release(request_id: str) -> None:
    """A vanished driver releases nothing."""
