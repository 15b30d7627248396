"""`benchmarks.hop` runs end to end (a server process, every framing compared): the step
stream, a bare gRPC echo, and a driver's two legs over the nodes' TCP port and over gRPC,
twice over (`--runs`), with the hop goal's ratio per run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_the_hop_bench_times_a_drivers_legs_beside_the_step_stream(tmp_path: Path) -> None:
    out = tmp_path / "hop.json"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.hop", "--variants", "grpc,link,driver,driver-grpc",
         "--rounds", "2", "--iters", "10", "--warmup", "5", "--shapes", "1x2x64", "1x1x64",
         "--runs", "2", "--json", str(out)],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert sorted({r["run"] for r in rows}) == [1, 2]
    for run in (1, 2):
        # A driver's step carries tokens, not hidden states: its legs are timed once, not per
        # shape.
        assert sorted((r["variant"], r["shape"]) for r in rows if r["run"] == run) == [
            ("driver", "1x2x64"), ("driver-grpc", "1x2x64"),
            ("grpc", "1x1x64"), ("grpc", "1x2x64"), ("link", "1x1x64"), ("link", "1x2x64"),
        ]  # fmt: skip
    assert all(r["median_us"] > 0 and r["iters"] == 20 for r in rows)
    median = {(r["run"], r["variant"], r["shape"]): r["median_us"] for r in rows}
    for shape in ("1x2x64", "1x1x64"):
        ratios = [median[run, "link", shape] / median[run, "grpc", shape] for run in (1, 2)]
        assert report["link_over_echo"][shape] == ratios
        printed = f"link / grpc echo at {shape}, by run: {ratios[0]:.2f} {ratios[1]:.2f}"
        assert printed in done.stdout
    by_variant = {r["variant"]: r for r in rows if r["shape"] == "1x2x64" and r["run"] == 1}
    assert by_variant["driver"]["payload_bytes"] == by_variant["driver-grpc"]["payload_bytes"]
    assert by_variant["driver"]["payload_bytes"] < by_variant["link"]["payload_bytes"]
    assert "driver-grpc" in done.stdout
