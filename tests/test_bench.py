"""`cluster bench` end to end: --local 3 on the bundled model writes JSON, CSV and PNGs that
agree; --url against a coordinator the test starts gives the same metric set; bad input gets
a clear message and no traceback."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner
from PIL import Image

from cluster.cli import main
from cluster.messages import MAX_MTP_DEPTH
from tests.daemons import ENDPOINT, NO_WARMUP, Daemon, free_port

PLOTS = ("throughput_vs_concurrency", "itl_vs_concurrency", "ttft_vs_prompt", "mtp_on_off")
RUN_TIMEOUT_S = 240
PROMPTS = (16, 48)  # prompt tokens of the local run's two scenarios
MAX_TOKENS = 8


def _bench(*args: str, timeout: float = RUN_TIMEOUT_S) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cluster", "bench", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def local_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("bench-local")
    prompts = ",".join(map(str, PROMPTS))
    # A fixed place in the corpus, whose prompts share no prefix (a random one might).
    done = _bench("--local", "3", "--prompt-tokens", prompts, "--concurrency", "1,2",
                  "--max-tokens", str(MAX_TOKENS), "--prompt-offset", "0",
                  "--out", str(out))  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return out


@pytest.fixture(scope="module")
def coordinator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("bench-url") / "up.log"
    daemon = Daemon.start(log, "bench-token", "up", "--local", "1", "--port", "0", NO_WARMUP)
    try:
        yield daemon.wait_for(ENDPOINT)
    finally:
        daemon.stop()


def test_local_run_writes_json_csv_and_plots(local_run: Path) -> None:
    run = json.loads((local_run / "bench.json").read_text())
    for name in PLOTS:
        with Image.open(local_run / f"{name}.png") as image:
            image.verify()
            assert image.format == "PNG" and min(image.size) >= 100
    scenarios = run["scenarios"]
    settings = {(s["settings"]["prompt_tokens"], s["settings"]["concurrency"],
                 s["settings"]["mtp"]) for s in scenarios}  # fmt: skip
    assert settings == {(p, c, m) for p in PROMPTS for c in (1, 2) for m in (True, False)}
    for scenario in scenarios:
        asked = scenario["settings"]
        assert scenario["metrics"]["failed"] == 0
        assert len(scenario["requests"]) == asked["requests"] == 2 * asked["concurrency"]
        for request in scenario["requests"]:  # exact, from the server's own usage
            assert request["prompt_tokens"] == asked["prompt_tokens"]
            assert request["completion_tokens"] == MAX_TOKENS
            assert request["cached_tokens"] == 0  # no two prompts share a prefix: uncached
        metrics = scenario["metrics"]
        assert metrics["total_output_tokens"] == MAX_TOKENS * asked["requests"]
        # The depth the tail chose per step (the server's default, `auto`), from its counters.
        # No acceptance only where it stepped plainly (on a busy CPU it may never draft).
        depth, plain = metrics["auto_depth_mean"], metrics["auto_depth0_share"]
        if asked["mtp"]:
            assert 0 <= depth <= MAX_MTP_DEPTH and 0 <= plain <= 1, (depth, plain)
            assert metrics["acceptance_rate"] is not None or plain > 0, metrics
        else:
            assert depth is None and plain is None and metrics["acceptance_rate"] is None
        assert [n["node_id"] for n in scenario["nodes"]] == [h["node_id"] for h in run["hardware"]]
        assert all(0 < n["busy_share"] <= 1 and n["step_ms"] > 0 for n in scenario["nodes"])
        assert all(n["hop_rtt_ms"] > 0 for n in scenario["nodes"])  # pings and heartbeats
        assert scenario["ratios"]["mlx-lm"]["per_stream_throughput"] > 0
    first = run["first_request"]  # the run's opening request, then 3 of its shape
    assert first["prompt_tokens"] == PROMPTS[0] and len(first["warm_ttft_ms"]) == 3
    assert first["ttft_ms"] > 0 and first["over_warm"] > 0 and first["cached_tokens"] == [0] * 4
    for row in run["cached_ttft"]:  # the follow-up turn starts from the conversation cache
        assert row["cached_tokens"] == row["prompt_tokens"] and row["cached_ttft_ms"] > 0
    assert [row["prompt_tokens"] for row in run["cached_ttft"]] == list(PROMPTS)
    assert len(run["hardware"]) == 3
    assert all(h["chip"] and h["os"] and h["memory_total_bytes"] > 0 for h in run["hardware"])
    assert run["versions"]["commit"] and run["versions"]["mlx"]
    rows = list(csv.DictReader((local_run / "bench.csv").open()))
    assert [r["scenario"] for r in rows] == [s["name"] for s in scenarios]
    for row, scenario in zip(rows, scenarios, strict=True):
        for key, value in scenario["metrics"].items():
            assert row[key] == ("" if value is None else str(value)), key
        assert row["commit"] == run["versions"]["commit"] and row["mlx"] == run["versions"]["mlx"]
        for node in run["hardware"]:
            assert node["node_id"] in row["nodes"] and node["chip"] in row["nodes"]


def test_url_run_gives_the_same_metric_set(
    coordinator: str, local_run: Path, tmp_path: Path
) -> None:
    done = _bench("--url", coordinator, "--prompt-tokens", "16", "--concurrency", "2",
                  "--rate", "8", "--requests", "4", "--max-tokens", "8", "--mtp", "on",
                  "--mtp-depth", "2", "--baseline", "none", "--out", str(tmp_path))  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    remote = json.loads((tmp_path / "bench.json").read_text())
    local = json.loads((local_run / "bench.json").read_text())
    closed, poisson = remote["scenarios"]
    for scenario in (closed, poisson):
        assert scenario["metrics"].keys() == local["scenarios"][0]["metrics"].keys()
        assert scenario["nodes"][0].keys() == local["scenarios"][0]["nodes"][0].keys()
        assert [r["completion_tokens"] for r in scenario["requests"]] == [8] * 4
    assert remote["settings"]["mtp_depth"] == 2 and closed["metrics"]["mtp_drafted"] > 0
    # Each run starts at a place of its own in the corpus, recorded to repeat it.
    assert local["settings"]["prompt_offset"] == 0
    assert isinstance(remote["settings"]["prompt_offset"], int)
    for scenario in (closed, poisson):  # a fixed depth: chosen on every step, over `cluster up`
        assert scenario["metrics"]["auto_depth_mean"] == 2.0
        assert scenario["metrics"]["auto_depth0_share"] == 0.0
    assert poisson["settings"]["rate"] == 8.0 and poisson["settings"]["concurrency"] is None
    assert "p16 c=2 sampled mtp" in done.stdout and "p16 rate=8/s sampled mtp" in done.stdout
    assert "TTFT of the run's first request (p16)" in done.stdout


def test_compare_two_runs(local_run: Path, tmp_path: Path) -> None:
    run = json.loads((local_run / "bench.json").read_text())
    for scenario in run["scenarios"]:
        scenario["metrics"]["output_throughput"] *= 2
    (tmp_path / "b.json").write_text(json.dumps(run))
    done = CliRunner().invoke(
        main, ["bench", "--compare", str(local_run / "bench.json"), str(tmp_path / "b.json")]
    )
    assert done.exit_code == 0, done.output
    ratios = [ln.split()[-1] for ln in done.output.splitlines() if "output_throughput" in ln]
    assert ratios == ["2.00"] * 8


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--url", f"http://127.0.0.1:{free_port()}"], "cannot reach"),
        (["--url", "http://127.0.0.1:1", "--prompt-tokens", "9000"], "context is 8192 tokens"),
        (["--local", "3", "--concurrency", "0"], "--concurrency values must be >= 1"),
        (["--hosts", "no-such-cluster.toml"], "no such cluster file"),
        (["--local", "1", "--mtp-depth", "9"], "mtp_depth must be 0..8"),
        (["--local", "2", "--url", "http://x"], "exactly one of"),
    ],
)
def test_bad_input_is_a_clear_message(args: list[str], message: str) -> None:
    done = CliRunner().invoke(main, ["bench", *args, "--baseline", "none"])
    assert done.exit_code != 0
    assert message in done.output
    assert isinstance(done.exception, SystemExit)  # click's exit, not an uncaught error


def test_step_profile_times_the_layers_and_the_tail(tmp_path: Path) -> None:
    """The developer profile of one decode step (`benchmarks.step_profile`) on the bundled
    model: every kind of step reports its layers and its tail (`Tail.launch` + `conclude`)."""
    from benchmarks import step_profile

    out = tmp_path / "profile.json"
    assert step_profile.main(["--iters", "1", "--batch", "2", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {(r["requests"], r["mtp"]) for r in rows} == {
        (1, False),
        (1, True),
        (2, False),
        (2, True),
    }
    assert all(r["layers_ms"] > 0 and r["tail_ms"] > 0 and r["step_ms"] > 0 for r in rows)
    ceilings = json.loads(out.read_text())["batching_ceiling"]
    assert set(ceilings) == {"mlx-lm forward", "engine plain step", "engine MTP step"}
    assert all(c > 0 for c in ceilings.values())


def test_stepped_requests_decode_what_plain_steps_decode() -> None:
    """The step benchmarks' hand-stepped requests (`benchmarks.stepping`) feed each step
    the tail's drafts and the last step's rollback: greedy, every depth emits the tokens that
    plain steps emit, on one runner that steps the kinds in turns."""
    from benchmarks.stepping import SteppedRequests, bare_runner, interleaved
    from cluster.config import bundled_model_path

    runner = bare_runner(bundled_model_path())
    ids = (785, 3827, 374, 264, 1273)
    kinds = {
        depth: SteppedRequests(runner, ids, size=2, depth=depth, name=f"d{depth}")
        for depth in (None, 0, 1, 3)
    }
    emitted = {depth: [list(r.tokens) for r in kinds[depth].results] for depth in kinds}

    def record(depth):
        for seq, result in zip(emitted[depth], kinds[depth].results, strict=True):
            seq.extend(result.tokens)

    calls = {depth: (lambda d=depth: (kinds[d](), record(d))[0]) for depth in kinds}
    times = interleaved(calls, iters=12, warmup=0, seed=1)
    assert all(len(t) == 12 and min(t) > 0 for t in times.values())
    shortest = min(len(seq) for seqs in emitted.values() for seq in seqs)
    assert shortest >= 13
    for depth, seqs in emitted.items():
        assert [seq[:shortest] for seq in seqs] == [seq[:shortest] for seq in emitted[None]], (
            f"depth {depth}"
        )
