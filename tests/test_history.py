"""The dashboard's history (coordinator.history): a bounded ring of samples whose rates come
from deltas of cumulative counters, whose latencies are percentiles of the requests finished
in each interval, and whose empty intervals say "nothing" rather than 0.

The sampler is driven directly with a fake clock: nothing here waits on real time.
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from dataclasses import dataclass, field, replace

import pytest

from cluster.decode.engine import GenerationRequest
from cluster.messages import RequestOptions
from coordinator.api_keys import ApiKeys
from coordinator.history import History, RequestRecorder, percentile
from tests.fakes import FakeClusterView, FakeEngine, node, serve


@dataclass
class Clock:
    now: float = 1000.0
    wall_offset: float = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now

    def wall(self) -> float:
        return self.wall_offset + self.now


@dataclass
class Cluster:
    clock: Clock = field(default_factory=Clock)
    view: FakeClusterView = field(default_factory=FakeClusterView)

    def history(self, **kwargs) -> History:
        recorder = RequestRecorder(self.clock)
        return History(self.view, recorder, clock=self.clock, wall=self.clock.wall, **kwargs)

    def counters(self, node_id: str, busy_s: float, batches: int) -> None:
        self.view.nodes = [
            replace(n, busy_seconds_total=busy_s, batches_total=batches)
            if n.node_id == node_id
            else n
            for n in self.view.nodes
        ]


def test_percentiles_interpolate_between_ranks():
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 99) == pytest.approx(99.01)
    assert percentile([7.0], 50) == percentile([7.0], 99) == 7.0
    assert percentile([30.0, 10.0, 20.0], 50) == 20.0  # unsorted input
    with pytest.raises(ValueError):
        percentile([], 50)


def test_the_ring_keeps_only_the_last_capacity_samples():
    cluster = Cluster()
    history = cluster.history(interval_s=2.0, capacity=5)
    for _ in range(12):
        cluster.clock.now += 2.0
        history.sample()
    assert len(history.samples) == 5
    document = history.as_json()
    assert len(document["t"]) == len(document["tokens_per_s"]) == 5
    assert document["t"] == [cluster.clock.wall() - 2.0 * k for k in (4, 3, 2, 1, 0)]
    assert document["interval_s"] == 2.0 and document["capacity"] == 5


def test_a_sample_with_no_requests_says_nothing_happened():
    cluster = Cluster()
    history = cluster.history()
    cluster.clock.now += 2.0
    sample = history.sample()
    assert sample.tokens_per_s == 0.0 and sample.requests == 0
    assert sample.ttft_p50_ms is None and sample.ttft_p99_ms is None
    assert sample.tpot_p50_ms is None and sample.tpot_p99_ms is None
    assert sample.acceptance is None  # nothing drafted: no acceptance, not 0%
    assert sample.interval_s == pytest.approx(2.0)
    document = history.as_json()
    assert document["ttft_ms"] == {"p50": [None], "p99": [None]}
    assert document["acceptance"] == [None]


def test_rates_are_deltas_of_the_cumulative_counters():
    cluster = Cluster()
    history = cluster.history()
    recorder = history.recorder
    recorder.tokens_total, recorder.drafted_total, recorder.accepted_total = 100, 40, 30
    cluster.clock.now += 2.0
    first = history.sample()
    assert first.tokens_per_s == pytest.approx(50.0)
    assert first.acceptance == pytest.approx(0.75)
    recorder.tokens_total, recorder.drafted_total, recorder.accepted_total = 130, 50, 31
    cluster.clock.now += 3.0  # a late tick: the rate is over the interval it really covered
    second = history.sample()
    assert second.tokens_per_s == pytest.approx(10.0)
    assert second.acceptance == pytest.approx(0.1)


def test_node_step_time_and_busy_share_from_counter_deltas():
    cluster = Cluster()
    cluster.view.nodes.append(replace(node(3), shard=None, node_id="standby"))
    history = cluster.history()
    cluster.counters("mac-0", busy_s=10.0, batches=1000)
    cluster.clock.now += 2.0
    first = history.sample()  # the first heard: no delta yet
    assert [n.node_id for n in first.nodes] == ["mac-0", "mac-1", "mac-2"]  # no standby node
    assert all(n.step_ms is None and n.busy_share is None for n in first.nodes)

    cluster.counters("mac-0", busy_s=11.0, batches=1200)  # 1 s over 200 batches in 2 s
    cluster.clock.now += 2.0
    second = {n.node_id: n for n in history.sample().nodes}
    assert second["mac-0"].step_ms == pytest.approx(5.0)
    assert second["mac-0"].busy_share == pytest.approx(0.5)
    assert second["mac-1"].step_ms is None  # no batch in the interval: no step time
    assert second["mac-1"].busy_share == 0.0

    cluster.counters("mac-0", busy_s=0.5, batches=50)  # restarted: counts from 0 again
    cluster.clock.now += 2.0
    third = {n.node_id: n for n in history.sample().nodes}
    assert third["mac-0"].step_ms == pytest.approx(10.0)
    assert third["mac-0"].busy_share == pytest.approx(0.25)

    document = history.as_json()
    (mac0,) = [n for n in document["nodes"] if n["node_id"] == "mac-0"]
    assert mac0["step_ms"] == [None, pytest.approx(5.0), pytest.approx(10.0)]
    assert mac0["busy_share"] == [None, pytest.approx(0.5), pytest.approx(0.25)]


def test_a_node_that_leaves_the_pipeline_keeps_aligned_series():
    cluster = Cluster()
    history = cluster.history()
    cluster.clock.now += 2.0
    history.sample()
    gone = cluster.view.nodes.pop()
    cluster.clock.now += 2.0
    history.sample()
    document = history.as_json()
    assert [n["node_id"] for n in document["nodes"]] == ["mac-0", "mac-1", gone.node_id]
    assert all(len(n["step_ms"]) == len(document["t"]) == 2 for n in document["nodes"])
    assert document["nodes"][2]["busy_share"] == [None, None]


def test_latency_percentiles_of_the_requests_finished_in_the_interval():
    cluster = Cluster()
    history = cluster.history()
    recorder = history.recorder
    for ms in range(1, 101):
        recorder.record(ms / 1000, ms / 10_000)
    recorder.record(0.5, None)  # one token only: a TTFT, no TPOT
    cluster.clock.now += 2.0
    sample = history.sample()
    assert sample.requests == 101
    assert sample.ttft_p50_ms == pytest.approx(51.0)
    assert sample.ttft_p99_ms == pytest.approx(100.0)  # rank 99 of 0..100: the 500 is p100
    assert sample.tpot_p50_ms == pytest.approx(5.05)
    assert sample.tpot_p99_ms == pytest.approx(9.901)
    cluster.clock.now += 2.0
    assert history.sample().ttft_p50_ms is None  # taken once: the next interval has none


def test_the_recorder_times_a_request_through_the_engine():
    """TTFT from the request's arrival (the admission wait included) to its first token;
    TPOT over the tokens after the first; tokens and draft deltas summed across requests."""
    clock = Clock()
    recorder = RequestRecorder(clock)
    engine = FakeEngine(reply=lambda _request: (5, 6, 7, 8, 9), chunk_size=2)
    request = GenerationRequest((1, 2), 5, RequestOptions(), frozenset())

    async def serve_one() -> None:
        timed = recorder.timed(engine, started=clock.now - 0.25)  # waited 250 ms for a slot
        async for _chunk in timed.stream(request):
            clock.now += 0.01  # each chunk of 2 tokens (the last of 1) 10 ms after the last
        recorder.finished(timed)

    asyncio.run(serve_one())
    (ttft, tpot), *_ = recorder.take_finished()
    assert ttft == pytest.approx(0.25)  # the first chunk came at once
    assert tpot == pytest.approx(0.02 / 4)  # 3 chunks span 20 ms over the 4 later tokens
    assert recorder.tokens_total == 5
    # the fake drafts `index` and accepts `index // 2` by its last (third) chunk
    assert (recorder.drafted_total, recorder.accepted_total) == (2, 1)
    assert recorder.take_finished() == []


def test_a_request_without_tokens_has_no_latency():
    clock = Clock()
    recorder = RequestRecorder(clock)
    timed = recorder.timed(FakeEngine(reply=lambda _request: ()), started=clock.now)
    recorder.finished(timed)  # refused or cancelled before its first token
    assert recorder.take_finished() == []


def test_the_sampler_task_samples_every_interval_until_cancelled():
    """`run()` is the coordinator's task; here it sleeps on the fake clock, so that the test
    counts ticks, not seconds."""
    cluster = Cluster()
    ticks = 0

    async def sleep(delay: float) -> None:
        nonlocal ticks
        assert delay == 2.0
        ticks += 1
        if ticks > 3:
            raise asyncio.CancelledError
        cluster.clock.now += delay

    history = cluster.history(interval_s=2.0, sleep=sleep)

    async def main() -> None:
        with pytest.raises(asyncio.CancelledError):
            await history.run()

    asyncio.run(main())
    assert len(history.samples) == 3
    assert [s.interval_s for s in history.samples] == [pytest.approx(2.0)] * 3


def test_a_bad_interval_or_capacity_is_refused():
    with pytest.raises(ValueError):
        Cluster().history(interval_s=0)
    with pytest.raises(ValueError):
        Cluster().history(capacity=0)


def _get(url: str, key: str | None = None) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers)) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as error:
        return error.code, json.load(error)


@pytest.mark.parametrize("open_monitoring", [False, True])
def test_the_history_needs_the_key_the_cluster_view_needs(open_monitoring: bool):
    keys = ApiKeys.of(["sk-test"], open_monitoring=open_monitoring)
    with serve(FakeEngine.saying("hi"), api_keys=keys) as served:
        for path in ("/api/cluster", "/api/history"):
            status, body = _get(served.url + path)
            if open_monitoring:
                assert status == 200, path
            else:
                assert status == 401, path
                assert body["error"]["code"] == "invalid_api_key"
            assert _get(served.url + path, "sk-wrong")[0] == (200 if open_monitoring else 401)
            assert _get(served.url + path, "sk-test")[0] == 200
        status, body = _get(served.url + "/api/history", "sk-test")
        assert body["t"] == [] and body["nodes"] == []  # nobody sampled this app's history
        assert body["interval_s"] == 2.0 and body["capacity"] == 450
