"""coordinator.api over real HTTP: the official openai client against a fake engine, stop
strings, admission limits, client disconnects, engine failures, /metrics, /health."""

from __future__ import annotations

import asyncio
import http.client
import json
import math
import re
import socket
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from cluster.messages import RequestError
from coordinator.admission import AdmissionController
from coordinator.text_stream import StopMatcher, stop_token_ids
from tests.fakes import MODEL_ID, FakeEngine, Served, serve, tokenizer, wait_until

TEXT = "def add(a, b):\n    return a + b\n\nprint('héllo wörld')\nSTOP_HERE\nmore text"
HELLO = [{"role": "user", "content": "Show me the source of add"}]


@pytest.fixture
def served() -> Iterator[Served]:
    with serve(FakeEngine.saying(TEXT)) as served:
        yield served


def _client(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)


def _chat_prompt_len() -> int:
    return len(tokenizer().apply_chat_template(HELLO, add_generation_prompt=True, tokenize=True))


def _request(
    served: Served, method: str, path: str, body: bytes | None = None
) -> tuple[int, http.client.HTTPMessage, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", served.app.port, timeout=30)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, response.headers, response.read()
    finally:
        conn.close()


def _post_json(served: Served, path: str, body: Any) -> tuple[int, Any]:
    status, _, raw = _request(served, "POST", path, json.dumps(body).encode())
    return status, json.loads(raw)


class _SseStream:
    """A raw streaming request whose socket the test can drop mid-stream."""

    def __init__(self, served: Served, body: dict[str, Any]) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", served.app.port, timeout=30)
        payload = json.dumps({"model": MODEL_ID, "stream": True, **body}).encode()
        self.conn.request("POST", "/v1/chat/completions", body=payload)
        self._response: http.client.HTTPResponse | None = None

    @property
    def response(self) -> http.client.HTTPResponse:
        """The response, waited for on first use (a queued request answers only later)."""
        if self._response is None:
            self._response = self.conn.getresponse()
        return self._response

    def next_event(self) -> str:
        while True:
            line = self.response.fp.readline().decode()
            if line.startswith("data: "):
                return line[len("data: ") :].strip()
            if not line:
                raise EOFError

    def drop(self) -> None:
        sock = self.conn.sock
        if sock is not None:
            sock.shutdown(socket.SHUT_RDWR)
        self.conn.close()


# --- chat and text completions through the openai client ---------------------------------------


def test_chat_completion(served: Served):
    reply = _client(served).chat.completions.create(model=MODEL_ID, messages=HELLO, max_tokens=200)
    assert reply.choices[0].message.content == TEXT
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].finish_reason == "stop"
    assert reply.object == "chat.completion" and reply.model == MODEL_ID
    completion_tokens = len(tokenizer().encode(TEXT))
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == _chat_prompt_len()
    assert reply.usage.completion_tokens == completion_tokens
    assert reply.usage.total_tokens == _chat_prompt_len() + completion_tokens
    request = served.engine.requests[0]
    assert request.stop_tokens == {0, 2}  # tokenizer eos + generation_config.json's list
    assert request.max_tokens == 200 and request.options.sampling.temperature == 1.0
    assert served.engine.completed == [request.request_id]


def test_chat_streaming(served: Served):
    stream = _client(served).chat.completions.create(
        model=MODEL_ID,
        messages=HELLO,
        stream=True,
        stream_options={"include_usage": True},
        temperature=0,
        seed=3,
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(content) == TEXT
    assert len([piece for piece in content if piece]) > 5  # it really streamed
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "stop" and set(finishes[:-1]) == {None}
    assert len({c.id for c in chunks}) == 1
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == len(tokenizer().encode(TEXT))
    assert served.engine.requests[0].options.sampling.greedy


def test_length_limit(served: Served):
    reply = _client(served).chat.completions.create(model=MODEL_ID, messages=HELLO, max_tokens=3)
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage is not None and reply.usage.completion_tokens == 3
    assert reply.choices[0].message.content == tokenizer().decode(tokenizer().encode(TEXT)[:3])


def test_text_completion(served: Served):
    client = _client(served)
    reply = client.completions.create(model=MODEL_ID, prompt="def add(", max_tokens=10)
    assert reply.object == "text_completion"
    assert reply.choices[0].text == tokenizer().decode(tokenizer().encode(TEXT)[:10])
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage is not None and reply.usage.prompt_tokens == len(
        tokenizer().encode("def add(")
    )
    streamed = client.completions.create(model=MODEL_ID, prompt=[1, 2, 3], stream=True)
    pieces = list(streamed)
    assert "".join(p.choices[0].text for p in pieces) == TEXT
    assert pieces[-1].choices[0].finish_reason == "stop"
    assert served.engine.requests[-1].prompt == (1, 2, 3)


def test_models(served: Served):
    models = _client(served).models.list()
    assert [m.id for m in models.data] == [MODEL_ID]


# --- stop strings ------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_split_across_tokens(served: Served, stream: bool):
    """'STOP_HERE' is the tokens 'ST', 'OP', '_', 'H', 'ERE': no piece of it may leak."""
    pieces = [tokenizer().decode([t]) for t in tokenizer().encode(TEXT)]
    assert "ST" in pieces and "OP" in pieces  # the premise: the stop string is split
    client = _client(served)
    kwargs = {"model": MODEL_ID, "messages": HELLO, "stop": ["STOP_HERE", "never"]}
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
        deltas = [c.choices[0].delta.content or "" for c in chunks if c.choices]
        assert not any("ST" in d for d in deltas)
        text, finish = "".join(deltas), chunks[-1].choices[0].finish_reason
    else:
        reply = client.chat.completions.create(**kwargs)
        text, finish = reply.choices[0].message.content, reply.choices[0].finish_reason
    assert text == TEXT[: TEXT.index("STOP_HERE")]
    assert finish == "stop"
    # Stopping early closed the engine's stream: the request is cancelled, not run out.
    request_id = served.engine.requests[0].request_id
    wait_until(lambda: request_id in served.engine.closed_early, what="the engine stream closed")


def test_held_back_text_is_released_when_no_stop_follows(served: Served):
    reply = _client(served).chat.completions.create(
        model=MODEL_ID, messages=HELLO, stop=["STOP_THERE", "more text!"]
    )
    assert reply.choices[0].message.content == TEXT


@pytest.mark.parametrize(
    ("stops", "feeds", "emitted", "stopped"),
    [
        (["</s>"], ["ab<", "/", "s", ">zz"], ["ab", "", "", ""], True),
        (["</s>"], ["ab<", "x"], ["ab", "<x"], False),
        (["ab", "b"], ["xab"], ["x"], True),  # the earliest occurrence wins
        (["aab"], ["a", "a", "a", "b"], ["", "", "a", ""], True),
        ([], ["hello"], ["hello"], False),
    ],
)
def test_stop_matcher(stops: list[str], feeds: list[str], emitted: list[str], stopped: bool):
    matcher = StopMatcher(stops)
    results = [matcher.feed(text) for text in feeds]
    assert [text for text, _ in results] == emitted
    assert results[-1][1] is stopped


def test_stop_tokens_come_from_tokenizer_and_generation_config():
    assert stop_token_ids(tokenizer()) == {0, 2}


# --- admission ---------------------------------------------------------------------------------


def test_queue_full_is_429_and_waiting_too_long_is_503():
    engine = FakeEngine.saying(TEXT * 20, delay_s=0.05)
    with serve(engine, max_running=1, max_queued=1, queue_timeout_s=1.5) as served:
        running = _SseStream(served, {"messages": HELLO})
        running.next_event()
        queued = _SseStream(served, {"messages": HELLO})
        wait_until(lambda: served.admission.queued == 1, what="a queued request")

        body = json.dumps({"model": MODEL_ID, "messages": HELLO}).encode()
        status, headers, raw = _request(served, "POST", "/v1/chat/completions", body)
        assert status == 429
        assert int(headers["Retry-After"]) >= 1
        error = json.loads(raw)["error"]
        assert error["type"] == "rate_limit_exceeded" and error["code"] == "rate_limit_exceeded"

        # The queued one gives up after 1.5 s.
        assert queued.response.status == 503
        assert json.loads(queued.response.read())["error"]["code"] == "queue_timeout"
        running.drop()
        wait_until(lambda: served.admission.running == 0, what="the slot to be freed")
        reply = _client(served).chat.completions.create(
            model=MODEL_ID, messages=HELLO, max_tokens=5
        )
        assert reply.choices[0].finish_reason == "length"
        assert served.view.counters.rejected_total == 2


def test_admission_is_fifo_and_a_cancelled_waiter_frees_nothing_twice():
    async def scenario() -> list[str]:
        admission = AdmissionController(max_running=1, max_queued=3, queue_timeout_s=5)
        order: list[str] = []
        release = asyncio.Event()

        async def job(name: str) -> None:
            async with admission.slot():
                order.append(name)
                await release.wait()

        first = asyncio.create_task(job("first"))
        await asyncio.sleep(0)
        waiters = {name: asyncio.create_task(job(name)) for name in ("a", "b", "c")}
        await asyncio.sleep(0)
        assert (admission.running, admission.queued) == (1, 3)
        waiters["b"].cancel()
        await asyncio.sleep(0)
        assert admission.queued == 2
        release.set()
        await asyncio.gather(first, waiters["a"], waiters["c"])
        assert (admission.running, admission.queued) == (0, 0)
        return order

    assert asyncio.run(scenario()) == ["first", "a", "c"]


# --- disconnects and failures ------------------------------------------------------------------


@pytest.mark.parametrize("handler_cancellation", [True, False])
def test_client_disconnect_closes_the_engine_stream(handler_cancellation: bool):
    engine = FakeEngine.saying(TEXT * 50, delay_s=0.02)
    with serve(engine, handler_cancellation=handler_cancellation) as served:
        stream = _SseStream(served, {"messages": HELLO})
        assert json.loads(stream.next_event())["choices"][0]["delta"]["role"] == "assistant"
        stream.next_event()
        stream.drop()
        wait_until(lambda: len(engine.closed_early) == 1, what="the engine stream to close")
        assert engine.active == 0 and engine.completed == []
        wait_until(lambda: served.admission.running == 0, what="the slot to be freed")
        assert served.view.counters.in_flight == 0


def test_engine_request_error_is_400(served: Served):
    served.engine.fail = RequestError("the prompt does not fit")
    status, body = _post_json(served, "/v1/chat/completions", {"messages": HELLO})
    assert status == 400
    assert body["error"]["message"] == "the prompt does not fit"


def test_context_length_is_checked_before_admission():
    with serve(FakeEngine.saying(TEXT, max_context=16)) as served:
        status, body = _post_json(served, "/v1/completions", {"prompt": "x " * 40})
        assert status == 400 and body["error"]["code"] == "context_length_exceeded"
        status, body = _post_json(
            served, "/v1/completions", {"prompt": "x", "max_tokens": 16, "model": MODEL_ID}
        )
        assert status == 400 and body["error"]["param"] == "max_tokens"
        assert served.engine.requests == []


def test_engine_failure_is_502_and_the_service_goes_on(served: Served):
    served.engine.fail = ConnectionError("node mac-1 (10.0.0.11:50051) stopped answering")
    client = _client(served)
    with pytest.raises(openai.APIStatusError) as caught:
        client.chat.completions.create(model=MODEL_ID, messages=HELLO)
    assert caught.value.status_code == 502
    assert "mac-1" in caught.value.message
    assert caught.value.body["type"] == "server_error"  # type: ignore[index]
    served.engine.fail = None
    assert client.chat.completions.create(model=MODEL_ID, messages=HELLO).choices[0].message
    assert served.view.counters.errors_total == 1


def test_failure_mid_stream_is_an_error_event(served: Served):
    served.engine.fail, served.engine.fail_after = ConnectionError("node mac-2 died"), 4
    stream = _client(served).chat.completions.create(model=MODEL_ID, messages=HELLO, stream=True)
    with pytest.raises(openai.APIError, match="mac-2"):
        list(stream)
    assert served.view.counters.errors_total == 1
    assert served.engine.closed_early == [served.engine.requests[0].request_id]


@pytest.mark.parametrize(
    ("method", "path", "body", "status"),
    [
        ("POST", "/v1/chat/completions", b"{oops", 400),
        ("POST", "/v1/chat/completions", b'{"messages": [], "model": "qwen3_5-tiny-mtp"}', 400),
        (
            "POST",
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "x"}], "model": "gpt-5"}',
            404,
        ),
        ("POST", "/v1/completions", b'{"prompt": "x", "top_p": 2}', 400),
        ("POST", "/v1/chat/completions", b'{"messages": "x", "pad": "' + b"x" * 2**21 + b'"}', 413),
        ("GET", "/v1/chat/completions", None, 405),
        ("GET", "/v1/nothing-here", None, 404),
    ],
)
def test_errors_are_openai_bodies(
    served: Served, method: str, path: str, body: bytes | None, status: int
):
    got, _, raw = _request(served, method, path, body)
    assert got == status
    error = json.loads(raw)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert served.engine.requests == []


# --- health, metrics, cluster view -------------------------------------------------------------


def test_health(served: Served):
    status, _, raw = _request(served, "GET", "/health")
    assert status == 200 and json.loads(raw)["status"] == "ok"
    served.view.set_up("mac-1", False)
    status, _, raw = _request(served, "GET", "/health")
    health = json.loads(raw)
    assert status == 503 and health["status"] == "degraded"
    assert [n["up"] for n in health["nodes"]] == [True, False, True]


def test_cluster_json(served: Served):
    status, headers, raw = _request(served, "GET", "/api/cluster")
    cluster = json.loads(raw)
    assert status == 200 and headers["Content-Type"].startswith("application/json")
    assert [n["node_id"] for n in cluster["nodes"]] == ["mac-0", "mac-1", "mac-2"]
    assert cluster["nodes"][0]["is_head"] and cluster["nodes"][2]["is_tail"]
    assert cluster["stats"]["model_id"] == MODEL_ID and cluster["healthy"]
    assert cluster["admission"]["max_running"] == 4


_SAMPLE = re.compile(
    r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)"
    r'(?:\{(?P<labels>[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\[\\"n])*"'
    r'(?:,[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\[\\"n])*")*)\})?'
    r" (?P<value>\S+)$"
)


def _parse_prometheus(text: str) -> dict[tuple[str, str], float]:
    """A strict reader of the text format 0.0.4: HELP/TYPE before samples, one TYPE per family,
    counters sampled as `_total`, label syntax and values well formed."""
    assert text.endswith("\n")
    types: dict[str, str] = {}
    samples: dict[tuple[str, str], float] = {}
    for line in text.splitlines():
        if line.startswith("# HELP "):
            assert re.match(r"^# HELP [a-zA-Z_:][a-zA-Z0-9_:]* \S", line), line
        elif line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert kind in {"counter", "gauge", "histogram", "summary", "untyped"}, line
            assert name not in types, f"two TYPE lines for {name}"
            types[name] = kind
        else:
            match = _SAMPLE.match(line)
            assert match, f"not a sample line: {line!r}"
            name = match["name"]
            family = name.removesuffix("_total") if name.endswith("_total") else name
            assert family in types, f"sample before its TYPE: {line}"
            assert (types[family] == "counter") == name.endswith("_total"), line
            value = float(match["value"].replace("+Inf", "inf"))
            samples[(name, match["labels"] or "")] = value
    return samples


def test_metrics_are_prometheus_text(served: Served):
    _client(served).chat.completions.create(model=MODEL_ID, messages=HELLO)
    _post_json(served, "/v1/chat/completions", {"messages": []})
    status, headers, raw = _request(served, "GET", "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain; version=0.0.4")
    samples = _parse_prometheus(raw.decode())
    assert (
        samples[("cluster_node_up", 'node="mac-1",address="10.0.0.11:50051",device="Apple M3 Max"')]
        == 1
    )
    assert math.isclose(samples[("cluster_node_step_latency_seconds", 'node="mac-1"')], 0.0045)
    assert samples[("cluster_tokens_per_second", "")] == 42.5
    assert samples[("cluster_mtp_acceptance_rate", "")] == 0.73
    assert samples[("cluster_requests_total", "")] == 2
    assert samples[("cluster_requests_rejected_total", "")] == 1
    assert samples[("cluster_errors_total", "")] == 0
    assert samples[("cluster_requests_in_flight", "")] == 0
    assert samples[("cluster_interleave_chunk_tokens", "")] == 16
    assert samples[("cluster_interleave_chunk_changes_total", "")] == 3
    assert samples[("cluster_completion_tokens_total", "")] == len(tokenizer().encode(TEXT))
    served.view.set_up("mac-2", False)
    samples = _parse_prometheus(_request(served, "GET", "/metrics")[2].decode())
    assert (
        samples[("cluster_node_up", 'node="mac-2",address="10.0.0.12:50051",device="Apple M4 Max"')]
        == 0
    )


def test_dashboard_is_served(served: Served):
    status, headers, raw = _request(served, "GET", "/")
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    assert b"/api/cluster" in raw or b"dashboard.js" in raw
