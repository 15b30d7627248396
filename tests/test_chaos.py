"""Chaos: nodes die, hang and come back under 12 streaming requests; nothing is lost.

Four `cluster node` processes (A, B, C and a spare D) on fixed ports and a `cluster
coordinator` with a 3-stage `--layers` split (it uses the first three nodes that answer). 12
streaming completions (greedy and seeded sampling, MTP on) run while the test
1. kills A: the coordinator re-places on B, C, D and replays every request;
2. SIGSTOPs B past the heartbeat deadline: only C and D answer, 3 stages do not fit, so the
   requests (and a new one, held in the admission queue) wait;
3. restarts A on its port: the coordinator places on A, C, D and replays again.
Every request must end with exactly the text (and token count) of an undisturbed run of the
same requests, none may hang, and /metrics must count the replays. Then B wakes up (its late
work is refused by epoch) and, once idle, the coordinator moves back to A, B, C.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tests.test_fuzz as fuzz
from tests.daemons import ENDPOINT, LISTENING, NO_WARMUP, Daemon, free_port, wait_until

TOKEN = "test-chaos-secret"
MAX_TOKENS = 80
LAYERS = "0:3,3:6,6:8"
STREAM_DEADLINE_S = 150.0  # a request that has not ended by then hangs
DETECT_S = 6.0  # heartbeat deadline (3 s) plus the supervisor's and the poll's periods
PROMPTS = (
    "import os\nimport sys\n\ndef main(",
    "class Stack:\n    def __init__(self):\n",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "# Parse command line arguments\nimport argparse\n\nparser = ",
)


@dataclass
class Chaos:
    logs: Path
    ports: list[int]
    nodes: list[Daemon]
    url: str
    daemons: list[Daemon] = field(default_factory=list)

    def address(self, i: int) -> str:
        return f"127.0.0.1:{self.ports[i]}"

    def start_node(self, i: int) -> Daemon:
        node = Daemon.start(
            self.logs / f"node-{i}-{len(self.daemons)}.log",
            TOKEN,
            *("node", "--host", "127.0.0.1", "--port", str(self.ports[i])),
            *("--node-id", f"chaos-{'ABCD'[i]}", "--no-advertise"),
        )
        self.daemons.append(node)
        return node

    def get(self, path: str) -> str:
        with urllib.request.urlopen(f"{self.url}{path}", timeout=10) as response:
            return response.read().decode()

    def placement(self) -> list[str]:
        nodes = json.loads(self.get("/api/cluster"))["nodes"]
        return [n["address"] for n in nodes if n["end"] > n["start"]]

    def node_up(self, i: int) -> bool:
        nodes = json.loads(self.get("/api/cluster"))["nodes"]
        return any(n["address"] == self.address(i) and n["up"] for n in nodes)

    def metric(self, name: str) -> float:
        for line in self.get("/metrics").splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise AssertionError(f"{name} not in /metrics")


@pytest.fixture(scope="module")
def chaos(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Chaos]:
    logs = tmp_path_factory.mktemp("chaos")
    ports = [free_port() for _ in range(4)]
    state = Chaos(logs, ports, [], "")
    try:
        state.nodes = [state.start_node(i) for i in range(4)]
        for node in state.nodes:
            node.wait_for(LISTENING)
        coordinator = Daemon.start(
            logs / "coordinator.log",
            TOKEN,
            *("-v", "coordinator"),
            *("--nodes", ",".join(state.address(i) for i in range(4))),
            *("--port", "0", "--no-mdns", "--layers", LAYERS, NO_WARMUP),
        )
        state.daemons.append(coordinator)
        state.url = coordinator.wait_for(ENDPOINT)
        yield state
    finally:
        for daemon in reversed(state.daemons):
            if daemon.process.poll() is None:
                os.killpg(daemon.process.pid, signal.SIGCONT)
            daemon.stop()


def _requests() -> list[dict]:
    """12 requests: each prompt greedy, and seeded at two temperatures."""
    out = []
    for i, prompt in enumerate(PROMPTS):
        out.append({"prompt": prompt, "temperature": 0.0})
        out.append({"prompt": prompt, "temperature": 0.8, "seed": 100 + i})
        out.append({"prompt": prompt, "temperature": 1.0, "top_p": 0.9, "seed": 200 + i})
    return out


@dataclass
class _Progress:
    texts: list[str]
    tokens: list[int]  # completion tokens seen so far (one per text piece at least)
    done: list[bool]

    def least(self) -> int:
        running = [n for n, d in zip(self.tokens, self.done, strict=True) if not d]
        return min(running, default=MAX_TOKENS)


async def _stream(client: openai.AsyncOpenAI, model: str, body: dict, progress, i) -> int:
    stream = await client.completions.create(
        model=model,
        max_tokens=MAX_TOKENS,
        stream=True,
        stream_options={"include_usage": True},
        **body,
    )
    usage = 0
    async for chunk in stream:
        if chunk.choices:
            progress.texts[i] += chunk.choices[0].text
            progress.tokens[i] += 1
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
    progress.done[i] = True
    return usage


async def _run(chaos: Chaos, bodies: list[dict], faults=None) -> tuple[list[str], list[int]]:
    client = openai.AsyncOpenAI(base_url=f"{chaos.url}/v1", api_key="-", max_retries=0)
    model = (await client.models.list()).data[0].id
    progress = _Progress([""] * len(bodies), [0] * len(bodies), [False] * len(bodies))
    streams = [
        asyncio.ensure_future(_stream(client, model, body, progress, i))
        for i, body in enumerate(bodies)
    ]
    try:
        async with asyncio.timeout(STREAM_DEADLINE_S):
            if faults is not None:
                await faults(progress, client, model)
            usage = await asyncio.gather(*streams)
    finally:
        for stream in streams:
            stream.cancel()
        await client.close()
    return progress.texts, list(usage)


async def _until(condition, what: str, deadline_s: float = 60.0) -> float:
    """Poll (without blocking the streams) until `condition()`; the seconds it took."""
    start = time.monotonic()
    while not await asyncio.to_thread(condition):
        if time.monotonic() - start > deadline_s:
            raise AssertionError(f"timed out after {deadline_s}s waiting for {what}")
        await asyncio.sleep(0.1)
    return time.monotonic() - start


def test_requests_survive_a_killed_a_hung_and_a_restarted_node(chaos: Chaos) -> None:
    bodies = _requests()
    assert chaos.placement() == [chaos.address(i) for i in range(3)]
    expected, expected_usage = asyncio.run(_run(chaos, bodies))
    assert all(expected_usage), expected_usage
    late: dict[str, object] = {}

    async def faults(progress: _Progress, client: openai.AsyncOpenAI, model: str) -> None:
        await _until(lambda: progress.least() >= 4, "every stream under way")
        before = progress.tokens.copy()
        # 1. Kill A (the head): re-placed on B, C, D; every running request is replayed.
        os.killpg(chaos.nodes[0].process.pid, signal.SIGKILL)
        await _until(lambda: chaos.metric("cluster_replays_total") >= 1, "the first replay")
        await _until(
            lambda: all(
                d or n >= b + 4
                for n, b, d in zip(progress.tokens, before, progress.done, strict=True)
            ),
            "progress on the new placement",
        )
        assert chaos.placement() == [chaos.address(i) for i in (1, 2, 3)]
        replays_after_kill = chaos.metric("cluster_replays_total")
        # 2. SIGSTOP B past the deadline: C and D cannot hold 3 stages, so requests wait.
        os.kill(chaos.nodes[1].process.pid, signal.SIGSTOP)
        late["detect_s"] = await _until(lambda: not chaos.node_up(1), "B seen as down", 20)
        # A new request now waits in the admission queue rather than failing.
        late["queued"] = asyncio.ensure_future(
            client.completions.create(model=model, max_tokens=MAX_TOKENS, **bodies[0])
        )
        await asyncio.sleep(1.0)
        assert not late["queued"].done(), "a request sent during re-placement did not wait"
        # 3. Restart A on its port: the model is placed on A, C, D and the requests go on.
        chaos.nodes[0] = chaos.start_node(0)
        await _until(
            lambda: chaos.placement() == [chaos.address(i) for i in (0, 2, 3)],
            "the placement on A, C, D",
        )
        await _until(
            lambda: chaos.metric("cluster_replays_total") > replays_after_kill, "more replays"
        )
        late["queued"] = await late["queued"]

    texts, usage = asyncio.run(_run(chaos, bodies, faults))
    for i, body in enumerate(bodies):
        assert texts[i] == expected[i], f"request {i} {body} differs from the undisturbed run"
        assert usage[i] == expected_usage[i]
    queued = late["queued"]
    assert queued.choices[0].text == expected[0]
    assert late["detect_s"] < DETECT_S, f"{late['detect_s']:.1f} s to see a hung node as down"
    assert chaos.metric("cluster_replays_total") >= 2
    assert chaos.metric("cluster_replays_failed_total") == 0
    assert chaos.metric("cluster_errors_total") == 0

    # B wakes up: what it still held belongs to an old epoch and is refused, not computed
    # into the new placement; once idle, the coordinator moves back to A, B, C.
    os.kill(chaos.nodes[1].process.pid, signal.SIGCONT)
    wait_until(
        lambda: chaos.placement() == [chaos.address(i) for i in range(3)],
        "the move back to A, B, C",
        60,
    )
    # Arbitrary bodies (the fuzzer's) at the real coordinator: clean 4xx answers, and it
    # keeps serving with the same tokens.
    for body, path in _fuzzed_bodies():
        status, reply = _post(chaos.url, path, json.dumps(body).encode())
        assert status < 500, (body, status, reply)
    again, _ = asyncio.run(_run(chaos, bodies[:3]))
    assert again == expected[:3]
    assert chaos.metric("cluster_errors_total") == 0


def _fuzzed_bodies() -> list[tuple[object, str]]:
    """A few dozen of test_fuzz's arbitrary request bodies."""
    found: list[tuple[object, str]] = []

    @settings(max_examples=40, deadline=None, database=None)
    @given(body=fuzz.bodies, path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]))
    def collect(body: object, path: str) -> None:
        if isinstance(body, dict):  # a valid one must not generate the whole context
            body.pop("max_completion_tokens", None)
            body["max_tokens"] = 4
        found.append((body, path))

    collect()
    return found


def _post(url: str, path: str, body: bytes) -> tuple[int, bytes]:
    request = urllib.request.Request(
        f"{url}{path}", data=body, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()
