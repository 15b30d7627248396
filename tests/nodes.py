"""Node daemons as real processes, for the multi-process tests.

`node_factory` (a module-scoped fixture: bind it in a test module as below) starts `cluster
node` processes on loopback. Each daemon binds port 0 and prints the port it got, so there is
no race for a free port; the factory waits (polling, with a deadline) until each one answers
Info with the cluster token, and kills them all at the module's teardown. Each node's output
goes to its own log file; when a test of the module fails, the tails of those logs are attached
to its report (shown under "node logs").

    import nodes

    node_factory = nodes.node_factory

    @pytest.fixture(scope="module")
    def trio(node_factory) -> NodeGroup:
        return node_factory(3)
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from cluster.decode.engine import GenerationEngine
from cluster.decode.remote_pipeline import PipelineSettings, RemotePipeline, load_pipeline
from cluster.transport.auth import token_metadata
from cluster.transport.node_client import NodeClient
from proto import cluster_pb2 as pb
from proto import cluster_pb2_grpc as pb_grpc

TOKEN = "test-cluster-secret"
START_TIMEOUT_S = 60.0
LOG_TAIL_LINES = 150
_LISTENING = re.compile(r"listening on (\S+):(\d+)")


@dataclass
class NodeProcess:
    """One `cluster node` process; `address` is host:port once it listens."""

    process: subprocess.Popen
    log_path: Path
    address: str = ""

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL (also ends a stopped process) and reap it."""
        if self.alive():
            self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=10)

    def pause(self) -> None:
        """SIGSTOP: the process stays, its sockets stay open, nothing answers."""
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.process.send_signal(signal.SIGCONT)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        return "\n".join(self.log().splitlines()[-lines:])


@dataclass
class NodeGroup:
    nodes: list[NodeProcess]
    token: str = TOKEN

    @property
    def addresses(self) -> list[str]:
        return [node.address for node in self.nodes]

    def __getitem__(self, index: int) -> NodeProcess:
        return self.nodes[index]

    def __len__(self) -> int:
        return len(self.nodes)

    def __iter__(self) -> Iterator[NodeProcess]:
        return iter(self.nodes)


def _command() -> list[str]:
    script = Path(sys.executable).with_name("cluster")
    if script.exists():
        return [str(script)]
    return [sys.executable, "-c", "from cluster.cli import main; main()"]


def start_nodes(
    count: int,
    log_dir: Path,
    *,
    token: str = TOKEN,
    tls: tuple[Path, Path] | None = None,
    args: Callable[[int], list[str]] | None = None,
    env: Callable[[int], dict[str, str]] | None = None,
) -> NodeGroup:
    """Start `count` nodes at once (they load in parallel) and wait until each answers Info.
    `tls` is (certificate, key): the nodes then serve TLS only. `args(i)` adds options to the
    i-th node's command line, `env(i)` to its environment."""
    tls_args = ["--tls-cert", str(tls[0]), "--tls-key", str(tls[1])] if tls else []
    log_dir.mkdir(parents=True, exist_ok=True)
    base_env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    nodes = []
    try:
        for i in range(count):
            log_path = log_dir / f"node-{len(list(log_dir.iterdir()))}.log"
            with open(log_path, "wb") as log:
                process = subprocess.Popen(
                    [*_command(), "-v", "node", "--host", "127.0.0.1", "--port", "0",
                     "--token", token, "--no-advertise", *tls_args, *(args(i) if args else [])],
                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    env={**base_env, **(env(i) if env else {})},
                )  # fmt: skip
            nodes.append(NodeProcess(process, log_path))
        deadline = time.monotonic() + START_TIMEOUT_S
        for node in nodes:
            node.address = _wait_listening(node, deadline)
            _wait_info(node, token, deadline, tls[0].read_bytes() if tls else None)
    except BaseException:
        for node in nodes:
            node.kill()
        raise
    return NodeGroup(nodes, token)


def _wait_listening(node: NodeProcess, deadline: float) -> str:
    while True:
        match = _LISTENING.search(node.log())
        if match:
            return f"{match[1]}:{match[2]}"
        if not node.alive():
            raise RuntimeError(f"node {node.pid} exited at start:\n{node.log_tail()}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"node {node.pid} did not listen in time:\n{node.log_tail()}")
        time.sleep(0.05)


def _wait_info(
    node: NodeProcess, token: str, deadline: float, cert: bytes | None = None
) -> pb.NodeInfo:
    channel = (
        grpc.secure_channel(node.address, grpc.ssl_channel_credentials(cert))
        if cert
        else grpc.insecure_channel(node.address)
    )
    with channel:
        stub = pb_grpc.NodeStub(channel)
        while True:
            try:
                return stub.Info(pb.InfoRequest(), timeout=2.0, metadata=token_metadata(token))
            except grpc.RpcError as error:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"node {node.address} never answered Info: {error}"
                    ) from None
            if not node.alive():
                raise RuntimeError(f"node {node.address} exited:\n{node.log_tail()}")
            time.sleep(0.05)


@dataclass
class _LogsOnFailure:
    """A plugin attaching the nodes' logs to the failed reports of one test module."""

    module: object
    nodes: list[NodeProcess] = field(default_factory=list)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo):
        report = yield
        if report.failed and getattr(item, "module", None) is self.module and self.nodes:
            text = "\n\n".join(
                f"== {node.address or node.pid} ({node.log_path}) ==\n{node.log_tail()}"
                for node in self.nodes
            )
            report.sections.append(("node logs", text))
        return report


@pytest.fixture(scope="module")
def node_factory(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[..., NodeGroup]]:
    """`node_factory(count, token=TOKEN, tls=, args=, env=) -> NodeGroup` (see `start_nodes`);
    every node is killed at teardown."""
    log_dir = tmp_path_factory.mktemp("node-logs")
    plugin = _LogsOnFailure(request.module)
    request.config.pluginmanager.register(plugin)

    def make(
        count: int,
        *,
        token: str = TOKEN,
        tls: tuple[Path, Path] | None = None,
        args: Callable[[int], list[str]] | None = None,
        env: Callable[[int], dict[str, str]] | None = None,
    ) -> NodeGroup:
        group = start_nodes(count, log_dir, token=token, tls=tls, args=args, env=env)
        plugin.nodes += group.nodes
        return group

    try:
        yield make
    finally:
        for node in plugin.nodes:
            node.kill()
        request.config.pluginmanager.unregister(plugin)


# ---- the driver's side, for async tests ----


@asynccontextmanager
async def remote_engine(
    model_dir: Path,
    addresses: list[str],
    *,
    ranges: list[tuple[int, int]] | None = None,
    token: str = TOKEN,
    prefill_chunk: int = 512,
    cache_budget_bytes: int | None = None,
) -> AsyncIterator[tuple[GenerationEngine, RemotePipeline]]:
    """Load a layout on the nodes (LoadShard replaces what they held) and drive it."""
    settings = PipelineSettings(token, ranges=ranges, cache_budget_bytes=cache_budget_bytes)
    pipeline = await load_pipeline(model_dir, addresses, settings)
    try:
        yield GenerationEngine(pipeline, prefill_chunk=prefill_chunk), pipeline
    finally:
        await pipeline.close()


async def node_infos(addresses: list[str], token: str = TOKEN) -> list[pb.NodeInfo]:
    clients = [NodeClient(address, token) for address in addresses]
    try:
        return list(await asyncio.gather(*(client.info() for client in clients)))
    finally:
        for client in clients:
            await client.close()


async def active_requests(addresses: list[str], token: str = TOKEN) -> list[int]:
    return [info.active_requests for info in await node_infos(addresses, token)]


def cluster_certificate(
    folder: Path, addresses: tuple[str, ...] = ("127.0.0.1",)
) -> tuple[Path, Path]:
    """A self-signed cluster certificate (and its key) whose names are these IP addresses."""
    cert, key = folder / "cluster.pem", folder / "cluster.key"
    names = ",".join(f"IP:{address}" for address in addresses)
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
         "-subj", "/CN=qwen-cluster", "-addext", f"subjectAltName={names}",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key
