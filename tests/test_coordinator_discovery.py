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
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from coordinator.discovery import NodeDirectory
from tests.daemons import ENDPOINT, LISTENING, NO_WARMUP, Daemon, free_port, wait_until

SEEN_DEADLINE_S = 15.0  # mDNS browse + resolve, then one heartbeat
LEFT_DEADLINE_S = 10.0


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
        tmp_path / "coordinator.log", token, "coordinator", "--port", str(port), NO_WARMUP
    )  # no --nodes: mDNS only
    daemons.append(coordinator)
    url = coordinator.wait_for(ENDPOINT)

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
    port = daemon.wait_for(LISTENING)

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
