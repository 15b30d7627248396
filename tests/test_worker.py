"""`MLXWorker`: one thread runs every job in order, and after each job stays awake for the next
one for `spin_s` seconds, then sleeps on its queue."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import mlx.core as mx
import pytest

from cluster.decode.worker import GPU_SPIN_S, MLXWorker, default_spin_s


def _cpu_seconds_while_idle(worker: MLXWorker, idle_s: float) -> float:
    """The worker thread's CPU time across `idle_s` seconds without jobs."""
    before = worker.call(time.thread_time)
    time.sleep(idle_s)
    return worker.call(time.thread_time) - before


def test_jobs_run_in_order_and_errors_reach_the_caller() -> None:
    worker = MLXWorker(spin_s=0.01)
    done: list[int] = []
    futures = [worker.submit(done.append, i) for i in range(50)]
    for future in futures:
        future.result()
    assert done == list(range(50))
    with pytest.raises(ZeroDivisionError):
        worker.call(lambda: 1 / 0)

    async def from_the_loop() -> int:
        return await worker.run(sum, [1, 2, 3])

    assert asyncio.run(from_the_loop()) == 6
    worker.close()


def test_the_thread_spins_for_its_window_after_a_job_then_sleeps() -> None:
    """Awake (on the CPU) for about `spin_s` after a job, asleep for the rest of a longer gap;
    with no window, asleep throughout."""
    spinning, sleeping = MLXWorker(spin_s=0.15), MLXWorker(spin_s=0.0)
    awake = _cpu_seconds_while_idle(spinning, 0.6)
    assert 0.02 < awake < 0.4, awake  # the window's 0.15 s, not the gap's 0.6
    assert _cpu_seconds_while_idle(sleeping, 0.6) < 0.02
    spinning.close()
    sleeping.close()


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads /proc (Linux)")
def test_at_exit_the_thread_parks_at_once() -> None:
    """The exit drain leaves the thread blocked on its queue, not spinning: a daemon thread
    that takes the GIL back during the interpreter's finalization is ended there."""
    worker = MLXWorker(spin_s=5.0)
    thread_id = worker.call(threading.get_native_id)
    worker._drain()
    stat = Path(f"/proc/self/task/{thread_id}/stat")

    def cpu_ticks() -> int:  # utime + stime, after the command name (which may hold spaces)
        fields = stat.read_text().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])

    time.sleep(0.05)
    before = cpu_ticks()
    time.sleep(0.5)
    assert cpu_ticks() - before <= 2  # clock ticks (1/100 s): parked, not 0.5 s of spinning


def test_only_a_gpu_spins_by_default_and_a_negative_window_is_refused() -> None:
    previous = mx.default_device()
    try:
        mx.set_default_device(mx.cpu)
        assert default_spin_s() == 0.0 and MLXWorker().spin_s == 0.0
        if mx.metal.is_available() or mx.cuda.is_available():
            mx.set_default_device(mx.gpu)
            assert default_spin_s() == GPU_SPIN_S
    finally:
        mx.set_default_device(previous)
    with pytest.raises(ValueError, match="spin_s"):
        MLXWorker(spin_s=-1)


def test_a_node_refuses_a_negative_spin_window() -> None:
    from click.testing import CliRunner

    from cluster.commands.node import node_command

    result = CliRunner().invoke(node_command, ["--token", "secret", "--spin-ms", "-1"])
    assert result.exit_code == 2 and "--spin-ms must be >= 0" in result.output
