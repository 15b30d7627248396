"""The coordinator over three real node daemons, through real HTTP.

`cluster node` x3 and `cluster coordinator --nodes ... --no-mdns --all-nodes` run as
processes; the test talks to the coordinator with the openai client and raw HTTP, and to the
nodes with `NodeClient` to see what they hold. Concurrent greedy streams give the same text
as alone; a client that hangs up mid-stream has its request cancelled and its caches freed on
every node; malformed requests are OpenAI-style 4xx errors that leave the service serving;
/metrics and /health report the traffic and the nodes.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import re
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import openai
import pytest

from cluster.transport.node_client import NodeClient
from tests.daemons import ENDPOINT, LISTENING, NO_WARMUP, Daemon, free_port, wait_until

TOKEN = "test-coordinator-secret"
FREE_DEADLINE_S = 10.0
MAX_TOKENS = 16
LONG_MAX_TOKENS = 4000  # minutes of decoding on this model: a cancellation must cut it short
NODE_IDS = ("c-node-0", "c-node-1", "c-node-2")
SUBJECTS = ("abc", "os.path", "json", "a stack", "fibonacci", "quicksort", "a parser", "sys")


@dataclass
class Cluster:
    url: str
    port: int
    model: str
    nodes: list[str]  # addresses, in NODE_IDS order

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0)

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"{self.url}{path}", timeout=10) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as error:
            return error.code, error.read().decode()

    def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            conn.close()

    def node_infos(self) -> list[Any]:
        async def infos() -> list[Any]:
            clients = [NodeClient(address, TOKEN) for address in self.nodes]
            try:
                return await asyncio.gather(*(c.info(timeout=5) for c in clients))
            finally:
                for client in clients:
                    await client.close()

        return asyncio.run(infos())


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    logs = tmp_path_factory.mktemp("coordinator")
    daemons = [
        Daemon.start(
            logs / f"{node_id}.log",
            TOKEN,
            *("node", "--host", "127.0.0.1", "--port", "0", "--node-id", node_id),
            "--no-advertise",
        )
        for node_id in NODE_IDS
    ]
    try:
        ports = [daemon.wait_for(LISTENING) for daemon in daemons]
        addresses = [f"127.0.0.1:{port}" for port in ports]
        port = free_port()
        coordinator = Daemon.start(
            logs / "coordinator.log",
            TOKEN,
            "coordinator",
            *("--nodes", ",".join(addresses), "--port", str(port)),
            *("--no-mdns", "--all-nodes", NO_WARMUP),
        )
        daemons.append(coordinator)
        url = coordinator.wait_for(ENDPOINT)
        model = openai.OpenAI(base_url=f"{url}/v1", api_key="-").models.list().data[0].id
        yield Cluster(url, port, model, addresses)
    finally:
        for daemon in reversed(daemons):
            daemon.stop()


def _messages(subject: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Show me the source of {subject}"}]


def _wait_idle(cluster: Cluster, what: str) -> None:
    """Every node holds no request and no cache (a finished request is released just after
    its last byte goes out, so a test starts by waiting for the previous one's release)."""

    def idle() -> bool:
        return all(i.active_requests == 0 and i.cache_bytes == 0 for i in cluster.node_infos())

    wait_until(idle, what, FREE_DEADLINE_S)


# --- concurrency -------------------------------------------------------------------------------


@dataclass
class _Streamed:
    text: str
    finish_reason: str | None
    first_at: float  # monotonic times of the first and last content chunks
    last_at: float


async def _stream_chat(client: openai.AsyncOpenAI, model: str, subject: str) -> _Streamed:
    stream = await client.chat.completions.create(
        model=model, messages=_messages(subject), max_tokens=MAX_TOKENS, temperature=0, stream=True
    )
    pieces: list[str] = []
    finish, first_at, last_at = None, 0.0, 0.0
    async for chunk in stream:
        if not chunk.choices:
            continue
        if chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
            last_at = time.monotonic()
            first_at = first_at or last_at
        finish = chunk.choices[0].finish_reason or finish
    return _Streamed("".join(pieces), finish, first_at, last_at)


def test_concurrent_streams_match_each_alone(cluster: Cluster):
    client = cluster.client()
    alone = {}
    for subject in SUBJECTS:
        reply = client.chat.completions.create(
            model=cluster.model, messages=_messages(subject), max_tokens=MAX_TOKENS, temperature=0
        )
        alone[subject] = reply.choices[0].message.content

    async def together() -> list[_Streamed]:
        async with cluster.async_client() as aclient:
            return await asyncio.gather(
                *(_stream_chat(aclient, cluster.model, s) for s in SUBJECTS)
            )

    streamed = asyncio.run(asyncio.wait_for(together(), 60))
    assert {s: r.text for s, r in zip(SUBJECTS, streamed, strict=True)} == alone
    assert all(r.text and r.finish_reason in ("stop", "length") for r in streamed)
    # They really ran together: every stream had begun before any of them ended.
    assert max(r.first_at for r in streamed) < min(r.last_at for r in streamed)


# --- a client that hangs up --------------------------------------------------------------------


def test_disconnect_cancels_the_request_on_every_node(cluster: Cluster):
    _wait_idle(cluster, "the nodes to be idle before the test")
    body = {
        "model": cluster.model,
        "messages": _messages("abc"),  # greedy: repeats `import abc`, no end of turn
        "max_tokens": LONG_MAX_TOKENS,
        "temperature": 0,
        "stream": True,
    }
    conn = http.client.HTTPConnection("127.0.0.1", cluster.port, timeout=30)
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body).encode())
    response = conn.getresponse()
    assert response.status == 200
    events = 0
    while events < 4:
        line = response.fp.readline()
        assert line, "the stream ended early"
        events += line.startswith(b"data: ")
    infos = cluster.node_infos()
    assert [i.active_requests for i in infos] == [1, 1, 1]  # it runs on every node
    assert all(i.cache_bytes > 0 for i in infos)

    assert conn.sock is not None
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    hung_up = time.monotonic()
    _wait_idle(cluster, "the request to be released on every node")
    assert time.monotonic() - hung_up < FREE_DEADLINE_S

    def in_flight() -> int:
        return json.loads(cluster.get("/api/cluster")[1])["stats"]["requests_in_flight"]

    # The handler counts the request out once every node has answered its release.
    wait_until(lambda: in_flight() == 0, "the request to leave the count", FREE_DEADLINE_S)


# --- bad requests ------------------------------------------------------------------------------

HELLO = _messages("abc")
BAD_REQUESTS: dict[str, tuple[str, Any, int]] = {  # case: (path, body, HTTP status)
    "invalid JSON": ("/v1/chat/completions", b'{"messages": [{"role": ', 400),
    "unknown model": ("/v1/chat/completions", {"model": "gpt-4o", "messages": HELLO}, 404),
    "negative max_tokens": ("/v1/chat/completions", {"messages": HELLO, "max_tokens": -5}, 400),
    "max_tokens beyond the context": (
        "/v1/chat/completions",
        {"messages": HELLO, "max_tokens": 100_000},
        400,
    ),
    "prompt longer than the context": (
        "/v1/completions",
        {"prompt": " a" * 10_000, "max_tokens": 1},  # 10,000 tokens, the context is 8,192
        400,
    ),
    "messages as a string": ("/v1/chat/completions", {"messages": "hello"}, 400),
    "temperature as a string": (
        "/v1/chat/completions",
        {"messages": HELLO, "temperature": "hot"},
        400,
    ),
    "prompt token id out of range": ("/v1/completions", {"prompt": [10**9], "max_tokens": 1}, 400),
}


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    assert match, f"{name} missing from /metrics"
    return float(match.group(1))


def test_bad_requests_are_openai_errors_and_the_service_keeps_serving(cluster: Cluster):
    rejected_before = _metric(cluster.get("/metrics")[1], "cluster_requests_rejected_total")
    for case, (path, body, expected) in BAD_REQUESTS.items():
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        status, answer = cluster.post(path, raw)
        assert status == expected, f"{case}: HTTP {status} {answer[:300]!r}"
        error = json.loads(answer)["error"]
        assert isinstance(error["message"], str) and error["message"], case
        assert isinstance(error["type"], str) and error["type"], case
        if "context" in case:
            assert error["code"] == "context_length_exceeded", case
    metrics = cluster.get("/metrics")[1]
    assert _metric(metrics, "cluster_requests_rejected_total") - rejected_before == len(
        BAD_REQUESTS
    )
    assert _metric(metrics, "cluster_errors_total") == 0

    reply = cluster.client().chat.completions.create(
        model=cluster.model, messages=HELLO, max_tokens=4, temperature=0
    )
    assert reply.choices[0].message.content and reply.usage is not None
    assert reply.usage.completion_tokens == 4


# --- /metrics and /health ----------------------------------------------------------------------


def test_metrics_and_health_after_traffic(cluster: Cluster):
    cluster.client().completions.create(model=cluster.model, prompt="import os\n", max_tokens=4)

    def step_latencies() -> dict[str, float] | None:
        text = cluster.get("/metrics")[1]
        found = re.findall(
            r'^cluster_node_step_latency_seconds\{node="([^"]+)"\} (\S+)$', text, re.MULTILINE
        )
        latencies = {node: float(value) for node, value in found}
        return latencies if all(latencies.get(n, 0) > 0 for n in NODE_IDS) else None

    latencies = wait_until(step_latencies, "a step latency for every node", 10.0)
    assert sorted(latencies) == sorted(NODE_IDS)
    metrics = cluster.get("/metrics")[1]
    assert _metric(metrics, "cluster_requests_total") > 0
    assert _metric(metrics, "cluster_completion_tokens_total") >= 4
    for node_id in NODE_IDS:
        assert re.search(rf'^cluster_node_up\{{node="{node_id}",.*\}} 1$', metrics, re.MULTILINE)

    status, text = cluster.get("/health")
    health = json.loads(text)
    assert status == 200 and health["status"] == "ok"
    assert sorted(n["node_id"] for n in health["nodes"]) == sorted(NODE_IDS)
    assert all(n["up"] for n in health["nodes"])


# --- many clients hanging up at any moment (last: a failure here breaks the service) -----------

STORM_ROUNDS = 4


def _hang_up_after(cluster: Cluster, events: int) -> None:
    """A streaming request whose client goes away after `events` SSE events (0: at once)."""
    body = {
        "model": cluster.model,
        "messages": _messages("abc"),
        "max_tokens": LONG_MAX_TOKENS,
        "temperature": 0,
        "stream": True,
    }
    conn = http.client.HTTPConnection("127.0.0.1", cluster.port, timeout=10)
    try:
        conn.request("POST", "/v1/chat/completions", body=json.dumps(body).encode())
        if events:
            response = conn.getresponse()
            assert response.status == 200
            while events:
                line = response.fp.readline()
                assert line, "the stream ended early"
                events -= line.startswith(b"data: ")
        assert conn.sock is not None
        conn.sock.shutdown(socket.SHUT_RDWR)
    finally:
        conn.close()


def test_clients_hanging_up_at_any_moment_leave_the_service_serving(cluster: Cluster):
    """A hang-up cancels its request wherever it is (admission, prefill, decode, mid-send to
    the head node); none of those may take down the stream the other requests share."""
    client = cluster.client().with_options(timeout=15)
    for _ in range(STORM_ROUNDS):
        with ThreadPoolExecutor(8) as pool:
            for hang_up in [pool.submit(_hang_up_after, cluster, n) for n in range(8)]:
                hang_up.result(timeout=30)
        reply = client.chat.completions.create(
            model=cluster.model, messages=HELLO, max_tokens=4, temperature=0
        )
        assert reply.usage is not None and reply.usage.completion_tokens == 4
    _wait_idle(cluster, "every hung-up request to be released on every node")
