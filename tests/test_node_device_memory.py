"""The memory a node reports: a discrete GPU's own where MLX runs on one, else the machine's.

MLX on CUDA sees a GPU whose memory is not the host's (a 256 GB host with a 141 GB GPU):
planning caches and MLX's buffer cache from the host's memory would overfill the GPU. The
CUDA backend is not installed here, so MLX's device queries are replaced by a GPU's answers.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import mlx.core as mx
import pytest

import node.server as server

GPU_BYTES = 141 * 10**9
HOST_BYTES = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@pytest.fixture(autouse=True)
def fresh_answers():
    server.discrete_gpu_memory_bytes.cache_clear()
    yield
    server.discrete_gpu_memory_bytes.cache_clear()


def fake_mlx(*, metal: bool, info: dict, active: int = 0, cached: int = 0) -> SimpleNamespace:
    return SimpleNamespace(
        gpu=mx.gpu,
        default_device=lambda: SimpleNamespace(type=mx.gpu),
        metal=SimpleNamespace(is_available=lambda: metal),
        device_info=lambda: info,
        get_active_memory=lambda: active,
        get_cache_memory=lambda: cached,
    )


def test_a_cuda_node_reports_its_gpu_memory_and_what_mlx_holds_there(monkeypatch) -> None:
    gpu = fake_mlx(metal=False, info={"total_memory": GPU_BYTES}, active=7 << 30, cached=1 << 30)
    monkeypatch.setattr(server, "mx", gpu)
    assert server.total_memory_bytes() == GPU_BYTES
    assert server.process_memory_bytes() == 8 << 30  # MLX's buffers on the GPU, not the RSS


def test_the_memory_cap_still_bounds_a_gpu_node(monkeypatch) -> None:
    monkeypatch.setattr(server, "mx", fake_mlx(metal=False, info={"total_memory": GPU_BYTES}))
    monkeypatch.setattr(server, "MEMORY_CAP_BYTES", 40 * 10**9)
    assert server.total_memory_bytes() == 40 * 10**9


@pytest.mark.parametrize(
    "gpu",
    [
        fake_mlx(metal=True, info={"memory_size": GPU_BYTES}),  # Apple silicon: unified memory
        fake_mlx(metal=False, info={}),  # a GPU that does not say: the machine's memory
    ],
    ids=["metal", "unknown"],
)
def test_elsewhere_the_machine_memory_counts(monkeypatch, gpu: SimpleNamespace) -> None:
    monkeypatch.setattr(server, "mx", gpu)
    assert server.discrete_gpu_memory_bytes() is None
    assert server.total_memory_bytes() == HOST_BYTES


def test_the_cpu_backend_counts_the_machine_memory_and_resident_bytes() -> None:
    assert server.discrete_gpu_memory_bytes() is None
    assert server.total_memory_bytes() == HOST_BYTES
    assert server.process_memory_bytes() > 0


def test_nodes_sharing_a_gpu_each_plan_within_their_share(monkeypatch) -> None:
    monkeypatch.setattr(server, "mx", fake_mlx(metal=False, info={"total_memory": GPU_BYTES}))
    monkeypatch.setattr(server, "MEMORY_SHARE", 0.5)
    assert server.total_memory_bytes() == GPU_BYTES // 2
    assert server.mlx_memory_limit() == GPU_BYTES // 2  # MLX frees its cache past the share
    monkeypatch.setattr(server, "MEMORY_CAP_BYTES", 40 * 10**9)  # and the cap bounds that
    assert server.total_memory_bytes() == 40 * 10**9
    assert server.mlx_memory_limit() == 40 * 10**9


def test_a_node_alone_on_its_device_leaves_mlx_memory_limit_alone(monkeypatch) -> None:
    monkeypatch.setattr(server, "mx", fake_mlx(metal=False, info={"total_memory": GPU_BYTES}))
    assert server.mlx_memory_limit() is None  # MLX's default: the whole device


@pytest.mark.parametrize("share", ["0", "1.5", "-0.5"])
def test_a_share_outside_zero_to_one_is_refused(share: str) -> None:
    from click.testing import CliRunner

    from cluster.cli import main

    result = CliRunner().invoke(main, ["node", "--token", "t", f"--memory-share={share}"])
    assert result.exit_code == 2 and "--memory-share must be in (0, 1]" in result.output
