"""Discovery over zeroconf on loopback, and the static node list.

Advertisers and browsers are restricted to 127.0.0.1 (IPv4 only): multicast on loopback works
on Linux and macOS without a network namespace, and keeps the tests off the real network.
Every test uses a fresh node id, so concurrent runs on the same machine do not mix, and waits
by polling with a deadline rather than by sleeping.
"""

from __future__ import annotations

import asyncio
import socket
import time
import uuid
from collections.abc import Callable

import pytest
from zeroconf import NonUniqueNameException
from zeroconf.asyncio import AsyncZeroconf

from cluster.transport.advertise import AdvertiseError, NodeAdvertiser
from coordinator.discovery import (
    DiscoveredNode,
    DiscoveryError,
    NodeChange,
    NodeDirectory,
    NodeSource,
    format_address,
    parse_address,
)

LOOPBACK = ["127.0.0.1"]
DEADLINE_S = 10.0


def unique_id() -> str:
    return f"test-{uuid.uuid4().hex[:12]}"


def free_port() -> int:
    """A port no other test run announces: static entries are matched by address."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def advertiser(node_id: str, port: int = 50123, memory: int = 123 * 2**30) -> NodeAdvertiser:
    return NodeAdvertiser(
        node_id,
        port,
        memory_bytes=memory,
        device="cpu-test",
        version="9.9.9",
        interfaces=LOOPBACK,
    )


async def wait_until(condition: Callable[[], bool], what: str) -> None:
    """Poll `condition` until it holds, failing after DEADLINE_S."""
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {DEADLINE_S}s waiting for {what}")
        await asyncio.sleep(0.05)


def find(directory: NodeDirectory, node_id: str) -> DiscoveredNode | None:
    return next((n for n in directory.nodes() if n.node_id == node_id), None)


def test_advertised_node_is_found_and_leaves_after_stop() -> None:
    node_id = unique_id()
    events: list[tuple[NodeChange, str]] = []

    async def scenario() -> None:
        async with NodeDirectory(interfaces=LOOPBACK) as directory:
            directory.add_listener(lambda change, n: events.append((change, n.node_id)))
            adv = advertiser(node_id)
            await adv.start()
            try:
                await wait_until(lambda: find(directory, node_id) is not None, "the node")
                found = find(directory, node_id)
                assert found is not None
                assert found.source is NodeSource.MDNS
                assert found.address == "127.0.0.1:50123"
                assert found.memory_bytes == 123 * 2**30
                assert (found.device, found.version) == ("cpu-test", "9.9.9")
            finally:
                await adv.stop()
            started = time.monotonic()
            await wait_until(lambda: find(directory, node_id) is None, "the node to leave")
            assert time.monotonic() - started < 5.0

    asyncio.run(scenario())
    mine = [change for change, n in events if n == node_id]
    assert mine == [NodeChange.ADDED, NodeChange.REMOVED]


def test_directory_started_later_finds_running_node_and_sees_updates() -> None:
    node_id = unique_id()

    async def scenario() -> None:
        async with advertiser(node_id, memory=1000) as adv:
            changes: list[NodeChange] = []
            async with NodeDirectory(interfaces=LOOPBACK) as directory:
                directory.add_listener(
                    lambda change, n: changes.append(change) if n.node_id == node_id else None
                )
                await wait_until(lambda: find(directory, node_id) is not None, "the node")
                await adv.update(memory_bytes=2000)
                await wait_until(
                    lambda: getattr(find(directory, node_id), "memory_bytes", None) == 2000,
                    "the new memory figure",
                )
            assert changes[0] is NodeChange.ADDED and NodeChange.UPDATED in changes

    asyncio.run(scenario())


def test_static_nodes_always_stay() -> None:
    static = ["10.9.8.7:5000", "10.9.8.6:5001"]

    async def scenario() -> None:
        directory = NodeDirectory(static, interfaces=LOOPBACK)
        assert [n.address for n in directory.nodes()] == static
        async with directory:
            assert [n.address for n in directory.nodes()[:2]] == static
        assert [n.source for n in directory.nodes()] == [NodeSource.STATIC] * 2

    asyncio.run(scenario())
    assert NodeDirectory(static, browse=False).nodes()[0] == DiscoveredNode(
        "10.9.8.7:5000", "10.9.8.7:5000", NodeSource.STATIC
    )


def test_static_node_enriched_by_its_announcement_and_kept_after_it_leaves() -> None:
    node_id = unique_id()
    port = free_port()

    async def scenario() -> None:
        async with NodeDirectory([f"127.0.0.1:{port}"], interfaces=LOOPBACK) as directory:
            adv = advertiser(node_id, port=port)
            await adv.start()
            try:
                await wait_until(lambda: find(directory, node_id) is not None, "the node")
                same = [n for n in directory.nodes() if n.address == f"127.0.0.1:{port}"]
                assert [n.node_id for n in same] == [node_id]  # listed once, with its record
            finally:
                await adv.stop()
            await wait_until(lambda: find(directory, node_id) is None, "the node to leave")
            static = [n for n in directory.nodes() if n.address == f"127.0.0.1:{port}"]
            assert [n.source for n in static] == [NodeSource.STATIC]

    asyncio.run(scenario())


def test_duplicate_node_id_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """zeroconf's probe finds a duplicate across machines; on one host the defending answer
    is unicast to port 5353, which SO_REUSEPORT hands to an arbitrary local stack, so the
    conflict itself is simulated here and only its translation is tested."""

    async def conflict(self: AsyncZeroconf, info: object, **kw: object) -> None:
        raise NonUniqueNameException(str(info))

    monkeypatch.setattr(AsyncZeroconf, "async_register_service", conflict)

    async def scenario() -> None:
        adv = advertiser(unique_id())
        with pytest.raises(AdvertiseError, match="unique"):
            await adv.start()
        await adv.stop()  # nothing to stop: start left nothing behind

    asyncio.run(scenario())


def test_listener_errors_do_not_stop_others() -> None:
    node_id = unique_id()
    seen: list[str] = []

    def broken(change: NodeChange, node: DiscoveredNode) -> None:
        raise RuntimeError("listener bug")

    async def scenario() -> None:
        async with NodeDirectory(interfaces=LOOPBACK) as directory:
            directory.add_listener(broken)
            remove = directory.add_listener(lambda change, n: seen.append(n.node_id))
            async with advertiser(node_id):
                await wait_until(lambda: node_id in seen, "the listener call")
                remove()
                remove()  # idempotent

    asyncio.run(scenario())


def test_parse_and_format_address() -> None:
    assert parse_address(" host:50051 ") == "host:50051"
    assert parse_address("[::1]:7") == "[::1]:7"
    for bad in ("host", ":5", "host:", "host:0", "host:70000", "host:x"):
        with pytest.raises(DiscoveryError):
            parse_address(bad)
    assert format_address("10.0.0.1", 5) == "10.0.0.1:5"
    assert format_address("fe80::1", 5) == "[fe80::1]:5"
    assert format_address("mac.local", 5) == "mac.local:5"


def test_advertiser_validates_its_record() -> None:
    with pytest.raises(AdvertiseError):
        NodeAdvertiser("a.b", 5000, memory_bytes=1)
    with pytest.raises(AdvertiseError):
        NodeAdvertiser("a", 0, memory_bytes=1)
    with pytest.raises(AdvertiseError):
        NodeAdvertiser("x" * 64, 5000, memory_bytes=1)
    assert NodeAdvertiser("a", 5000, memory_bytes=1, interfaces=LOOPBACK).addresses == LOOPBACK
