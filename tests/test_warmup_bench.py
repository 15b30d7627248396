"""`benchmarks.warmup_bench` runs end to end: `cluster up` on an empty kernel cache of its own,
timed until ready, with the warm-up's seconds and each node's kernel-build line, then stopped."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import warmup_bench


def test_a_start_on_an_empty_kernel_cache_is_timed_and_stopped(tmp_path: Path):
    out = tmp_path / "warm.json"
    warmup_bench.main(["--builds", "off", "--no-bench", "--json", str(out)])
    [run] = json.loads(out.read_text())["runs"]
    assert run["builds"] is False
    assert run["ready_s"] >= run["warmup_s"] > 0
    assert sorted(run["kernel_builds"]) == ["local-0", "local-1"]
    assert all("turned off" in line for line in run["kernel_builds"].values())
