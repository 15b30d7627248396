"""coordinator.api_keys: with keys set, /v1 needs `Authorization: Bearer`, monitoring too unless
left open; refusals are 401s with an OpenAI error body that the openai client surfaces."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from click.testing import CliRunner

from cluster.commands.coordinator import coordinator_command
from cluster.commands.status import status_command
from coordinator.api_keys import API_KEY_ENV, ApiKeys, read_api_keys
from tests.fakes import MODEL_ID, FakeEngine, Served, serve

KEYS = ("sk-first-key", "sk-second-key")
HELLO = [{"role": "user", "content": "hi"}]
CHAT_BODY = json.dumps({"model": MODEL_ID, "messages": HELLO, "max_tokens": 4}).encode()


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    with serve(FakeEngine.saying("hello there"), api_keys=ApiKeys.of(KEYS)) as served:
        yield served


@pytest.fixture(scope="module")
def served_open_monitoring() -> Iterator[Served]:
    keys = ApiKeys.of(KEYS, open_monitoring=True)
    with serve(FakeEngine.saying("hello there"), api_keys=keys) as served:
        yield served


def _request(
    served: Served, method: str, path: str, *, key: str | None = None, header: str | None = None
) -> tuple[int, http.client.HTTPMessage, bytes]:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    if header is not None:
        headers["Authorization"] = header
    body = CHAT_BODY if method == "POST" else None
    conn = http.client.HTTPConnection("127.0.0.1", served.app.port, timeout=30)
    try:
        conn.request(method, path, body=body, headers=headers)
        response = conn.getresponse()
        return response.status, response.headers, response.read()
    finally:
        conn.close()


@pytest.mark.parametrize(
    ("key", "header"),
    [
        (None, None),  # no key at all
        ("sk-wrong", None),
        ("sk-first-ke", None),  # a prefix of a real key
        ("sk-first-key-and-more", None),
        (None, "Basic sk-first-key"),  # not a bearer token
        (None, "sk-first-key"),
    ],
)
@pytest.mark.parametrize(
    ("method", "path"),
    [("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("GET", "/v1/models")],
)
def test_v1_refuses_a_missing_or_wrong_key(
    served: Served, method: str, path: str, key: str | None, header: str | None
) -> None:
    status, headers, raw = _request(served, method, path, key=key, header=header)
    assert status == 401
    assert headers["WWW-Authenticate"].startswith("Bearer")
    error = json.loads(raw)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_api_key"
    assert ("didn't provide" in error["message"]) == (key is None and header is None)
    assert served.engine.requests == []  # refused before anything ran


def test_every_configured_key_is_accepted(served: Served) -> None:
    for key in KEYS:
        client = openai.OpenAI(base_url=f"{served.url}/v1", api_key=key, max_retries=0)
        reply = client.chat.completions.create(model=MODEL_ID, messages=HELLO)
        assert reply.choices[0].message.content == "hello there"
        assert [m.id for m in client.models.list()] == [MODEL_ID]


def test_the_openai_client_surfaces_the_refusal(served: Served) -> None:
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as caught:
        client.chat.completions.create(model=MODEL_ID, messages=HELLO, stream=True)
    assert caught.value.status_code == 401 and caught.value.code == "invalid_api_key"


@pytest.mark.parametrize("path", ["/metrics", "/health", "/api/cluster"])
def test_monitoring_is_closed_unless_left_open(
    served: Served, served_open_monitoring: Served, path: str
) -> None:
    assert _request(served, "GET", path)[0] == 401
    assert _request(served, "GET", path, key=KEYS[1])[0] == 200
    assert _request(served_open_monitoring, "GET", path)[0] == 200
    # /v1 stays guarded when monitoring is open
    assert _request(served_open_monitoring, "GET", "/v1/models")[0] == 401


def test_the_dashboard_page_loads_without_a_key(served: Served) -> None:
    """The page and its scripts hold no data; the page asks for the key to read /api/cluster."""
    for path in ("/", "/static/dashboard.js"):
        assert _request(served, "GET", path)[0] == 200


def test_keys_from_a_file_and_the_flag(tmp_path: Path) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text("# the team's keys\nsk-a\n\n  sk-b  \n")
    assert read_api_keys("sk-flag", key_file) == ["sk-flag", "sk-a", "sk-b"]
    assert read_api_keys(None, None) == []
    assert not ApiKeys.of([]).enabled and not ApiKeys.of([]).guards("/v1/models")
    key_file.write_text("# nothing but a comment\n")
    with pytest.raises(ValueError, match="holds no API key"):
        read_api_keys(None, key_file)
    with pytest.raises(ValueError, match="non-empty"):
        ApiKeys.of(["sk-ok", " sk-padded"])


def test_the_command_line_refuses_an_empty_key_file(tmp_path: Path) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text("\n")
    result = CliRunner().invoke(
        coordinator_command, ["--token", "t", "--api-key-file", str(key_file)]
    )
    assert result.exit_code == 2 and "holds no API key" in result.output


def test_cluster_status_sends_the_key(served: Served) -> None:
    refused = CliRunner().invoke(status_command, ["--url", served.url], env={API_KEY_ENV: ""})
    assert refused.exit_code == 1 and "needs its API key" in refused.output
    result = CliRunner().invoke(status_command, ["--url", served.url, "--api-key", KEYS[0]])
    assert result.exit_code == 0, result.output
    assert "mac-0" in result.output
