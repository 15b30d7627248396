"""The warm-up: before the coordinator says it is ready, every node has run every shape it
will serve (prefill chunks, each decode batch size up to the admission limit, each MTP verify
width), and the synthetic requests left nothing behind: no request counted, no prefix cached,
no state on a node, no change to what a real request generates."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import re
from pathlib import Path

import aiohttp
import nodes
import pytest
from conftest import CODE_PROMPTS

from cluster.config import load_model_config
from cluster.decode.local_engine import open_local_engine
from cluster.decode.mtp_depth import AUTO_MAX_DEPTH
from cluster.decode.warmup import (
    Variant,
    WarmupProgress,
    WarmupStep,
    plan_warmup,
    prefill_lengths,
    run_warmup,
)
from cluster.generate import run_generate
from cluster.messages import RequestOptions
from coordinator.service import run_coordinator
from coordinator.settings import CoordinatorSettings
from tests.daemons import free_port

node_factory = nodes.node_factory

MAX_RUNNING = 3
MTP_DEPTH = 2


def planned_shapes(steps: list[WarmupStep]) -> set[tuple[str, int, bool, int]]:
    """(kind, size, mtp, depth) of every run the plan asks for."""
    return {
        (step.kind, step.size, v.mtp, v.depth if v.mtp else 0)
        for step in steps
        for v in step.variants
    }


# ---- the plan ----


def test_the_plan_covers_each_prefill_length_batch_size_and_depth():
    steps = plan_warmup(
        prefill_chunk=512, max_running=8, max_context=8192, mtp_depth=1, has_mtp=True
    )
    # Shorter last chunks, then a full chunk followed by a chunk at an offset.
    assert prefill_lengths(512, 8192) == [4, 8, 16, 32, 64, 128, 256, 516]
    shapes = planned_shapes(steps)
    assert {s for s in shapes if s[0] == "prefill"} == {
        ("prefill", n, True, 1) for n in (4, 8, 16, 32, 64, 128, 256, 516)
    }
    assert {s for s in shapes if s[0] == "decode"} == {
        ("decode", k, mtp, depth) for k in range(1, 9) for mtp, depth in ((False, 0), (True, 1))
    }
    assert [s.label for s in steps][8] == "decode batch 1 (MTP off, MTP depth 1)"

    auto = plan_warmup(
        prefill_chunk=512, max_running=2, max_context=8192, mtp_depth="auto", has_mtp=True
    )
    assert {(s[2], s[3]) for s in planned_shapes(auto) if s[0] == "decode"} == {
        (False, 0),
        *((True, d) for d in range(AUTO_MAX_DEPTH + 1)),
    }
    without_mtp = plan_warmup(
        prefill_chunk=64, max_running=2, max_context=8192, mtp_depth="auto", has_mtp=False
    )
    assert planned_shapes(without_mtp) == {
        ("prefill", 4, False, 0),
        ("prefill", 8, False, 0),
        ("prefill", 16, False, 0),
        ("prefill", 32, False, 0),
        ("prefill", 68, False, 0),
        ("decode", 1, False, 0),
        ("decode", 2, False, 0),
        ("wave", 2, False, 0),
    }


def test_the_plan_ends_with_users_prompts_at_the_admission_limit_at_the_served_depth():
    """Several prompts prefilled at once: the batches they make (several requests' chunks,
    decode batches made from such prefills, requests at different `auto` depths) are shapes
    of their own."""
    steps = plan_warmup(
        prefill_chunk=512, max_running=8, max_context=8192, mtp_depth="auto", has_mtp=True
    )
    assert (steps[-1].kind, steps[-1].size, steps[-1].variants) == (
        "wave",
        8,
        (Variant(True, "auto"),),
    )
    assert steps[-1].label == "8 prompts at once (MTP depth auto)"
    one = plan_warmup(prefill_chunk=512, max_running=1, max_context=8192, mtp_depth=2, has_mtp=True)
    assert {s.kind for s in one} == {"prefill", "decode"}  # one user: no wave
    # Users' prompts differ in length: a prefill of several lengths attends prompt by prompt
    # and leaves decode batches at different offsets, kernels that prompts of one length
    # never build. Every micro-batch of the wave (two, on two nodes) holds several lengths.
    lengths = [len(r.prompt) for r in steps[-1].requests(Variant(True, "auto"), 1000)]
    assert len(set(lengths[:4])) > 1 and len(set(lengths[4:])) > 1


def test_the_progress_as_the_terminal_the_dashboard_and_prometheus_see_it():
    progress = WarmupProgress("warming")
    assert progress.as_json()["state"] == "warming"
    progress.begin(5)
    progress.done, progress.step = 2, "decode batch 4 (MTP off)"
    assert progress.line() == "warming 3/5: decode batch 4 (MTP off)"
    assert "cluster_warming 1\n" in progress.prometheus()
    progress.done = 5
    progress.finish()
    view = progress.as_json()
    assert view["state"] == "ready" and view["done"] == view["total"] == 5
    assert progress.line().startswith("warm in ")
    assert "cluster_warming 0\n" in progress.prometheus()
    assert "# TYPE cluster_warmup_seconds gauge\ncluster_warmup_seconds " in progress.prometheus()


# ---- in one process: every depth `auto` may draft ----


def test_warmup_in_one_process_runs_every_planned_shape_and_releases_it(model_dir: Path, arun):
    async def scenario() -> WarmupProgress:
        local = await open_local_engine(model_dir, mtp=True)
        try:
            pipeline = local.engine.pipeline
            steps = plan_warmup(
                prefill_chunk=32,
                max_running=2,
                max_context=pipeline.max_context,
                mtp_depth="auto",
                has_mtp=True,
            )
            progress = WarmupProgress("warming")
            await run_warmup(
                pipeline,
                steps,
                prefill_chunk=32,
                vocab_size=local.config.text.vocab_size,
                progress=progress,
            )
            assert {d.shape for d in progress.driven} == planned_shapes(steps)
            assert all(not runner.requests for runner in local.runners), "state left behind"
            assert all(len(runner.snapshots) == 0 for runner in local.runners)
            return progress
        finally:
            local.close()

    progress = arun(scenario())
    assert progress.state == "ready" and progress.done == progress.total


def test_the_last_task_runs_while_the_warmup_still_says_warming(model_dir: Path, arun):
    """The coordinator's chunk timing runs as the warm-up's last line: /health and `up` say
    ready only after it, not while it still holds the admission queue."""
    seen: list[tuple[str, str, int, int]] = []

    async def scenario() -> WarmupProgress:
        local = await open_local_engine(model_dir, mtp=False)
        try:
            progress = WarmupProgress("warming")

            async def timing() -> None:
                seen.append((progress.state, progress.step, progress.done, progress.total))

            await run_warmup(
                local.engine.pipeline,
                [WarmupStep("prefill", 4, (Variant(False),))],
                prefill_chunk=32,
                vocab_size=local.config.text.vocab_size,
                progress=progress,
                last=("timing prefill chunks", timing),
            )
            return progress
        finally:
            local.close()

    progress = arun(scenario())
    assert seen == [("warming", "timing prefill chunks", 1, 2)]
    assert progress.state == "ready" and progress.done == progress.total == 2


# ---- the coordinator over node daemons ----


@pytest.fixture(scope="module")
def trio(node_factory) -> nodes.NodeGroup:
    return node_factory(3)


def _settings(model_dir: Path, trio: nodes.NodeGroup, *, warmup: bool) -> CoordinatorSettings:
    return CoordinatorSettings(
        model_dir,
        trio.token,
        nodes=tuple(trio.addresses),
        browse=False,
        use_all=True,
        serve_weights=False,
        port=free_port(),
        max_running=MAX_RUNNING,
        mtp_depth=MTP_DEPTH,
        warmup=warmup,
    )


async def _positions(addresses: list[str]) -> list[int]:
    return [info.positions_computed for info in await nodes.node_infos(addresses)]


async def _greedy_texts(http: aiohttp.ClientSession, url: str, tokenizer) -> list[str]:
    """Greedy completions of two prompts, MTP off and on."""
    texts = []
    for prompt in CODE_PROMPTS[:2]:
        for mtp in (False, True):
            body = {
                "prompt": list(tokenizer.encode(prompt)),
                "max_tokens": 24,
                "temperature": 0,
                "mtp": mtp,
            }
            async with http.post(f"{url}/v1/completions", json=body) as response:
                assert response.status == 200, await response.text()
                texts.append((await response.json())["choices"][0]["text"])
    return texts


async def _serving(settings: CoordinatorSettings, hook=None):
    started = asyncio.Event()
    task = asyncio.create_task(run_coordinator(settings, started=started, warmup_hook=hook))
    return started, task


async def _stop(task: asyncio.Task) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def test_the_coordinator_is_ready_only_once_every_shape_ran_on_every_node(
    trio, model_dir, tokenizer, capfd, arun
):
    settings = _settings(model_dir, trio, warmup=True)
    url = f"http://127.0.0.1:{settings.port}"
    addresses = trio.addresses

    async def scenario() -> tuple[list, list[str], dict]:
        held, release = asyncio.Event(), asyncio.Event()
        # Before each step and at the end: what the warm-up had driven by then, and what the
        # nodes had computed.
        marks: list[tuple[int, list[int]]] = []

        async def hook(progress: WarmupProgress) -> None:
            seen["driven"] = progress.driven
            marks.append((len(progress.driven), await _positions(addresses)))
            if progress.done == 1 and progress.state == "warming":
                held.set()
                await release.wait()

        started, task = await _serving(settings, hook)
        try:
            waiting = asyncio.ensure_future(held.wait())
            await asyncio.wait([waiting, task], return_when=asyncio.FIRST_COMPLETED)
            assert held.is_set(), task.exception() if task.done() else "not held"
            async with aiohttp.ClientSession() as http:
                async with http.get(f"{url}/health") as response:
                    assert response.status == 503
                    health = await response.json()
                assert health["status"] == "warming", health
                assert health["warmup"]["done"] == 1 and health["warmup"]["total"] > 1
                async with http.get(f"{url}/api/cluster") as response:
                    warming = (await response.json())["warmup"]
                assert warming["state"] == "warming"
                assert warming["line"].startswith(f"warming 2/{warming['total']}: ")
                assert "OpenAI endpoint" not in capfd.readouterr().out, "announced while cold"

                release.set()
                await asyncio.wait_for(started.wait(), 120)
                out = capfd.readouterr().out
                assert "OpenAI endpoint" in out and "warm in " in out
                assert out.index("warm in ") < out.index("OpenAI endpoint")
                async with http.get(f"{url}/health") as response:
                    assert response.status == 200
                    assert (await response.json())["status"] == "ok"
                async with http.get(f"{url}/api/cluster") as response:
                    cluster = await response.json()
                async with http.get(f"{url}/metrics") as response:
                    metrics = await response.text()
                # Nothing of the warm-up is left on the nodes.
                infos = await nodes.node_infos(addresses)
                assert [i.active_requests for i in infos] == [0, 0, 0]
                assert [i.prefix_snapshots for i in infos] == [0, 0, 0]
                texts = await _greedy_texts(http, url, tokenizer)
            seen.update(cluster=cluster, metrics=metrics, out=out)
            return marks, texts
        finally:
            await _stop(task)

    seen: dict = {}
    marks, warm_texts = arun(scenario())
    cluster, metrics, driven = seen["cluster"], seen["metrics"], seen["driven"]
    warmup = cluster["warmup"]
    assert warmup["state"] == "ready" and warmup["done"] == warmup["total"]
    assert warmup["seconds"] > 0 and not warmup["skipped"] and not warmup["error"]
    seconds = next(line for line in metrics.splitlines() if line.startswith("cluster_warmup_"))
    assert float(seconds.split()[1]) > 0
    # The chunk measured for prompts that arrive while others decode is the one served.
    interleave = re.search(r"prefill chunk \d+ tokens, (\d+) while others decode", seen["out"])
    assert interleave, seen["out"]
    assert f"cluster_interleave_chunk_tokens {interleave[1]}\n" in metrics
    # Synthetic requests are no requests: nothing counted, nothing cached.
    stats = cluster["stats"]
    assert stats["requests_total"] == 0 and stats["tokens_per_s"] == 0
    assert stats["prefix_cache_entries"] == 0 and stats["prefix_cache_hits"] == 0
    assert "cluster_requests_total 0\n" in metrics
    assert "cluster_completion_tokens_total 0\n" in metrics

    # Every planned shape ran, at its size: prefill lengths, and decode steps of each width
    # with as many requests in flight as the batch size.
    steps = plan_warmup(
        prefill_chunk=512,
        max_running=MAX_RUNNING,
        max_context=load_model_config(model_dir).max_context,
        mtp_depth=MTP_DEPTH,
        has_mtp=True,
    )
    assert {d.shape for d in driven} == planned_shapes(steps)
    # ... and every node computed each position the warm-up fed, step by step.
    assert len(marks) == len(steps) + 1  # before each step, and at the end
    for (first, before), (last, after) in itertools.pairwise(marks):
        fed = sum(d.positions for d in driven[first:last])
        assert fed > 0
        assert [b - a for a, b in zip(before, after, strict=True)] == [fed] * 3

    # A real request after the warm-up generates what it does without one.
    cold_texts = arun(_unwarmed_texts(model_dir, trio, tokenizer))
    assert warm_texts == cold_texts


async def _unwarmed_texts(model_dir: Path, trio, tokenizer) -> list[str]:
    settings = _settings(model_dir, trio, warmup=False)
    url = f"http://127.0.0.1:{settings.port}"
    started, task = await _serving(settings)
    try:
        await asyncio.wait_for(started.wait(), 120)
        # No warm-up ran: the nodes computed nothing before this request.
        assert await _positions(trio.addresses) == [0, 0, 0]
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{url}/api/cluster") as response:
                warmup = (await response.json())["warmup"]
            assert warmup["state"] == "ready" and warmup["skipped"]
            async with http.get(f"{url}/health") as response:
                assert response.status == 200
            return await _greedy_texts(http, url, tokenizer)
    finally:
        await _stop(task)


# ---- cluster generate ----


def test_generate_warms_up_before_timing_and_generates_the_same(model_dir: Path, arun):
    async def both() -> tuple[dict, dict]:
        options = RequestOptions(mtp=True, mtp_depth=1)
        prompt = CODE_PROMPTS[0]
        warm = await run_generate(model_dir, prompt, chat=False, max_tokens=16, options=options)
        cold = await run_generate(
            model_dir, prompt, chat=False, max_tokens=16, options=options, warmup=False
        )
        return warm, cold

    warm, cold = arun(both())
    assert warm["tokens"] == cold["tokens"]
    assert warm["warmup_s"] > 0 and cold["warmup_s"] == 0
