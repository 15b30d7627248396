"""The longest request served (`--max-context`): planned into every node's memory, refused at
admission beyond it, and the memory the running requests hold reported per node.

Placement reserves, per node, the caches of `--max-running` requests at that context and a
conversation snapshot for each; `cluster plan --context` shows the reservation and refuses
one that does not fit. The limit comes from a flag or the cluster file's `max_context` (the
flag wins) and may not exceed the model's own context. A prompt beyond it is a 400 naming it,
through chat and completions, before it takes a slot. `cluster up --local 2` serves it end to
end, and /metrics shows each node's request caches while a request runs.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import re
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner

from cluster.commands import up as up_module
from cluster.commands.coordinator import build_settings, coordinator_command
from cluster.commands.plan import plan_command
from cluster.commands.up import hosts_serving, up_command
from cluster.config import bundled_model_path, load_model_config
from cluster.hosts.clusterfile import ClusterFileError, load_cluster_file
from cluster.model.footprint import ModelFootprint, model_max_context
from cluster.placement import (
    CONTEXT_STEP,
    SAFETY_MARGIN,
    NodeCapacity,
    PlacementError,
    longest_context,
    plan_longest_context,
    plan_placement,
)
from coordinator.settings import CoordinatorSettings, MaxContextError, ServingOptions
from tests.daemons import NO_WARMUP, START_DEADLINE_S, stop_process_group, wait_until
from tests.fakes import FakeEngine, serve

MODEL_CONTEXT = 8192  # the bundled model's max_position_embeddings
MIB = 1 << 20


@pytest.fixture(scope="module")
def footprint() -> ModelFootprint:
    return ModelFootprint.from_dir(bundled_model_path())


def _node(node_id: str, usable: int) -> NodeCapacity:
    """A node whose usable memory (free less the safety margin) is at least `usable`."""
    return NodeCapacity(node_id, f"{node_id}:1", math.ceil(usable / (1 - SAFETY_MARGIN)) + 1)


# --- the model's own context -------------------------------------------------------------------


def test_the_model_context_is_read_as_the_engine_reads_it() -> None:
    path = bundled_model_path()
    assert model_max_context(path) == load_model_config(path).max_context == MODEL_CONTEXT


# --- placement ---------------------------------------------------------------------------------


def test_each_node_reserves_kv_gdn_state_and_a_snapshot_per_request(footprint) -> None:
    m = footprint
    plan = plan_placement(
        [_node("a", 1 << 30), _node("b", 1 << 30)],
        m,
        context_tokens=4096,
        concurrency=3,
        layers=[(0, 4), (4, 8)],
        prefix_cache=True,
    )
    head, tail = plan.stages
    # Layer 3 (head) and layer 7 (tail) are the attention layers; the tail also holds the
    # MTP head's KV cache.
    assert head.kv_bytes == m.kv_bytes_per_token * 4096 * 3
    assert tail.kv_bytes == 2 * m.kv_bytes_per_token * 4096 * 3
    assert head.gdn_bytes == tail.gdn_bytes == 3 * m.gdn_state_bytes * 3
    for stage in plan.stages:
        assert stage.snapshot_bytes == stage.kv_bytes + stage.gdn_bytes
        assert stage.required_bytes == stage.weight_bytes + 2 * stage.cache_bytes
    without = plan_placement(
        [_node("a", 1 << 30), _node("b", 1 << 30)],
        m,
        context_tokens=4096,
        concurrency=3,
        layers=[(0, 4), (4, 8)],
    )
    assert [s.snapshot_bytes for s in without.stages] == [0, 0]


def test_a_placement_that_does_not_fit_names_the_node_and_the_bytes_over(footprint) -> None:
    kwargs: dict[str, Any] = {"context_tokens": 8192, "concurrency": 8, "prefix_cache": True}
    need = plan_placement([_node("big", 1 << 30)], footprint, **kwargs).stages[0].required_bytes
    short = NodeCapacity("small", "", int(need / (1 - SAFETY_MARGIN)) - 1000)
    with pytest.raises(PlacementError) as refused:
        plan_placement([short], footprint, **kwargs)
    over = need - short.usable_bytes
    assert "node small offers" in str(refused.value)
    assert f"({over} bytes) over" in str(refused.value)
    assert "8 requests of 8192 tokens, with a conversation snapshot each" in str(refused.value)
    # With the split fixed, the refusal names the stage's node and its parts.
    with pytest.raises(PlacementError, match=r"node b: layers \[4, 8\) need .* over"):
        plan_placement(
            [_node("a", 1 << 30), NodeCapacity("b", "", 20 * MIB)],
            footprint,
            layers=[(0, 4), (4, 8)],
            **kwargs,
        )


def test_the_longest_context_that_fits_is_found(footprint) -> None:
    kwargs: dict[str, Any] = {"concurrency": 8, "prefix_cache": True}
    nodes = [_node("a", 40 * MIB), _node("b", 40 * MIB)]
    longest = longest_context(nodes, footprint, max_context=MODEL_CONTEXT, **kwargs)
    assert 0 < longest < MODEL_CONTEXT and longest % CONTEXT_STEP == 0
    plan_placement(nodes, footprint, context_tokens=longest, **kwargs)
    with pytest.raises(PlacementError):
        plan_placement(nodes, footprint, context_tokens=longest + CONTEXT_STEP, **kwargs)
    plan = plan_longest_context(nodes, footprint, max_context=MODEL_CONTEXT, **kwargs)
    assert plan.context_tokens == longest
    # Where the model's own context fits, that is the plan's; where nothing fits, the error
    # of the context asked for.
    roomy = [_node("a", 1 << 30)]
    assert plan_longest_context(roomy, footprint, max_context=777, **kwargs).context_tokens == 777
    with pytest.raises(PlacementError, match="does not fit"):
        plan_longest_context([_node("a", MIB)], footprint, max_context=MODEL_CONTEXT, **kwargs)


# --- cluster plan ------------------------------------------------------------------------------


def test_cluster_plan_shows_the_reservation_per_node() -> None:
    result = CliRunner().invoke(
        plan_command,
        [
            "--node",
            "a=1",
            "--node",
            "b=1",
            "--all-nodes",
            "--context",
            "4096",
            "--max-running",
            "4",
        ],
    )
    assert result.exit_code == 0, result.output
    assert (
        "max context: 4096 tokens per request (as asked), reserved for 4 requests" in result.output
    )
    header = next(line for line in result.output.splitlines() if line.startswith("stage"))
    for column in ("weights", "KV", "GDN state", "snapshots", "total", "free", "used"):
        assert column in header
    assert "context 4096 tokens x 4 requests, one snapshot per request" in result.output
    # --max-context is the same option; without snapshots the column is 0.
    bare = CliRunner().invoke(
        plan_command, ["--node", "a=1", "--max-context", "4096", "--no-prefix-cache"]
    )
    assert bare.exit_code == 0, bare.output
    assert "no conversation cache" in bare.output
    # Not given: the model's own context where it fits.
    default = CliRunner().invoke(plan_command, ["--node", "a=1"])
    assert f"max context: {MODEL_CONTEXT} tokens per request (the model's own)" in default.output


def test_cluster_plan_refuses_a_context_that_does_not_fit() -> None:
    result = CliRunner().invoke(plan_command, ["--node", "a=0.05", "--context", "8192"])
    assert result.exit_code == 1
    assert "node a offers" in result.output and "over" in result.output
    assert re.search(r"hint: --max-context \d+ fits", result.output)
    # Not given, the longest that fits is planned and said so.
    fitted = CliRunner().invoke(plan_command, ["--node", "a=0.05"])
    assert fitted.exit_code == 0, fitted.output
    assert "the longest that fits; the model's own 8192 does not" in fitted.output


@pytest.mark.parametrize("value", ["0", "-5", str(MODEL_CONTEXT + 1)])
def test_cluster_plan_refuses_a_context_the_model_cannot_serve(value: str) -> None:
    result = CliRunner().invoke(plan_command, ["--node", "a=1", "--context", value])
    assert result.exit_code == 2
    assert "--max-context" in result.output


# --- the flag and the cluster file -------------------------------------------------------------


def _cluster_file(tmp_path: Path, extra: str) -> Path:
    path = tmp_path / "cluster.toml"
    path.write_text(f'model = "{bundled_model_path()}"\n{extra}\n[[node]]\nssh = "root@10.0.0.1"\n')
    return path


def test_the_cluster_file_key_reaches_the_coordinator_and_the_flag_wins(tmp_path: Path) -> None:
    cluster = load_cluster_file(_cluster_file(tmp_path, "max_context = 2048"))
    settings = build_settings(hosts_serving(cluster, ServingOptions()), cluster.model, "s")
    assert settings.max_context == 2048
    flags = ServingOptions(max_context=1024)
    assert build_settings(hosts_serving(cluster, flags), cluster.model, "s").max_context == 1024
    # Neither: the model's own (or the longest that fits), decided at placement.
    cluster = load_cluster_file(_cluster_file(tmp_path, ""))
    assert (
        build_settings(hosts_serving(cluster, ServingOptions()), cluster.model, "s").max_context
        is None
    )


@pytest.mark.parametrize(
    ("line", "named"),
    [("max_context = 0", "max_context must be at least 1"), ('max_context = "8k"', "max_context")],
)
def test_a_bad_max_context_in_the_cluster_file_is_named(
    tmp_path: Path, line: str, named: str
) -> None:
    with pytest.raises(ClusterFileError, match=named):
        load_cluster_file(_cluster_file(tmp_path, line))


def test_a_max_context_beyond_the_model_is_refused_before_anything_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster = load_cluster_file(_cluster_file(tmp_path, f"max_context = {MODEL_CONTEXT + 1}"))
    with pytest.raises(click.BadParameter, match=f"the model's own context of {MODEL_CONTEXT}"):
        build_settings(hosts_serving(cluster, ServingOptions()), cluster.model, "s")

    def no_node(*args: object, **kwargs: object) -> None:
        raise AssertionError("a node was started")

    monkeypatch.setattr(up_module.subprocess, "Popen", no_node)
    too_long = str(MODEL_CONTEXT + 1)
    for command, argv in [
        (up_command, ["--local", "1", "--max-context", too_long]),
        (coordinator_command, ["--token", "t", "--max-context", too_long]),
        (up_command, ["--local", "1", "--max-context", "0"]),
    ]:
        result = CliRunner().invoke(command, argv)
        assert result.exit_code == 2, result.output
        assert "--max-context" in result.output
    with pytest.raises(MaxContextError):
        CoordinatorSettings(bundled_model_path(), "t", max_context=0)


# --- refused at admission ----------------------------------------------------------------------


def _post(url: str, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(
        f"{url}{path}", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def _over_the_limit(url: str, limit: int) -> None:
    """Chat and completions beyond `limit` are 400s that name it; within it, served."""
    long_text = "word " * (limit + 10)
    refused = [
        ("/v1/completions", {"prompt": long_text}),
        ("/v1/completions", {"prompt": "def f(", "max_tokens": limit}),
        ("/v1/completions", {"prompt": "def f(", "max_tokens": limit + 1}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": long_text}]}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": limit - 5},
        ),
    ]
    for path, body in refused:
        status, answer = _post(url, path, body)
        assert status == 400, (path, answer)
        error = answer["error"]
        assert f"--max-context {limit}" in error["message"], error
        assert error["code"] == "context_length_exceeded"
    status, answer = _post(url, "/v1/completions", {"prompt": "def f(", "max_tokens": 2})
    assert status == 200, answer


def test_a_prompt_over_the_limit_is_refused_before_it_takes_a_slot() -> None:
    with serve(FakeEngine.saying("ok", max_context=64)) as served:
        _over_the_limit(served.url, 64)
        assert len(served.engine.requests) == 1  # only the request within the limit ran
        assert served.admission.running == 0


# --- end to end: cluster up --local 2 --max-context ---------------------------------------------

_ENDPOINT = re.compile(r"OpenAI endpoint: (\S+)/v1")


@contextmanager
def _up(tmp_path: Path, *argv: str) -> Iterator[str]:
    log = tmp_path / "up.log"
    process = subprocess.Popen(
        [sys.executable, "-m", "cluster", "up", "--local", "2", "--port", "0", *argv],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        env={**os.environ, "CLUSTER_TOKEN": "max-context-test"},
        start_new_session=True,
    )

    def endpoint() -> str | None:
        if process.poll() is not None:
            raise AssertionError(f"cluster up exited: {log.read_text()}")
        found = _ENDPOINT.search(log.read_text())
        return found.group(1) if found else None

    try:
        yield wait_until(endpoint, "cluster up's endpoint", START_DEADLINE_S)
    finally:
        stop_process_group(process, timeout_s=30)


def _node_gauges(url: str, name: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        node: float(value)
        for node, value in re.findall(rf'^{name}{{node="([^"]+)"}} (\S+)$', text, re.MULTILINE)
    }


def _cluster(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{url}/api/cluster", timeout=10) as response:
        return json.loads(response.read())


def test_up_serves_the_limit_and_reports_the_request_caches(tmp_path: Path, footprint) -> None:
    limit = MODEL_CONTEXT - CONTEXT_STEP  # below the model's own: the flag's limit is served
    with _up(tmp_path, "--max-context", str(limit), "--max-running", "2", NO_WARMUP) as url:
        _over_the_limit(url, limit)
        cluster = _cluster(url)
        assert cluster["admission"]["max_context"] == limit
        nodes = cluster["nodes"]
        # What each node was planned to hold for one request at the limit, and the
        # conversation cache's budget the coordinator gave it (its own stage's).
        plan = plan_placement(
            [_node(n["node_id"], 1 << 30) for n in nodes],
            footprint,
            context_tokens=limit,
            concurrency=2,
            layers=[(n["start"], n["end"]) for n in nodes],
            prefix_cache=True,
        )
        per_request = {s.node_id: s.cache_bytes // 2 for s in plan.stages}
        budgets = {n["node_id"]: n["prefix_budget_bytes"] for n in nodes}
        assert budgets == {s.node_id: s.snapshot_bytes for s in plan.stages}
        assert len(set(budgets.values())) > 1  # the stages differ: each got its own

        # A long generation, held open while the metrics are read.
        body = {"prompt": "def f(", "max_tokens": limit - 100, "ignore_eos": True, "stream": True}
        conn = http.client.HTTPConnection(url.removeprefix("http://"), timeout=60)
        try:
            conn.request(
                "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
            )
            response = conn.getresponse()
            assert response.status == 200
            assert response.readline().startswith(b"data: ")  # generating

            def one_running_everywhere() -> dict[str, float] | None:
                running = _node_gauges(url, "cluster_node_running_requests")
                held = _node_gauges(url, "cluster_node_request_cache_bytes")
                ok = set(running) == set(per_request) and all(v == 1 for v in running.values())
                return held if ok and all(v > 0 for v in held.values()) else None

            held = wait_until(one_running_everywhere, "the request's caches on every node", 30.0)
            for stage in plan.stages:
                # A GatedDeltaNet state per layer from the start; never beyond the plan.
                gdn_state = stage.gdn_bytes // 2
                assert gdn_state <= held[stage.node_id] <= per_request[stage.node_id], stage
        finally:
            conn.close()  # the client hangs up: the request is cancelled on every node

        def freed() -> bool:
            running = _node_gauges(url, "cluster_node_running_requests")
            held = _node_gauges(url, "cluster_node_request_cache_bytes")
            return all(v == 0 for v in (*running.values(), *held.values()))

        wait_until(freed, "the request's caches to be freed", 30.0)
