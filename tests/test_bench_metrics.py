"""`cluster bench`'s definitions against hand-computed values: metrics, node breakdown,
workloads, baselines' ratios, the report's CSV and --compare; and the API fields it needs."""

from __future__ import annotations

import asyncio
import csv
import gzip
import itertools
import json
import random
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from cluster.bench import baselines, metrics, nodes, report
from cluster.bench.client import RequestRecord, run_scenario
from cluster.bench.workload import (
    CORPUS_PATH,
    PROMPT_STRIDE,
    PromptSource,
    Scenario,
    WorkloadError,
    positive_ints,
    scenarios,
)
from coordinator.openai_schema import ApiError, Usage, parse_completion_request
from tests.fakes import FakeEngine, serve


def _record(ttft: float, latency: float, tokens: int, itl: list[float], **kw) -> RequestRecord:
    return RequestRecord(
        sent=0.0, prompt_tokens=kw.pop("prompt", 10), completion_tokens=tokens, ttft=ttft,
        latency=latency, itl=itl, **kw,
    )  # fmt: skip


def test_vllm_definitions_by_hand() -> None:
    a = _record(0.1, 0.5, 5, [0.1, 0.1, 0.2], drafted=4, accepted=3)  # 3 chunks after the 1st
    b = _record(0.3, 0.9, 4, [0.2, 0.4], prompt=30, drafted=2, accepted=0)
    failed = RequestRecord(sent=0.0, error="HTTP 400: no")
    m = metrics.summarize([a, b, failed], duration_s=2.0)
    assert (m["completed"], m["failed"]) == (2, 1)
    assert m["total_input_tokens"] == 40 and m["total_output_tokens"] == 9
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["output_throughput"] == pytest.approx(4.5)
    assert m["total_token_throughput"] == pytest.approx(24.5)
    # TTFT 100 and 300 ms
    assert m["mean_ttft_ms"] == pytest.approx(200.0)
    assert m["median_ttft_ms"] == pytest.approx(200.0)
    assert m["p90_ttft_ms"] == pytest.approx(100 + 0.9 * 200)  # linear interpolation
    # TPOT: (0.5 - 0.1) / 4 = 100 ms and (0.9 - 0.3) / 3 = 200 ms
    assert m["mean_tpot_ms"] == pytest.approx(150.0)
    assert m["p99_tpot_ms"] == pytest.approx(100 + 0.99 * 100)
    # ITL pooled over requests: 100, 100, 200, 200, 400 ms
    assert m["mean_itl_ms"] == pytest.approx(200.0)
    assert m["median_itl_ms"] == pytest.approx(200.0)
    assert m["p90_itl_ms"] == pytest.approx(200 + 0.6 * 200)  # rank 3.6 of 0..4
    assert m["mean_e2el_ms"] == pytest.approx(700.0)
    # prefill: 40 prompt tokens over 0.4 s of TTFT; per stream: mean of 4/0.4 and 3/0.6
    assert m["prefill_throughput"] == pytest.approx(100.0)
    assert m["per_stream_throughput"] == pytest.approx(7.5)
    assert (m["mtp_drafted"], m["mtp_accepted"]) == (6, 3)
    assert m["acceptance_rate"] == pytest.approx(0.5)


def test_one_token_requests_and_no_drafts() -> None:
    m = metrics.summarize([_record(0.2, 0.2, 1, [])], duration_s=1.0)
    assert m["mean_tpot_ms"] is None and m["mean_itl_ms"] is None
    assert m["per_stream_throughput"] is None and m["acceptance_rate"] is None
    assert m["median_ttft_ms"] == pytest.approx(200.0)


def _node(node_id: str, start: int, end: int, **counters) -> dict:
    return {"node_id": node_id, "start": start, "end": end, **counters}


def test_node_breakdown_by_hand() -> None:
    cluster = {
        "nodes": [
            _node("tail", 4, 8, batches_total=10, busy_seconds_total=1.0, rtt_ms=0.9),
            _node("standby", 0, 0),
            _node(
                "head",
                0,
                4,
                batches_total=5,
                busy_seconds_total=0.5,
                rtt_ms=0.8,
                next_hop_rtt_ms=2.0,
                steps_total=5,
            ),
        ]
    }
    before = nodes.snapshot(cluster)
    later = json.loads(json.dumps(cluster))
    later["nodes"][0] |= {"batches_total": 30, "busy_seconds_total": 2.0}
    later["nodes"][2] |= {"batches_total": 25, "busy_seconds_total": 1.5, "steps_total": 45}
    rows = nodes.breakdown(before, nodes.snapshot(later), wall_s=4.0)
    assert [r["node_id"] for r in rows] == ["head", "tail"]
    head, tail = rows
    assert head["step_ms"] == pytest.approx(50.0) and head["busy_share"] == pytest.approx(0.25)
    assert head["hop_rtt_ms"] == pytest.approx(0.8)  # the coordinator's link into the head
    assert head["messages"] == 40
    assert tail["step_ms"] == pytest.approx(50.0) and tail["hop_rtt_ms"] == pytest.approx(2.0)


def test_chosen_depth_from_the_tails_counters_by_hand(tmp_path: Path) -> None:
    """The tail's cumulative depth counters, differenced over the scenario: 40 steps decided,
    30 of them at depth 0, 25 drafts chosen over them -> mean depth 0.625, 75 % at 0; in the
    table, the JSON and the CSV beside the acceptance. No step decided (MTP off): None."""
    counters = {"mtp_steps_decided": 100, "mtp_steps_plain": 60, "mtp_drafts_chosen": 50}
    cluster = {"nodes": [_node("head", 0, 4), _node("tail", 4, 8, **counters)]}
    later = json.loads(json.dumps(cluster))
    later["nodes"][1] |= {"mtp_steps_decided": 140, "mtp_steps_plain": 90,
                          "mtp_drafts_chosen": 75}  # fmt: skip
    rows = nodes.breakdown(nodes.snapshot(cluster), nodes.snapshot(later), wall_s=1.0)
    head, tail = rows
    assert (head["mtp_steps_decided"], head["mtp_drafts_chosen"]) == (0, 0)  # not the tail
    assert (tail["mtp_steps_decided"], tail["mtp_steps_plain"], tail["mtp_drafts_chosen"]) == (
        40, 30, 25,
    )  # fmt: skip
    assert nodes.depth_counts(rows) == (40, 30, 25)
    depth = metrics.chosen_depth(*nodes.depth_counts(rows))
    assert depth["auto_depth_mean"] == pytest.approx(0.625)
    assert depth["auto_depth0_share"] == pytest.approx(0.75)
    assert metrics.chosen_depth(0, 0, 0) == {"auto_depth_mean": None, "auto_depth0_share": None}

    run = _report(1.0)
    run["scenarios"][0]["nodes"] = rows
    shown = report.complete(run)["scenarios"][0]["metrics"]
    keys = list(shown)
    at = keys.index("acceptance_rate")
    assert keys[at + 1 : at + 3] == ["auto_depth_mean", "auto_depth0_share"]  # beside it
    assert "auto_depth_mean" not in run["scenarios"][0]["metrics"]  # a copy
    assert "0.62" in report.table(run) and "75%" in report.table(run)
    json_path, csv_path = report.write(run, tmp_path)
    (row,) = csv.DictReader(csv_path.open())
    saved = json.loads(json_path.read_text())["scenarios"][0]["metrics"]
    assert saved["auto_depth_mean"] == pytest.approx(0.625) == float(row["auto_depth_mean"])
    assert saved["auto_depth0_share"] == pytest.approx(0.75) == float(row["auto_depth0_share"])
    old = _report(1.0)  # no counters in its node rows (MTP off, or an older version)
    (row,) = report.csv_rows(old)
    assert row["auto_depth_mean"] is None and row["auto_depth0_share"] is None


def test_prompts_have_exact_lengths_and_distinct_prefixes(tokenizer) -> None:
    source = PromptSource(tokenizer)
    assert len(source.ids) > 60_000  # real text, tokenized
    prompts = [source.take(n) for n in (64, 64, 300)]
    assert [len(p) for p in prompts] == [64, 64, 300]
    assert prompts[0][:8] != prompts[1][:8]
    assert prompts[1] == source.ids[PROMPT_STRIDE : PROMPT_STRIDE + 64]
    corpus = gzip.decompress(CORPUS_PATH.read_bytes()).decode()
    assert tokenizer.decode(list(prompts[2])) in corpus  # real text, not random ids
    longer = source.take(len(source.ids) + 5)  # the corpus is a ring: any length fits
    assert len(longer) == len(source.ids) + 5


def test_workload_parsing_and_scenarios() -> None:
    assert positive_ints("64,256,64", "--prompt-tokens") == [64, 256]
    for bad in ("0", "a,2", "4,-1", ""):
        with pytest.raises(WorkloadError, match="--concurrency"):
            positive_ints(bad, "--concurrency")
    chosen = scenarios(
        prompt_tokens=[8, 16], max_tokens=4, concurrency=[1, 4], rates=[0.5],
        sampling=[True], mtp=[True, False], requests=None,
    )  # fmt: skip
    assert len(chosen) == 12
    assert [s.requests for s in chosen if s.concurrency == 4] == [8] * 4
    assert [s.requests for s in chosen if s.rate] == [4] * 4
    assert chosen[0].name == "p8 c=1 sampled mtp"
    with pytest.raises(WorkloadError, match="concurrency"):
        Scenario(8, 4, 1, True, True, concurrency=0)
    with pytest.raises(WorkloadError, match="either"):
        Scenario(8, 4, 1, True, True, concurrency=1, rate=1.0)


def _report(throughput: float) -> dict:
    settings = Scenario(64, 8, 2, True, True, concurrency=1).settings()
    m = metrics.summarize([_record(0.1, 0.5, 5, [0.1, 0.3])], duration_s=throughput)
    scenario = {"name": "p64 c=1 sampled mtp", "settings": settings, "metrics": m, "nodes": []}
    base = {"runs": [{"prompt_tokens": 64, "sampling": "sampled", "decode_tps": 5.0,
                      "ttft_ms": 50.0, "prefill_tps": 640.0}]}  # fmt: skip
    scenario["ratios"] = {"mlx-lm": baselines.ratios(scenario, base)}
    return {"model": "m", "scenarios": [scenario], "hardware": [], "versions": {}}


def test_csv_matches_json_and_ratios(tmp_path: Path) -> None:
    run = _report(1.0)
    ratios = run["scenarios"][0]["ratios"]["mlx-lm"]
    assert ratios["output_throughput"] == pytest.approx(1.0)  # 5 tok/s over 5
    assert ratios["median_ttft_ms"] == pytest.approx(2.0)  # 100 ms over 50
    json_path, csv_path = report.write(run, tmp_path)
    (row,) = csv.DictReader(csv_path.open())
    saved = json.loads(json_path.read_text())["scenarios"][0]
    assert float(row["output_throughput"]) == pytest.approx(saved["metrics"]["output_throughput"])
    assert float(row["median_ttft_ms_over_mlx-lm"]) == pytest.approx(2.0)
    assert row["acceptance_rate"] == ""  # None in the JSON


def test_compare_prints_ratio_of_runs() -> None:
    text = report.compare(_report(1.0), _report(0.5))  # B finished in half the time
    line = next(ln for ln in text.splitlines() if "output_throughput" in ln)
    assert line.split()[-3:] == ["5.00", "10.00", "2.00"]


def test_schema_takes_ignore_eos_and_mtp() -> None:
    body = b'{"prompt": [1, 2], "max_tokens": 3, "ignore_eos": true, "mtp": false}'
    params = parse_completion_request(body, model_id="m", max_context=64).params
    assert params.ignore_eos and not params.mtp
    defaults = parse_completion_request(b'{"prompt": "x"}', model_id="m", max_context=64).params
    assert not defaults.ignore_eos and defaults.mtp
    for bad in (b'{"prompt": "x", "mtp": 1}', b'{"prompt": "x", "ignore_eos": true}'):
        with pytest.raises(ApiError, match=r"mtp|ignore_eos"):
            parse_completion_request(bad, model_id="m", max_context=64)
    details = Usage(3, 5, drafted=4, accepted=3).body()["completion_tokens_details"]
    assert details == {"accepted_prediction_tokens": 3, "rejected_prediction_tokens": 1}
    assert "completion_tokens_details" not in Usage(3, 5).body()


def test_api_ignores_stop_tokens_and_switches_mtp_per_request() -> None:
    engine = FakeEngine(reply=lambda request: (5, 0, 6, 2, 7, 8), chunk_size=2)  # 0, 2: stops
    with serve(engine) as served:
        import urllib.request

        body = {"prompt": [3, 4], "max_tokens": 5, "ignore_eos": True, "mtp": False}
        post = urllib.request.Request(
            f"{served.url}/v1/completions", json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )  # fmt: skip
        with urllib.request.urlopen(post, timeout=30) as response:
            usage = json.load(response)["usage"]
    (request,) = engine.requests
    assert request.stop_tokens == frozenset() and request.options.mtp is False
    assert usage["completion_tokens"] == 5  # the stop tokens 0 and 2 did not end it
    # the fake drafts `index` and accepts `index // 2` by its last (third) chunk
    assert usage["completion_tokens_details"] == {
        "accepted_prediction_tokens": 1,
        "rejected_prediction_tokens": 1,
    }


class _FakeClient:
    """Stands in for `Client`: each request takes `busy_s`; records when each was sent."""

    def __init__(self, busy_s: float) -> None:
        self.busy_s, self.in_flight, self.most = busy_s, 0, 0

    async def complete(self, prompt, scenario, seed, start) -> RequestRecord:
        record = RequestRecord(sent=time.perf_counter() - start, completion_tokens=seed)
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        await asyncio.sleep(self.busy_s)
        self.in_flight -= 1
        return record


def test_closed_loop_keeps_the_level_and_open_loop_is_poisson(arun) -> None:
    closed = Scenario(8, 4, 7, True, True, concurrency=3)
    client = _FakeClient(0.02)
    records, _ = arun(run_scenario(client, closed, [(1,)] * 7, seed=100))
    assert client.most == 3 and [r.completion_tokens for r in records] == list(range(100, 107))

    rate = 20.0
    opened = Scenario(8, 4, 6, True, True, rate=rate)
    client = _FakeClient(0.3)  # longer than the gaps: the open loop does not wait for answers
    records, wall = arun(run_scenario(client, opened, [(1,)] * 6, seed=7))
    rng = random.Random(7)
    expected = [rng.expovariate(rate) for _ in range(5)]
    gaps = [b.sent - a.sent for a, b in itertools.pairwise(records)]
    assert all(gap >= want - 0.005 for gap, want in zip(gaps, expected, strict=True))
    assert client.most > 1  # sent while others were in flight
    assert wall < 6 * 0.3  # not one after the other


def test_a_failed_cache_part_is_reported_beside_the_scenarios() -> None:
    """The conversation-cache parts run after the scenarios; when one fails (a model without
    a chat template, say) the table still holds every scenario and says why it is missing."""
    run = _report(1.0) | {"errors": {"shared_prefix_ttft": "HTTP 400: no chat template"}}
    text = report.table(run)
    assert "p64 c=1 sampled mtp" in text
    assert "chats sharing a system prompt: not measured (HTTP 400: no chat template)" in text


def test_a_failed_scenario_is_reported_and_the_others_kept(arun, monkeypatch) -> None:
    """A scenario whose every request fails (a node out of memory at a long prompt) costs
    that scenario only: the others are measured, the table names it, and the command fails
    after writing them."""
    from cluster.bench import benchmark

    async def get_json(self, path: str) -> dict:
        return {"nodes": []} if path == "/api/cluster" else {"data": [{"id": "m"}]}

    async def run_checked(client, scenario, batch, seed, on_done=None):
        if scenario.prompt_tokens > 100:
            raise benchmark.BenchError(f"every request of {scenario.name} failed: HTTP 400")
        return [_record(0.1, 0.5, 5, [0.1, 0.3], prompt=scenario.prompt_tokens)], 1.0

    async def nothing(*args, **kwargs):
        return {}

    async def no_rows(*args, **kwargs):
        return []

    monkeypatch.setattr(benchmark.Client, "get_json", get_json)
    monkeypatch.setattr(benchmark, "_run_checked", run_checked)
    monkeypatch.setattr(benchmark, "counters_since", nothing)
    monkeypatch.setattr(benchmark, "_first_requests", nothing)
    monkeypatch.setattr(benchmark, "_cached_ttft", no_rows)
    monkeypatch.setattr(benchmark, "_shared_prefix_ttft", no_rows)
    short, long = (Scenario(n, 8, 1, False, True, concurrency=1) for n in (64, 4096))
    plan = benchmark.BenchPlan(Path("m"), 8192, (short, long, short))
    prompts = SimpleNamespace(take=lambda n: (1,) * n)
    run = arun(benchmark.run_benchmark("http://127.0.0.1:1", plan, prompts))
    assert [s["name"] for s in run["scenarios"]] == [short.name, short.name]
    assert report.failed_scenarios(run) == [long.name]
    assert f"{long.name} not measured: every request of {long.name} failed" in report.table(
        run | {"hardware": [], "versions": {}}
    )
