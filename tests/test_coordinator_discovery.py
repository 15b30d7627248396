"""A coordinator started without `--nodes` finds the nodes that announce themselves over mDNS.

`cluster node` (advertising, as it does by default) and `cluster coordinator` (no `--nodes`,
browsing) run as processes. The coordinator places the model on the first node it finds and
answers a completion; a second node that starts shows up in `/api/cluster` as standby within
seconds and leaves it once stopped (its goodbye packets). Every run uses its own token and node
ids, so nodes of other runs on the same network are seen but never used.

A node started with `--host 127.0.0.1` announces exactly that address (the last test).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest

from coordinator.discovery import NodeDirectory

START_DEADLINE_S = 60.0
SEEN_DEADLINE_S = 15.0  # mDNS browse + resolve, then one heartbeat
LEFT_DEADLINE_S = 10.0
_LISTENING = re.compile(r"listening on \S+:(\d+)")
_ENDPOINT = re.compile(r"OpenAI endpoint: (\S+)/v1")


def wait_until(condition: Callable[[], Any], what: str, deadline_s: float) -> Any:
    """Poll `condition` until it returns something truthy; fail after `deadline_s`."""
    deadline = time.monotonic() + deadline_s
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {deadline_s}s waiting for {what}")
        time.sleep(0.05)
    return value


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Daemon:
    """A `cluster ...` process in its own process group, its output in a file."""

    process: subprocess.Popen
    log: Path

    @classmethod
    def start(cls, log: Path, token: str, *args: str) -> Daemon:
        process = subprocess.Popen(
            [sys.executable, "-m", "cluster", *args],
            stdout=log.open("w"),
            stderr=subprocess.STDOUT,
            env={**os.environ, "CLUSTER_TOKEN": token},
            start_new_session=True,
        )
        return cls(process, log)

    def wait_for(self, pattern: re.Pattern[str]) -> str:
        def found() -> str | None:
            text = self.log.read_text()
            if self.process.poll() is not None:
                raise AssertionError(f"{self.process.args} exited:\n{text}")
            match = pattern.search(text)
            return match.group(1) if match else None

        return wait_until(found, f"{pattern.pattern!r} in {self.log.name}", START_DEADLINE_S)

    def stop(self) -> None:
        """Ctrl-C: a node says goodbye over mDNS on its way out."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGINT)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


@pytest.fixture
def daemons() -> Iterator[list[Daemon]]:
    started: list[Daemon] = []
    yield started
    for daemon in reversed(started):
        daemon.stop()


def _cluster_nodes(url: str) -> dict[str, dict[str, Any]]:
    with urllib.request.urlopen(f"{url}/api/cluster", timeout=5) as response:
        return {n["node_id"]: n for n in json.load(response)["nodes"]}


def _complete(url: str) -> str:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    reply = client.completions.create(model=model, prompt="import os\n", max_tokens=8)
    assert reply.usage is not None and reply.usage.completion_tokens == 8
    return reply.choices[0].text


def test_coordinator_finds_advertising_nodes(tmp_path: Path, daemons: list[Daemon]):
    token = uuid.uuid4().hex
    run = uuid.uuid4().hex[:8]
    first, second = f"disc-{run}-a", f"disc-{run}-b"

    def node(node_id: str) -> Daemon:
        daemon = Daemon.start(
            tmp_path / f"{node_id}.log",
            token,
            *("node", "--host", "0.0.0.0", "--port", "0", "--node-id", node_id),
        )
        daemons.append(daemon)
        return daemon

    node(first)
    port = free_port()
    coordinator = Daemon.start(
        tmp_path / "coordinator.log", token, "coordinator", "--port", str(port)
    )  # no --nodes: mDNS only
    daemons.append(coordinator)
    url = coordinator.wait_for(_ENDPOINT)

    assert _complete(url)
    placed = _cluster_nodes(url)[first]
    assert (placed["start"], placed["end"], placed["is_head"], placed["is_tail"]) == (
        0,
        8,
        True,
        True,
    )
    assert placed["up"]

    node_b = node(second)

    def standby() -> dict[str, Any] | None:
        found = _cluster_nodes(url).get(second)
        return found if found is not None and found["up"] else None

    seen = wait_until(standby, f"{second} in /api/cluster", SEEN_DEADLINE_S)
    assert seen["start"] == seen["end"] == 0 and not seen["is_head"] and not seen["is_tail"]
    assert _cluster_nodes(url)[first]["end"] == 8  # a newcomer does not re-place the model

    node_b.stop()
    wait_until(lambda: second not in _cluster_nodes(url), f"{second} to leave", LEFT_DEADLINE_S)
    assert first in _cluster_nodes(url)
    assert _complete(url)


def test_node_on_loopback_announces_an_address_it_listens_on(tmp_path: Path, daemons: list[Daemon]):
    node_id = f"disc-{uuid.uuid4().hex[:8]}-lo"
    daemon = Daemon.start(
        tmp_path / "node.log",
        uuid.uuid4().hex,
        *("node", "--host", "127.0.0.1", "--port", "0", "--node-id", node_id),
    )
    daemons.append(daemon)
    port = daemon.wait_for(_LISTENING)

    async def announced() -> tuple[str, ...]:
        async with NodeDirectory(interfaces=["127.0.0.1"]) as directory:
            deadline = time.monotonic() + SEEN_DEADLINE_S
            while time.monotonic() < deadline:
                for found in directory.nodes():
                    if found.node_id == node_id:
                        return found.addresses
                await asyncio.sleep(0.05)
        raise AssertionError(f"{node_id} was not found over mDNS")

    assert asyncio.run(announced()) == (f"127.0.0.1:{port}",)
