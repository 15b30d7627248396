"""`cluster up --local 3` as a person runs it: the official openai client against it, greedy
output equal to `cluster generate`'s, `cluster status`, the dashboard in headless Chromium
marking a killed node down, and Ctrl-C (SIGINT) stopping every node it started.

One `cluster up` serves the whole module; the tests run in file order and the last ones are
destructive (a node killed, then the whole thing stopped). Everything waits by polling with
a deadline, never by a fixed sleep.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.daemons import NO_WARMUP, START_DEADLINE_S, wait_until

DOWN_DEADLINE_MS = 15_000  # heartbeat every 1 s, down after 3 s, the page polls every 1 s
MAX_TOKENS = 24
CHAT_PROMPT = "Show me the source of abc"
TEXT_PROMPT = "def fibonacci(n):\n"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run"]
_ENDPOINT = re.compile(r"OpenAI endpoint: (\S+)/v1")
_NODE_PORTS = re.compile(r"local node\(s\) on ports ([\d, ]+)")


# --- processes, found through /proc (no psutil) ------------------------------------------------


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, session id) of a process, None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()  # state ppid pgrp session ...
    return fields[0], int(fields[3])


def session_pids(session: int) -> list[int]:
    """Live (not zombie) processes of a session."""
    pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    return [p for p in pids if (s := _stat(p)) is not None and s[1] == session and s[0] != "Z"]


def listening_pid(port: int, candidates: list[int]) -> int | None:
    """Which of `candidates` holds the TCP socket listening on `port`."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as rows:
            for row in list(rows)[1:]:
                fields = row.split()
                if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(f"socket:[{fields[9]}]")
    for pid in candidates:
        try:
            links = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
        except OSError:
            continue
        if links & inodes:
            return pid
    return None


# --- the cluster and the reference outputs -----------------------------------------------------


@dataclass
class Up:
    process: subprocess.Popen
    log: Path
    url: str
    node_ports: list[int]
    references: dict[str, dict[str, Any]]  # "chat" / "text" -> cluster generate --json

    @property
    def model(self) -> str:
        return self.client().models.list().data[0].id

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0)

    def cluster_json(self) -> dict[str, Any]:
        with urllib.request.urlopen(f"{self.url}/api/cluster", timeout=5) as response:
            return json.load(response)


def _generate(prompt: str, *, chat: bool, log: Path) -> subprocess.Popen:
    argv = ["--prompt", prompt, "--max-tokens", str(MAX_TOKENS), "--json"]
    return subprocess.Popen(
        [sys.executable, "-m", "cluster", "generate", *argv, *(["--chat"] if chat else [])],
        stdout=subprocess.PIPE,
        stderr=log.open("w"),
        text=True,
    )


def _wait_for_endpoint(process: subprocess.Popen, log: Path) -> tuple[str, list[int]]:
    def endpoint() -> tuple[str, list[int]] | None:
        text = log.read_text()
        if process.poll() is not None:
            raise AssertionError(f"cluster up exited with {process.returncode}:\n{text}")
        url, ports = _ENDPOINT.search(text), _NODE_PORTS.search(text)
        if url is None or ports is None:
            return None
        return url.group(1), [int(p) for p in ports.group(1).split(",")]

    return wait_until(endpoint, "the endpoint line of cluster up", START_DEADLINE_S)


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    logs = tmp_path_factory.mktemp("up")
    log = logs / "up.log"
    env = {k: v for k, v in os.environ.items() if k != "CLUSTER_TOKEN"}
    process = subprocess.Popen(
        [sys.executable, "-m", "cluster", "up", "--local", "3", "--port", "0"],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,  # its own process group: teardown reaches the nodes too
    )
    generators = {  # the single-process references, computed while the cluster starts
        "chat": _generate(CHAT_PROMPT, chat=True, log=logs / "generate-chat.log"),
        "text": _generate(TEXT_PROMPT, chat=False, log=logs / "generate-text.log"),
    }
    try:
        url, ports = _wait_for_endpoint(process, log)
        references = {}
        for name, generator in generators.items():
            out, _ = generator.communicate(timeout=START_DEADLINE_S)
            assert generator.returncode == 0 and out.strip(), (
                logs / f"generate-{name}.log"
            ).read_text()
            references[name] = json.loads(out)
        yield Up(process, log, url, ports, references)
    finally:
        for generator in generators.values():
            generator.kill()
            generator.wait()
        for pid in session_pids(process.pid):  # whatever a failed test left running
            os.kill(pid, signal.SIGKILL)
        process.wait()


# --- the OpenAI API ----------------------------------------------------------------------------


def test_chat_matches_generate(up: Up):
    reference = up.references["chat"]
    messages = [{"role": "user", "content": CHAT_PROMPT}]
    client = up.client()
    reply = client.chat.completions.create(
        model=up.model, messages=messages, max_tokens=MAX_TOKENS, temperature=0
    )
    assert reply.choices[0].message.content == reference["text"]
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == reference["prompt_tokens"]
    assert reply.usage.completion_tokens == len(reference["tokens"])

    chunks = list(
        client.chat.completions.create(
            model=up.model,
            messages=messages,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    deltas = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert len([d for d in deltas if d]) > 1  # it really streamed
    assert "".join(deltas) == reference["text"]
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens == reference["prompt_tokens"]
    assert usage.completion_tokens == len(reference["tokens"])


def test_completions_match_generate(up: Up):
    reference = up.references["text"]
    client = up.client()
    reply = client.completions.create(
        model=up.model, prompt=TEXT_PROMPT, max_tokens=MAX_TOKENS, temperature=0
    )
    assert reply.choices[0].text == reference["text"]
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == reference["prompt_tokens"]
    assert reply.usage.completion_tokens == len(reference["tokens"])

    pieces = list(
        client.completions.create(
            model=up.model, prompt=TEXT_PROMPT, max_tokens=MAX_TOKENS, temperature=0, stream=True
        )
    )
    assert len([p for p in pieces if p.choices[0].text]) > 1
    assert "".join(p.choices[0].text for p in pieces) == reference["text"]
    assert pieces[-1].choices[0].finish_reason == "length"


# --- cluster status ----------------------------------------------------------------------------


def test_status_lists_every_node_with_its_layers(up: Up):
    nodes = up.cluster_json()["nodes"]
    assert sorted(n["address"] for n in nodes) == sorted(f"127.0.0.1:{p}" for p in up.node_ports)
    ranges = [(n["start"], n["end"]) for n in nodes]  # pipeline order: contiguous from 0
    assert ranges[0][0] == 0 and all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    assert all(start < end for start, end in ranges) and ranges[-1][1] == 8
    # The three nodes share this machine: each plans within a third of its memory.
    machine = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert all(abs(n["memory_total_bytes"] - machine / 3) < 2**20 for n in nodes), nodes

    result = subprocess.run(
        [sys.executable, "-m", "cluster", "status", "--url", up.url],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    # The summary line, the table's header, a row per node, then the coordinator's own links
    # (a block of their own) and which nodes keep their Mac awake (one line, not a row).
    lines = result.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("node "))
    table_end = next(
        i
        for i, line in enumerate(lines)
        if line == "coordinator links" or line.startswith("keeping their Mac awake")
    )
    rows = {line.split()[0]: line for line in lines[header + 1 : table_end]}
    assert len(rows) == 3, result.stdout
    assert lines[-1].startswith("keeping their Mac awake: none; not: "), result.stdout
    for node in nodes:
        row = rows[node["node_id"]]
        assert node["address"] in row and f"[{node['start']}, {node['end']})" in row
        assert " up " in row


# --- the dashboard, and a node that dies -------------------------------------------------------


def test_dashboard_marks_a_killed_node_down_and_service_recovers(up: Up):
    playwright = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
    if not shutil.which(CHROMIUM):
        # CI installs it (.ci/run): there a missing browser is a failure, not a skip.
        (pytest.fail if os.environ.get("CI") else pytest.skip)("apt-get install -y chromium")
    expect = playwright.expect
    nodes = up.cluster_json()["nodes"]
    victim = next(n for n in nodes if not n["is_head"] and not n["is_tail"])
    victim_pid = listening_pid(
        int(victim["address"].rsplit(":", 1)[1]), session_pids(up.process.pid)
    )
    assert victim_pid is not None and victim_pid != up.process.pid

    with playwright.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 820})
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(f"{up.url}/")
            cards = page.locator(".node")
            expect(cards).to_have_count(3, timeout=DOWN_DEADLINE_MS)
            for index, node in enumerate(nodes):
                card = cards.nth(index)
                expect(card).to_have_attribute("data-node-id", node["node_id"])
                expect(card).to_contain_text(f"[{node['start']}, {node['end']})")
                expect(card.locator(".badge")).to_have_text("UP")
            expect(page.locator("#health")).to_have_text("healthy")

            os.kill(victim_pid, signal.SIGKILL)
            down = page.locator(f'.node[data-node-id="{victim["node_id"]}"]')
            expect(down).to_have_class(re.compile(r"\bnode-down\b"), timeout=DOWN_DEADLINE_MS)
            expect(down.locator(".badge")).to_have_text("DOWN")
            expect(page.locator(".node-down")).to_have_count(1)
            expect(page.locator("#health")).to_contain_text("degraded")
            assert errors == [], f"the page logged errors: {errors}"
        finally:
            browser.close()

    # The coordinator re-places the model on the two nodes left; greedy output is unchanged.
    def answer() -> str | None:
        try:
            reply = up.client().completions.create(
                model=up.model, prompt=TEXT_PROMPT, max_tokens=MAX_TOKENS, temperature=0
            )
        except openai.APIError:
            return None
        return reply.choices[0].text

    # A re-placement loads the shards again and warms them: a start's worth of work.
    back = wait_until(answer, "the service to come back", START_DEADLINE_S)
    assert back == up.references["text"]["text"]
    placed = [n for n in up.cluster_json()["nodes"] if n["end"] > n["start"]]
    assert victim["address"] not in [n["address"] for n in placed] and len(placed) == 2


# --- Ctrl-C ------------------------------------------------------------------------------------


def test_sigint_stops_everything(up: Up):
    """SIGINT to `cluster up` alone (not its group): it must stop the nodes it started."""
    children = [p for p in session_pids(up.process.pid) if p != up.process.pid]
    assert len(children) >= 2  # the nodes left alive (one was killed above)
    up.process.send_signal(signal.SIGINT)
    returncode = up.process.wait(timeout=30)
    assert returncode in (0, 130, -signal.SIGINT), up.log.read_text()
    wait_until(lambda: not session_pids(up.process.pid), "the nodes to be gone", 10.0)
    for port in up.node_ports:
        with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), 1):
            pass


def test_sigterm_stops_everything_too(tmp_path: Path):
    """`kill` or a service manager sends SIGTERM: the nodes must not outlive `cluster up`."""
    log = tmp_path / "up.log"
    process = subprocess.Popen(
        [sys.executable, "-m", "cluster", "up", "--local", "1", "--port", "0", NO_WARMUP],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        _wait_for_endpoint(process, log)
        assert len(session_pids(process.pid)) == 2  # `cluster up` and its node
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
        wait_until(lambda: not session_pids(process.pid), "the node to be gone", 10.0)
    finally:
        for pid in session_pids(process.pid):
            os.kill(pid, signal.SIGKILL)
        process.wait()
