"""`benchmarks.gpu_bench` runs end to end on the tiny shape (CPU), so that a change to it is
caught here rather than on a GPU machine whose minutes are scarce. Its figures are not checked
(speed is reported by benchmarks, never asserted in tests), only that every phase asked for
ran and reported what the summary reads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlx.nn as nn
import pytest

from benchmarks.gpu_bench.step_timing import logits_check
from benchmarks.random_checkpoint import bench_prompt, write_checkpoint
from cluster.config import load_model_config
from cluster.model.loading import load_shard

RUN_TIMEOUT_S = 300
# The phases run on a bf16 checkpoint: the CPU's quantized matmul is slow (the side-by-side
# phase took 146 s at 4 bits and 24 s at bf16, the one-process phase 88 s and 16 s). The GPU
# runs' 4-bit checkpoint is written and loaded by a test of its own, without decoding.
BF16 = ("--bits", "16")


def _tiny_run(tmp_path: Path, *args: str) -> tuple[str, dict]:
    """gpu_bench on the tiny shape with `args`: its output and its JSON report."""
    out = tmp_path / "gpu.json"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_bench", "--shape", "tiny",
         "--dir", str(tmp_path / "ckpt"), "--json", str(out), "--prompt-len", "16", *args],
        capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout, json.loads(out.read_text())


def test_tiny_one_process_phase_reports_its_figures(tmp_path: Path) -> None:
    """The one-process phase: steps, MTP off, on and deeper, concurrent requests. (The
    side-by-side phase is the next tests'.)"""
    stdout, report = _tiny_run(
        tmp_path, "--skip", "pipeline,nodes,mlx_lm,paired", "--variants", "fused", "--tokens", "8",
        "--repeats", "1", "--concurrent", "2", "--alphas", "0.7", "--mtp-depths", "2",
        "--step-iters", "2", "--step-warmup", "1", *BF16,
    )  # fmt: skip
    single = report["single"]
    assert list(single["variants"]) == ["fused"]
    for row in single["variants"].values():
        assert row["steps"]["verify_over_plain"] > 0
        for decode in (row["mtp_off"], row["mtp_on"]["0.7"], row["mtp_depths"]["2"]):
            assert decode["tokens"] == [8] and decode["engine_over_steps"] > 0
    assert single["concurrent"]["requests"] == 2 and single["concurrent_compiled"]["runs"]
    assert "engine, 1 process: MTP off" in stdout and "its own steps" in stdout


def test_tiny_4bit_checkpoint_is_written_once_and_loads_quantized(tmp_path: Path) -> None:
    """The checkpoint the GPU runs use, 4 bits in groups of 64: written, reused when asked for
    again, and loaded as the one-process phase loads it, its layers quantized and its logits
    finite."""
    path = tmp_path / "ckpt"
    written = write_checkpoint(path, "tiny", 4, 64, seed=0)
    assert not written["reused"] and written["bytes"] > 0
    assert write_checkpoint(path, "tiny", 4, 64, seed=0)["reused"]
    assert not write_checkpoint(path, "tiny", 4, 64, seed=1)["reused"]
    shard = load_shard(path, for_decoding=True)
    quantized = [m for _, m in shard.named_modules() if isinstance(m, nn.QuantizedLinear)]
    assert quantized and {(m.bits, m.group_size) for m in quantized} == {(4, 64)}
    prompt = bench_prompt(load_model_config(path).text.vocab_size, 16)
    assert logits_check(shard, prompt)["finite"]


def test_tiny_side_by_side_phase_reports_its_ratios(tmp_path: Path) -> None:
    """The paired phase: one process, mlx-lm and two sets of 2 node processes loaded at once
    (their MLX threads awake 5 ms; one driven over the nodes' TCP streams, one over gRPC), one
    round (MTP off alternated twice), then concurrent requests in one process (MTP steps built
    before their verdicts and waiting, in turn) and over the nodes micro-batched and in one
    batch."""
    stdout, report = _tiny_run(
        tmp_path, "--skip", "single,pipeline,nodes,mlx_lm", "--rounds", "1", "--off-pairs", "2",
        "--paired-nodes", "2", "--tokens", "8", "--concurrent", "2", "--node-sets", "--spin-ms 5",
        "--driver-streams", "tcp,grpc", *BF16,
    )  # fmt: skip
    paired = report["paired"]
    # Two node sets, each its ratio.
    row = paired["rounds"][0]
    tcp, grpc = "--spin-ms 5, driver over tcp", "--spin-ms 5, driver over grpc"
    assert set(row["by_set"]) == {tcp, grpc}
    assert row["nodes_off_pairs"] == row["by_set"][tcp]["nodes_off_pairs"]
    for spun in paired["by_set"].values():
        assert spun["nodes_off_over_one_process"] > 0 and len(spun["node_step_over_share"]) == 2
    assert f"node set {grpc}: MTP off / one process" in stdout
    assert len(paired["rounds"]) == 1 and len(paired["node_step_over_share"]) == 2
    assert all(value > 0 for value in paired["ratios"].values())
    assert len(paired["rounds"][0]["nodes_off_pairs"]) == 2
    # Where a token's time went over the nodes: each node's decode steps, phase by phase.
    assert paired["nodes_off_token_ms"]["node_steps"] > 0
    for phases in paired["rounds"][0]["node_phases_ms"]:
        assert set(phases) == {"queued", "handoff", "decode", "layers", "encode", "send"}
        assert phases["layers"] > 0 and phases["handoff"] > 0
    assert "node 1 step phases, ms: " in stdout
    assert paired["ratios"]["one_process_lookahead_on_over_off"] > 0
    assert paired["ratios"]["one_process_mtp_ahead_over_waiting"] > 0
    assert paired["concurrent"]["one_process_mtp_ahead_over_waiting"] > 0
    runs = paired["concurrent"]["nodes_runs_over_one_request"]
    assert [len(runs["micro_batched"]), len(runs["one_batch"])] == [2, 2]
    # How busy each node was in each of those decodes: its batches, their compute time, their
    # share of the wall time, and the step messages each batch was formed from (one or more).
    for load in paired["concurrent"]["node_load"]["micro_batched"]:
        for decode in (load["one_request"], load["concurrent"]):
            assert len(decode["batches"]) == 2 and all(n > 0 for n in decode["batches"])
            assert all(0 < share <= 1 for share in decode["busy_share"])
            assert all(ms > 0 for ms in decode["step_ms"])
            assert all(m >= 1 for m in decode["messages_per_batch"])
    assert "concurrent MTP on (micro_batched): " in stdout and ", busy " in stdout
    assert "side by side, median of 1 rounds' ratios" in stdout


def test_tiny_side_by_side_phase_without_nodes(tmp_path: Path) -> None:
    """`--paired-nodes 0` (a host with one GPU): one process with and without steps built
    ahead, and mlx-lm, round by round."""
    stdout, report = _tiny_run(
        tmp_path, "--skip", "single,pipeline,nodes,mlx_lm", "--rounds", "2",
        "--paired-nodes", "0", "--tokens", "8", "--concurrent", "0", *BF16,
    )  # fmt: skip
    paired = report["paired"]
    assert len(paired["rounds"]) == 2 and paired["node_step_over_share"] == []
    assert not any(key.startswith("nodes") for key in paired["ratios"])
    assert paired["ratios"]["one_process_lookahead_on_over_off"] > 0
    assert "steps built ahead: MTP off" in stdout


def test_tiny_variants_interleaved(tmp_path: Path) -> None:
    """`--interleave`: the variants side by side round by round on one shard, each round's
    figures and their ratios to the first variant."""
    first, second = "fused+compiled-layers", "fused+compiled-layers+padded+few-row+recurrence"
    stdout, report = _tiny_run(
        tmp_path, "--skip", "single,pipeline,nodes,mlx_lm,paired", "--interleave", "2",
        "--variants", f"{first},{second}", "--tokens", "8", "--step-iters", "2", *BF16,
    )  # fmt: skip
    interleaved = report["interleaved"]
    assert [len(interleaved["rounds"][v]) for v in (first, second)] == [2, 2]
    summary = interleaved["summary"][second]
    assert summary["mtp_on_tps"]["over_first"] > 0 and summary["verify_over_plain"] > 0
    assert f"interleaved [{second}]" in stdout and "over the first" in stdout


def test_tiny_diagnosis_splits_a_step_and_idles_its_halves(tmp_path: Path) -> None:
    """`--diagnose`'s split step under each async_eval schedule, and each half's step back to
    back against after an idle wait and busy ones (the other phases left out)."""
    stdout, report = _tiny_run(
        tmp_path, "--diagnose", "--skip", "shapes,mlx_lm,local", "--rounds", "1",
        "--step-iters", "10", *BF16,
    )  # fmt: skip
    diag = report["diagnose"]
    assert set(diag["split_steps"]["medians"]) == {"every", "last", "both"}
    assert diag["split_steps"]["medians"]["last"]["halves_over_whole"] > 0
    idle = diag["idle_steps"]
    assert idle["gap_ms"] > 0 and len(idle["rounds"]["idle"]) == 1
    assert set(idle["over_back_to_back"]) == {"idle", "busy", "busy_without_gil"}
    assert all(v > 0 for row in idle["over_back_to_back"].values() for v in row.values())
    assert "two halves against the whole" in stdout and "ms asleep" in stdout


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--node-sets", "--spin-ms 0;--build-ahead sometimes"], "invalid choice: 'sometimes'"),
        (["--node-sets", ";--spin-ms 5 --warp 9"], "unknown settings ['--warp', '9']"),
        (["--driver-streams", "tcp,udp"], "--driver-streams takes tcp and grpc, not ['udp']"),
    ],
)
def test_bad_node_set_settings_are_refused(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from benchmarks.gpu_bench.run import parse_args

    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err
