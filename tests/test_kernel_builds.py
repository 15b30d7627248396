"""Kernels built ahead (cluster.decode.kernel_builds): processes that run the warm-up's steps on a
small copy of the model fill a host's kernel cache while a node loads, without ever exposing a
half-written file to another process, and a host that built a plan once skips it after.

MLX on the CPU compiles nothing at first use, so here the builds run with `force`, and the cache
holds what the test puts there: what is checked is that the processes run the plan's steps, the
way their files reach the host's cache, and what a failure leaves."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from cluster.config import bundled_model_path
from cluster.decode import kernel_builds
from cluster.decode.kernel_builds import KernelPlan, build_kernels, merge_into, run_share
from cluster.decode.warmup import WarmupArgs
from tests.fakes import ServicerContext

# A plan of few steps: prefills of 4, 8 and 20 tokens, decode batches of 1 and 2 at each depth
# `auto` may choose, and a wave of 2 prompts.
ARGS = WarmupArgs(prefill_chunk=16, max_running=2, max_context=0, mtp_depth="auto", has_mtp=True)


def plan(dtype: str = "") -> KernelPlan:
    return KernelPlan(str(bundled_model_path()), dtype, ARGS, (0, 8))


def test_a_build_process_runs_its_share_of_the_warmup_on_a_small_copy_of_the_model():
    steps = plan().steps()
    assert [s.kind for s in steps] == ["prefill"] * 3 + ["decode"] * 2 + ["wave"]
    driven = asyncio.run(run_share(plan(), [0, 4, 5]))
    assert [(d.kind, d.size) for d in driven][:1] == [("prefill", 4)]
    decode = [d for d in driven if d.kind == "decode"]
    # Batch 2, at MTP off and every depth `auto` may draft at: each variant ran its batch.
    assert {d.size for d in decode} == {2}
    assert len(decode) == len(steps[4].variants)
    assert [(d.kind, d.size) for d in driven][-1:] == [("wave", 2)]


def test_the_processes_fill_the_cache_and_the_host_skips_the_plan_afterwards(tmp_path: Path):
    cache = tmp_path / "mlx" / "ptx"
    cache.mkdir(parents=True)
    (cache / "held.ptx").write_bytes(b"kept")
    report = asyncio.run(build_kernels(plan(), workers=2, cache_dir=cache, force=True))
    assert (report.workers, report.failed, report.skipped) == (2, 0, "")
    assert (cache / "held.ptx").read_bytes() == b"kept"
    assert [p for p in cache.parent.iterdir() if p != cache] == []  # the build dir is gone
    assert list(cache.glob("kernel-plan-*.built"))
    again = asyncio.run(build_kernels(plan(), workers=2, cache_dir=cache, force=True))
    assert again.workers == 0 and "earlier load" in again.skipped


def test_a_failed_process_is_reported_and_the_plan_is_not_marked(tmp_path: Path):
    cache = tmp_path / "ptx"
    report = asyncio.run(build_kernels(plan(dtype="no_such_dtype"), workers=2, cache_dir=cache,
                                       force=True))  # fmt: skip
    assert (report.workers, report.failed) == (2, 2)
    assert "2 failed" in report.line()
    assert not list(cache.glob("kernel-plan-*.built"))


def test_nothing_is_built_where_kernels_are_not_compiled_at_first_use(tmp_path: Path):
    report = asyncio.run(build_kernels(plan(), cache_dir=tmp_path))
    assert report.workers == 0 and "not compiled" in report.skipped
    assert list(tmp_path.iterdir()) == []


def test_files_move_in_whole_the_kernel_last_and_none_is_overwritten(tmp_path, monkeypatch):
    build, cache = tmp_path / "build", tmp_path / "cache"
    build.mkdir(), cache.mkdir()
    for name in ("a.ptx", "a.txt", "a.cu", "b.ptx", "b.txt"):
        (build / name).write_text(f"new {name}")
    (cache / "b.ptx").write_text("old")
    (cache / "b.txt").write_text("old")
    moves: list[str] = []
    real_replace = os.replace

    def replace(src, dst):
        moves.append(Path(src).name)
        real_replace(src, dst)

    monkeypatch.setattr(kernel_builds.os, "replace", replace)
    assert merge_into(build, cache) == 3
    assert moves[-1] == "a.ptx" and sorted(moves) == ["a.cu", "a.ptx", "a.txt"]
    assert (cache / "b.ptx").read_text() == "old"
    assert (cache / "a.ptx").read_text() == "new a.ptx"


@pytest.mark.parametrize(("total", "workers", "shares"), [
    (5, 2, [[0, 2, 4], [1, 3]]), (2, 8, [[0], [1]]), (3, 1, [[0, 1, 2]]),
])  # fmt: skip
def test_steps_are_dealt_in_turn(total: int, workers: int, shares: list[list[int]]):
    assert kernel_builds.share_steps(total, workers) == shares


def test_the_plan_travels_as_json_and_names_the_model_and_the_warmup():
    assert KernelPlan.from_json(plan().as_json()) == plan()
    other = KernelPlan(plan().model_dir, "", WarmupArgs(16, 3, 0, "auto", True), (0, 8))
    assert plan().key() != other.key()
    assert plan().key() == KernelPlan(plan().model_dir, "", ARGS, (8, 16)).key()


def test_warmup_plans_cross_the_wire_as_they_are():
    from cluster.decode.remote_pipeline import warmup_to_proto
    from node.server import warmup_from_proto

    for args in (ARGS, WarmupArgs(512, 8, 4096, 2, False)):
        assert warmup_from_proto(warmup_to_proto(args)) == args


def test_a_node_builds_the_plan_its_load_request_carries_beside_the_load(tmp_path, monkeypatch):
    from cluster.decode.remote_pipeline import warmup_to_proto
    from cluster.weights.store import WeightsStore
    from node import server
    from proto import cluster_pb2 as pb

    plans: list[KernelPlan] = []
    free: list[int | None] = []

    async def build(plan: KernelPlan, free_bytes: int | None) -> kernel_builds.KernelBuildReport:
        plans.append(plan)
        free.append(free_bytes)
        return await build_kernels(plan, workers=2, cache_dir=tmp_path / "ptx", force=True)

    monkeypatch.setattr(server, "build_kernels", build)
    monkeypatch.setattr(server, "compiles_kernels", lambda: True)  # as on CUDA

    async def run() -> pb.NodeInfo:
        node = server.NodeService(server.NodeSettings(token="t"), WeightsStore(tmp_path / "s"))
        try:
            request = pb.LoadShardRequest(
                model_dir=str(bundled_model_path()), start=0, end=4, is_head=True, epoch=1,
                next_node="127.0.0.1:1",
            )  # fmt: skip
            request.warmup.CopyFrom(warmup_to_proto(ARGS))
            return await node.LoadShard(request, ServicerContext())
        finally:
            await node.close()

    info = asyncio.run(run())
    assert [(p.warmup, p.layers) for p in plans] == [(ARGS, (0, 4))]
    assert 0 < free[0] < server.total_memory_bytes()  # what the node's own shard leaves
    assert (
        info.kernel_builds.startswith("kernels built ahead in ")
        and "2 processes" in info.kernel_builds
    )


def test_a_node_lacking_tensors_of_the_small_copy_builds_with_zeros_for_them(tmp_path: Path):
    """A node whose checkpoint holds no `mtp.*` (its shard's tensors only, or a conversion that
    dropped them) still runs the verify steps of every depth: its copy's MTP head is zeros."""
    from checkpoints import make_checkpoint

    from cluster.model.loading import load_shard
    from cluster.model.shard import ShardSpec

    model = make_checkpoint(tmp_path / "m", moe=False, with_mtp=False)
    shard = load_shard(model, ShardSpec(0, 4, True, True), fill_missing=True)
    assert shard.mtp is not None
    copy = KernelPlan(str(model), "", ARGS, (0, 4))
    decode = [d for d in asyncio.run(run_share(copy, [3])) if d.kind == "decode"]
    # Batch 1 at MTP off and depths 0-4: each depth's steps verify 1 + depth positions.
    assert [d.depth for d in decode] == [0, 0, 1, 2, 3, 4]
    assert decode[-1].positions > decode[1].positions


def test_processes_past_the_deadline_are_stopped_and_what_was_built_is_kept(tmp_path, monkeypatch):
    cache = tmp_path / "ptx"

    async def slow_worker(plan: KernelPlan, steps: list[int], build: Path) -> bool:
        (build / f"k{steps[0]}.txt").write_text("kernels")
        (build / f"k{steps[0]}.ptx").write_text("built")
        if steps[0] == 1:
            await asyncio.sleep(60)
        return True

    monkeypatch.setattr(kernel_builds, "_run_worker", slow_worker)
    report = asyncio.run(
        build_kernels(plan(), workers=2, cache_dir=cache, force=True, deadline_s=0.5)
    )
    assert (report.workers, report.failed, report.new_files) == (2, 1, 4)
    assert sorted(p.name for p in cache.iterdir()) == ["k0.ptx", "k0.txt", "k1.ptx", "k1.txt"]


def test_processes_are_as_many_as_half_the_memory_left_holds(tmp_path: Path):
    from cluster.model.footprint import ModelFootprint

    footprint = ModelFootprint.from_dir(bundled_model_path())
    copy = sum(footprint.layer_weight_bytes[0:4]) + footprint.extra_bytes(
        is_head=True, is_tail=True
    )
    per_worker = 1.5 * copy + kernel_builds.CONTEXT_BYTES
    assert kernel_builds.workers_within(plan(), int(per_worker * 2 * 64)) == (
        kernel_builds.default_workers()
    )
    assert kernel_builds.workers_within(plan(), int(per_worker * 2 * 1.5)) == 1
    assert kernel_builds.workers_within(plan(), int(per_worker)) == 0
    report = asyncio.run(
        build_kernels(plan(), free_bytes=int(per_worker), cache_dir=tmp_path, force=True)
    )
    assert report.workers == 0 and "memory" in report.skipped


def test_a_cancelled_build_leaves_no_process_running(tmp_path, monkeypatch):
    """A node whose load fails cancels its build: every build process is stopped with it."""
    running: set[int] = set()

    async def slow_worker(plan: KernelPlan, steps: list[int], build: Path) -> bool:
        running.add(steps[0])
        try:
            await asyncio.sleep(60)
        finally:
            running.discard(steps[0])
        return True

    monkeypatch.setattr(kernel_builds, "_run_worker", slow_worker)

    async def scenario() -> None:
        task = asyncio.ensure_future(
            build_kernels(plan(), workers=2, cache_dir=tmp_path / "ptx", force=True)
        )
        while len(running) < 2:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())
    assert running == set()
    assert [p.name for p in tmp_path.iterdir()] == ["ptx"]  # the build directory is gone
