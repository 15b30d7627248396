"""A node keeps its Mac awake while it holds a shard (node.keep_awake): the assertion it takes
on macOS (`caffeinate -i -s -w PID`, here a stand-in script), its release when the shard is
unloaded or the node stops, nothing at all on Linux, and the launchd agent that restarts a
crashed node and starts it at login."""

from __future__ import annotations

import asyncio
import os
import plistlib
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster.hosts.remote import node_argv
from cluster.hosts.service import NodeService as HostService
from node.keep_awake import KeepAwake
from proto import cluster_pb2 as pb
from tests.fakes import ServicerContext

MODEL = Path(__file__).resolve().parent.parent / "cluster" / "assets" / "qwen3_5-tiny-mtp"


class FakePopen:
    """Records the command; runs until terminated."""

    def __init__(self, argv: list[str], **kwargs: object) -> None:
        self.argv, self.kwargs, self.returncode = argv, kwargs, None
        self.terminated = False

    def poll(self) -> int | None:
        return self.returncode

    def terminate(self) -> None:
        self.terminated, self.returncode = True, -15

    def wait(self, timeout: float | None = None) -> int | None:
        return self.returncode

    def kill(self) -> None:
        self.returncode = -9


def on_a_mac(**kwargs: object) -> KeepAwake:
    which = {"caffeinate": "/usr/bin/caffeinate"}.get
    return KeepAwake(platform="darwin", which=which, popen=FakePopen, pid=4242, **kwargs)


def fake_caffeinate(tmp_path: Path) -> Path:
    """A `caffeinate` that writes its arguments down and then waits, as the real one does."""
    script = tmp_path / "caffeinate"
    script.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "args"}\nexec sleep 600\n')
    script.chmod(0o755)
    return script


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def test_on_macos_it_runs_caffeinate_against_idle_and_system_sleep_until_the_node_exits():
    keep = on_a_mac()
    assert not keep.holding and keep.reason == "no shard loaded"
    assert keep.hold()
    process = keep._process
    assert process.argv == ["/usr/bin/caffeinate", "-i", "-s", "-w", "4242"]
    assert process.kwargs["stdin"] == subprocess.DEVNULL
    assert keep.holding and keep.reason == "held by /usr/bin/caffeinate -i -s -w 4242"
    assert keep.hold() and keep._process is process  # held once, however often a shard loads
    keep.release()
    assert process.terminated and not keep.holding and keep.reason == "no shard loaded"
    keep.release()  # idempotent


def test_a_caffeinate_that_died_is_reported_and_taken_again():
    keep = on_a_mac()
    keep.hold()
    keep._process.returncode = 1
    assert not keep.holding and "caffeinate exited with 1" in keep.reason
    assert keep.hold() and keep.holding


def test_on_linux_nothing_is_held_and_the_reason_says_so(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(sys, "platform", "linux")
    started: list[list[str]] = []
    keep = KeepAwake(popen=lambda argv, **_: started.append(argv))
    assert not keep.hold() and not keep.holding
    assert keep.reason == "not macOS (linux): nothing to keep awake"
    keep.release()
    assert keep.reason == "not macOS (linux): nothing to keep awake" and started == []


def test_a_mac_without_caffeinate_says_it_may_sleep():
    keep = KeepAwake(platform="darwin", which=lambda _: None, popen=FakePopen)
    assert not keep.hold() and not keep.holding
    assert "caffeinate not found" in keep.reason


def test_release_ends_a_real_companion_process(tmp_path: Path):
    keep = KeepAwake(platform="darwin", which=lambda _: str(fake_caffeinate(tmp_path)))
    assert keep.hold()
    pid = keep._process.pid
    deadline = time.monotonic() + 10
    while not (tmp_path / "args").exists():
        assert time.monotonic() < deadline, "the companion did not start"
        time.sleep(0.02)
    assert (tmp_path / "args").read_text().split() == ["-i", "-s", "-w", str(os.getpid())]
    keep.release("the node stopped")
    assert not alive(pid) and keep.reason == "the node stopped"


def test_the_node_holds_it_while_a_shard_is_loaded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """LoadShard takes it (once, through a reload, which releases the old shard's first),
    the node's info reports it, and stopping the node releases it."""
    from cluster.weights.store import WeightsStore
    from node import server

    script = fake_caffeinate(tmp_path)
    made: list[KeepAwake] = []

    def keep_awake() -> KeepAwake:
        made.append(KeepAwake(platform="darwin", which=lambda _: str(script)))
        return made[-1]

    monkeypatch.setattr(server, "KeepAwake", keep_awake)

    async def run() -> None:
        settings = server.NodeSettings(token="t", node_id="mac-1")
        node = server.NodeService(settings, WeightsStore(tmp_path / "store"))
        try:
            info = node._info()
            assert not info.keeps_awake and info.keep_awake_note == "no shard loaded"
            request = pb.LoadShardRequest(
                model_dir=str(MODEL), start=0, end=8, is_head=True, is_tail=True, epoch=1
            )
            info = await node.LoadShard(request, ServicerContext())
            assert info.keeps_awake and "-i -s -w" in info.keep_awake_note, info
            first = made[0]._process.pid
            # Another shard: released, taken again.
            info = await node.LoadShard(request, ServicerContext())
            assert info.keeps_awake and not alive(first)
            second = made[0]._process.pid
        finally:
            await node.close()
        assert not node._info().keeps_awake and not alive(second)
        assert node._info().keep_awake_note == "the node stopped"

    asyncio.run(run())


def test_the_launchd_agent_restarts_a_crashed_node_and_starts_it_at_login(tmp_path: Path):
    argv = node_argv("10.0.0.2", 50151, tmp_path / "secret", None)
    agent = HostService("10.0.0.2", "launchd", str(tmp_path), tuple(argv))
    plist = plistlib.loads(plistlib.dumps(agent.launchd_plist()))
    assert plist["Label"] == "com.qwencluster.node.10.0.0.2"
    assert plist["KeepAlive"] is True  # restarted whenever it exits: a crash, a kill
    assert plist["RunAtLoad"] is True  # the agent loads at login: the node starts then
    assert plist["ProgramArguments"] == argv
    assert plist["ProgramArguments"][plist["ProgramArguments"].index("--node-id") + 1] == (
        "10.0.0.2"
    )
    assert plist["StandardErrorPath"] == str(tmp_path / "node.log")
    assert agent.definition == (
        Path.home() / "Library" / "LaunchAgents" / "com.qwencluster.node.10.0.0.2.plist"
    )
