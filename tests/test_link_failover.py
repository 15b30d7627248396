"""Link failover: a hop's stream moves to the successor's next-best address when its path
fails, resending exactly what did not arrive, and back when the best answers again.

The first tests run on loopback anywhere: a relay the test controls stands for the fast
path (127.0.0.2), the direct address (127.0.0.1) for the slow one. The lab tests (below) run
whole clusters across network namespaces (tests/hostlab.py) and skip where it cannot run.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc
import pytest
from click.testing import CliRunner

from benchmarks.link_failover import FAST, SLOW, Relay
from cluster.commands.status import status_command
from cluster.decode import remote_pipeline
from cluster.decode.remote_pipeline import RemotePipeline
from cluster.transport import failover
from cluster.transport.auth import TLSConfig, TokenInterceptor
from cluster.transport.failover import ResultsStreamLink, Route, StepStreamLink
from cluster.transport.hop_choice import HopChoice
from cluster.transport.node_client import NodeClient, NodeUnavailable
from cluster.transport.step_link import StepListener, StepSender
from cluster.transport.wire import results_to_proto
from coordinator.metrics import (
    ClusterStats,
    CoordinatorLinkStatus,
    RequestCounters,
    cluster_json,
    render_prometheus,
)
from coordinator.service import coordinator_link_statuses
from node.stage import Subscribers
from proto import cluster_pb2 as pb
from proto import cluster_pb2_grpc as pb_grpc
from tests import hostlab, nodes
from tests.fakes import FakeClusterView, FakeEngine, serve

TOKEN = "failover-test-token"
NODE_ID = "successor"
DEADLINE_S = 30.0


class Pinged(pb_grpc.NodeServicer):
    async def LinkPing(self, request, context):
        return pb.LinkPingReply(node_id=NODE_ID, payload=request.payload)


async def ping_server(
    host: str, port: int = 0, tls: TLSConfig | None = None
) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server(interceptors=[TokenInterceptor(TOKEN)])
    pb_grpc.add_NodeServicer_to_server(Pinged(), server)
    address = f"{host}:{port}"
    if tls is None:
        bound = server.add_insecure_port(address)
    else:
        bound = server.add_secure_port(address, tls.server_credentials())
    await server.start()
    return server, bound


@pytest.fixture(scope="module")
def cluster_tls(tmp_path_factory: pytest.TempPathFactory) -> TLSConfig:
    """A cluster certificate for both loopback addresses the streams are dialled at."""
    folder = tmp_path_factory.mktemp("tls")
    return TLSConfig.from_files(*nodes.cluster_certificate(folder, (SLOW, FAST)))


async def wait_for(condition, what: str) -> None:
    deadline = asyncio.get_running_loop().time() + DEADLINE_S
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def step(sequence: int) -> bytes:
    """A step message's bytes (never empty: a zero-length frame is a keepalive)."""
    return pb.StepBatch(sequence=sequence, epoch=1).SerializeToString()


@pytest.fixture
def quick_failback(monkeypatch):
    """Idle enough after a short quiet spell (the watchdog's other figures as shipped)."""
    monkeypatch.setattr(failover, "FAILBACK_IDLE_S", 0.3)


@pytest.mark.parametrize("encrypted", [False, True], ids=["plain", "tls"])
def test_step_stream_moves_to_the_next_address_and_back_without_losing_a_step(
    quick_failback, encrypted, request
):
    """Under TLS too: the stream is encrypted end to end, the relay passes its bytes on."""
    tls = request.getfixturevalue("cluster_tls") if encrypted else None

    async def main():
        received: list[int] = []
        listener = StepListener(
            TOKEN,
            lambda message: received.append(message.sequence),
            tls_context=tls.server_context() if tls else None,
        )
        port = await listener.start(SLOW)
        relay = Relay(port)
        await relay.start()
        pings, grpc_port = await ping_server(FAST, tls=tls)
        routes = (Route(FAST, grpc_port, "thunderbolt"), Route(SLOW, grpc_port, "wifi"))
        link = await StepStreamLink.open("next node", routes, NODE_ID, TOKEN, tls, port)
        try:
            assert link.state.current.host == FAST
            for sequence in range(50):
                await link.send(step(sequence))
            await wait_for(lambda: len(received) == 50, "the first steps")
            relay.cut = True  # the fast path goes silent under the open stream
            await pings.stop(None)
            for sequence in range(50, 200):
                await link.send(step(sequence))
                await asyncio.sleep(0.005)
            await wait_for(lambda: len(received) >= 200, "every step")
            assert received == list(range(200))  # each exactly once, in order
            state = link.state
            assert (state.current.host, state.failovers, state.degraded) == (SLOW, 1, True)
            assert "no answer over 127.0.0.2" in state.last_reason

            relay.cut = False  # the fast path answers again: the idle link moves back
            pings, _ = await ping_server(FAST, grpc_port, tls)
            await wait_for(lambda: not link.state.degraded, "the move back")
            assert link.state.failbacks == 1
            await link.send(step(200))
            await wait_for(lambda: len(received) == 201, "a step after the move back")
            assert received == list(range(201))
        finally:
            await link.close()
            await relay.close()
            await pings.stop(None)
            await listener.close()

    asyncio.run(main())


def test_a_reset_moves_the_stream_at_once_and_a_lost_node_fails_it():
    async def main():
        received: list[int] = []
        listener = StepListener(TOKEN, lambda message: received.append(message.sequence))
        port = await listener.start(SLOW)
        relay = Relay(port)
        await relay.start()
        routes = (Route(FAST, 1), Route(SLOW, 1))
        link = await StepStreamLink.open("next node", routes, NODE_ID, TOKEN, None, port)
        try:
            await link.send(step(0))
            relay.cut = True
            await relay.close()  # every relayed connection reset, the relay gone
            for sequence in range(1, 20):
                await link.send(step(sequence))
            await wait_for(lambda: len(received) >= 20, "every step")
            assert received == list(range(20))
            assert link.state.current.host == SLOW

            await listener.close()  # the node itself is gone: no address answers
            with pytest.raises(failover.LinkLost, match="no address of next node answers"):
                for sequence in range(20, 400):
                    await link.send(step(sequence))
                    await asyncio.sleep(0.01)
        finally:
            await link.close()

    asyncio.run(main())


def test_a_stream_the_listener_never_saw_is_refused_as_a_resume():
    """A node that restarted cannot say what it took: the link fails instead of guessing."""

    async def main():
        listener = StepListener(TOKEN, lambda message: None)
        port = await listener.start(SLOW)
        link = await StepStreamLink.open("next node", (Route(SLOW, 1),), "", TOKEN, None, port)
        try:
            await link.send(step(0))
            listener.taken.clear()  # as a restarted node knows nothing of the stream
            link._drop_current()
            with pytest.raises(failover.LinkLost, match="lost the step stream"):
                await link.send(step(1))
        finally:
            await link.close()
            await listener.close()

    asyncio.run(main())


def test_results_stream_moves_to_the_next_address_without_losing_a_batch():
    async def main():
        subscribers = Subscribers()
        listener = StepListener(
            TOKEN, lambda message: None, subscribers.add_link, subscribers.resume_link
        )
        port = await listener.start(SLOW)
        relay = Relay(port)
        await relay.start()
        got: list[str] = []
        lost: list[str] = []

        def on_batch(batch: pb.ResultBatch) -> None:
            got.extend(error.request_id for error in batch.errors)

        routes = (Route(FAST, 1), Route(SLOW, 1))
        link = await ResultsStreamLink.open(
            "results", routes, "", TOKEN, None, port, on_batch, lost.append
        )

        def publish(i: int) -> None:
            errors = [(f"r{i}", grpc.StatusCode.UNAVAILABLE, "x")]
            subscribers.publish(results_to_proto([], errors, 0))

        try:
            for i in range(30):
                publish(i)
            await wait_for(lambda: len(got) == 30, "the first batches")
            relay.cut = True
            for i in range(30, 100):
                publish(i)
                await asyncio.sleep(0.01)
            await wait_for(lambda: len(got) >= 100, "every batch")
            assert got == [f"r{i}" for i in range(100)]
            assert (link.state.current.host, link.state.failovers) == (SLOW, 1)
            assert not lost
        finally:
            await link.close()
            await relay.close()
            await listener.close()

    asyncio.run(main())


def test_a_plain_step_stream_still_opens():
    """Senders that do not resume (the first protocol) are served as before."""

    async def main():
        received = []
        listener = StepListener(TOKEN, received.append)
        port = await listener.start(SLOW)
        sender = await StepSender.open(SLOW, port, TOKEN)
        await sender.send(step(7))
        await wait_for(lambda: received, "the step")
        assert received[0].sequence == 7
        await sender.close()
        await listener.close()

    asyncio.run(main())


# -- the coordinator's own links: its control calls, and its links in the status --------------

HEARTBEAT_TIMEOUT_S = 3.0  # generous: a loaded machine must not fail over by itself
NODE_LINKS = [
    pb.NodeLink(address=FAST, interface="tb0", kind="thunderbolt"),
    pb.NodeLink(address=SLOW, interface="en0", kind="ethernet"),
]


class ControlNode(Pinged):
    """A node's control RPCs: Info, naming its two addresses (counted), and LinkPing."""

    def __init__(self) -> None:
        self.infos = 0

    async def Info(self, request, context):
        self.infos += 1
        return pb.NodeInfo(node_id=NODE_ID, links=NODE_LINKS)


async def node_server(node: ControlNode, host: str, port: int = 0) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server(interceptors=[TokenInterceptor(TOKEN)])
    pb_grpc.add_NodeServicer_to_server(node, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    return server, bound


def test_the_heartbeat_keeps_a_node_whose_fast_address_goes_silent(quick_failback):
    """The node's calls move to its next address while the first holds every byte (an
    interface gone down under an open channel), back once it answers again, and the node
    fails only when no address answers, the error naming each."""

    async def main():
        node = ControlNode()
        server, port = await node_server(node, SLOW)
        relay = Relay(port)  # FAST:port, the fast path, to the node at SLOW:port
        await relay.start()
        client = NodeClient(f"{FAST}:{port}", TOKEN)
        pipeline = RemotePipeline(
            [client], max_context=64, heartbeat_s=0.05, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S
        )
        heartbeat = None
        try:
            await client.info()
            assert [route.host for route in client.link.routes] == [FAST, SLOW]
            heartbeat = asyncio.create_task(pipeline._heartbeat(client))
            await wait_for(lambda: node.infos >= 3, "heartbeats over the fast address")

            relay.cut = True
            await wait_for(lambda: client.link.current.host == SLOW, "the calls to move")
            answered = node.infos
            await wait_for(lambda: node.infos >= answered + 3, "heartbeats over the slow address")
            assert pipeline.failure is None and not heartbeat.done()
            link = client.link
            assert (link.failovers, link.degraded, link.failed) == (1, True, "")
            assert f"{FAST}:{port} (thunderbolt, tb0)" in link.last_reason

            relay.cut = False  # answers again: the calls move back
            await wait_for(lambda: not client.link.degraded, "the move back")
            assert (client.link.failbacks, client.link.current.host) == (1, FAST)
            answered = node.infos
            await wait_for(lambda: node.infos >= answered + 3, "heartbeats after the move back")
            assert pipeline.failure is None

            await server.stop(None)  # the node is gone: no address answers
            await wait_for(lambda: heartbeat.done(), "the heartbeat to fail the node")
            error = str(pipeline.failure)
            assert isinstance(pipeline.failure, NodeUnavailable), error
            assert "no address of node successor" in error, error
            assert f"{FAST}:{port} (thunderbolt, tb0)" in error, error
            assert f"{SLOW}:{port} (ethernet, en0): no answer to a LinkPing" in error, error
            assert client.link.failed
        finally:
            if heartbeat is not None:
                heartbeat.cancel()
            await pipeline.close()  # closes the client
            await relay.close()
            await server.stop(None)

    asyncio.run(main())


def test_a_call_to_an_address_that_refuses_goes_over_the_next_and_rollback_is_not_resent():
    async def main():
        node = ControlNode()
        server, port = await node_server(node, SLOW)
        given = f"{FAST}:{port}"  # nothing listens there: refused
        client, rolling = NodeClient(given, TOKEN), NodeClient(given, TOKEN)
        try:
            with pytest.raises(NodeUnavailable, match=f"node {given} is unreachable: {given}"):
                await client.info()  # the only address it knows yet
            client.use_links(NODE_LINKS)
            info = await client.info()
            assert info.node_id == NODE_ID
            assert (client.link.current.host, client.link.failovers) == (SLOW, 1)
            assert client.describe() == f"{NODE_ID} ({given})"  # its name stays

            # A call the node may have acted on is not sent again over another address.
            rolling.use_links(NODE_LINKS)
            with pytest.raises(NodeUnavailable, match=r"did not answer Rollback .* not sent again"):
                await rolling.rollback("r", 1)
            assert rolling.link.current.host == SLOW  # later calls go over the next
            await rolling.info()
        finally:
            await client.close()
            await rolling.close()
            await server.stop(None)

    asyncio.run(main())


@dataclass
class PipelineView:
    """The coordinator's view of a pipeline that has no nodes to show but its links."""

    pipeline: RemotePipeline

    def node_statuses(self) -> list:
        return []

    def stats(self) -> ClusterStats:
        return ClusterStats(0.0, 0.0, 0, 0, 0, "model")

    def coordinator_links(self) -> list[CoordinatorLinkStatus]:
        return coordinator_link_statuses(self.pipeline)


@dataclass(slots=True)
class LinkedClusterView(FakeClusterView):
    """The fake cluster, with links of the coordinator's to show."""

    links: list[CoordinatorLinkStatus] = field(default_factory=list)

    def coordinator_links(self) -> list[CoordinatorLinkStatus]:
        return list(self.links)


def test_the_coordinator_links_show_their_failovers_in_the_status_and_metrics(
    quick_failback, monkeypatch
):
    """The driver's steps to the head, the head's results back and its control calls all
    move when the head's fast address goes silent; /api/cluster, /metrics and `cluster
    status` show where each runs, flagged degraded, with its failover and why."""

    async def measured(address, links, node_id, token, tls):  # as over two networks
        _, port = address.rsplit(":", 1)
        tried = ((f"{FAST}:{port}", 0.1), (f"{SLOW}:{port}", 0.4))
        return HopChoice(f"{FAST}:{port}", "thunderbolt", "tb0", 0.1, True, tried)

    monkeypatch.setattr(remote_pipeline, "choose_hop", measured)

    async def main() -> tuple[list[CoordinatorLinkStatus], str]:
        node = ControlNode()
        server, grpc_port = await node_server(node, SLOW)
        subscribers = Subscribers()
        listener = StepListener(
            TOKEN, lambda message: None, subscribers.add_link, subscribers.resume_link
        )
        step_port = await listener.start(SLOW)
        relays = [Relay(grpc_port), Relay(step_port)]  # the fast network, both ports
        for relay in relays:
            await relay.start()
        client = NodeClient(f"{FAST}:{grpc_port}", TOKEN)
        await client.info()
        pipeline = RemotePipeline(
            [client],
            max_context=64,
            heartbeat_s=0.05,
            heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S,
            step_ports=[step_port],
            node_links=[NODE_LINKS],
        )
        view = PipelineView(pipeline)
        try:
            await pipeline.start()
            assert pipeline.transports == {"steps": "tcp", "results": ["tcp"]}
            before = cluster_json(view)["coordinator_links"]
            assert [(link["role"], link["address"], link["degraded"]) for link in before] == [
                ("steps", f"{FAST}:{grpc_port}", False),
                ("results", f"{FAST}:{grpc_port}", False),
                ("control", f"{FAST}:{grpc_port}", False),
            ]

            for relay in relays:  # the head's fast interface goes down
                relay.cut = True
            await wait_for(
                lambda: all(link.address.startswith(SLOW) for link in view.coordinator_links()),
                "every coordinator link to move to the slow address",
            )
            assert pipeline.failure is None  # nothing failed, nothing to re-place
            document = cluster_json(view)
            for link in document["coordinator_links"]:
                assert link["node_id"] == NODE_ID and link["node_address"] == client.address
                assert (link["kind"], link["degraded"], link["failovers"]) == ("ethernet", True, 1)
                assert link["best_address"] == f"{FAST}:{grpc_port}"
                assert FAST in link["last_failover"], link
            transports = [link["transport"] for link in document["coordinator_links"]]
            assert transports == ["tcp", "tcp", "grpc"]
            moved = view.coordinator_links()
            metrics = render_prometheus(
                view, RequestCounters(), requests_queued=0, requests_running=0
            )

            for relay in relays:  # back up, and idle: every link moves back
                relay.cut = False
            await wait_for(
                lambda: not any(link.degraded for link in view.coordinator_links()),
                "every coordinator link to move back",
            )
            assert [link.failbacks for link in view.coordinator_links()] == [1, 1, 1]
            assert pipeline.failure is None
            return moved, metrics
        finally:
            await pipeline.close()
            for relay in relays:
                await relay.close()
            await listener.close()
            await server.stop(None)

    moved, metrics = asyncio.run(main())
    for role in ("steps", "results", "control"):
        labels = f'role="{role}",node="{NODE_ID}"'
        assert f"cluster_coordinator_link_failovers_total{{{labels}}} 1" in metrics, metrics
        assert f"cluster_coordinator_link_degraded{{{labels}}} 1" in metrics, metrics
        assert f"cluster_coordinator_link_failed{{{labels}}} 0" in metrics, metrics
        assert f"cluster_coordinator_link_last_failover_info{{{labels},reason=" in metrics
    slow = moved[0].address
    assert (
        f'cluster_coordinator_link{{role="steps",node="{NODE_ID}",address="{slow}",'
        'kind="ethernet",transport="tcp"} 1' in metrics
    ), metrics

    # `cluster status`, human and --json, over the coordinator's HTTP API.
    with serve(FakeEngine.saying("hi"), view=LinkedClusterView(links=moved)) as served:
        shown = CliRunner().invoke(status_command, ["--url", served.url])
        as_json = CliRunner().invoke(status_command, ["--url", served.url, "--json"])
    assert shown.exit_code == 0, shown.output
    assert "coordinator links" in shown.output
    lines = [line for line in shown.output.splitlines() if f"{NODE_ID} " in line]
    assert len(lines) == 3 and all("DEGRADED (best: " in line for line in lines), shown.output
    assert all("failovers 1, last: " in line for line in lines), shown.output
    assert json.loads(as_json.output)["coordinator_links"][0]["failovers"] == 1


def test_the_dashboard_flags_a_degraded_coordinator_link():
    """Each coordinator link is drawn on its node's card as a hop is, flagged while off its
    best address, and the health pill says how many links are degraded."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
    from tests.test_dashboard import CHROMIUM, CHROMIUM_ARGS, POLL_DEADLINE_MS

    if not shutil.which(CHROMIUM):
        pytest.skip("apt-get install -y chromium")
    view = LinkedClusterView()
    head = view.nodes[0]
    view.links = [
        CoordinatorLinkStatus(
            "steps", head.node_id, head.address, "tcp", "192.168.1.10:50051", "wifi", "en0",
            best_address="10.0.0.10:50051", degraded=True, failovers=1,
            last_failover="no answer over 10.0.0.10 (thunderbolt) for 1.5 s",
        ),
        CoordinatorLinkStatus(
            "results", head.node_id, head.address, "tcp", "10.0.0.10:50051", "thunderbolt",
            best_address="10.0.0.10:50051",
        ),
    ]  # fmt: skip
    with (
        serve(FakeEngine.saying("hi"), view=view) as served,
        sync_api.sync_playwright() as pw,
    ):
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(f"{served.url}/")
            card = page.locator(".node").nth(0)
            expect = sync_api.expect
            steps = card.locator("dd.degraded")
            expect(steps).to_have_count(1, timeout=POLL_DEADLINE_MS)
            expect(steps).to_contain_text("192.168.1.10:50051 · wifi")
            expect(steps).to_contain_text("degraded (best 10.0.0.10:50051) · 1 failover")
            expect(steps).to_have_attribute("title", re.compile("no answer over 10.0.0.10"))
            expect(card).to_contain_text("From coordinator")
            expect(card).to_contain_text("To coordinator")
            expect(page.locator(".node").nth(1)).not_to_contain_text("From coordinator")
            expect(page.locator("#health")).to_have_text("healthy · 1 link degraded")
            assert errors == [], errors
        finally:
            browser.close()


# -- the hosts lab: whole clusters over two networks ------------------------------------------

LAB_MISSING = hostlab.available()
needs_lab = pytest.mark.skipif(LAB_MISSING is not None, reason=LAB_MISSING or "")
STREAMS = 6
STREAM_TOKENS = 200
PROMPTS = [f"Story {i}: once upon a time" for i in range(STREAMS)]
MOVE_S = 3.0  # a hop is on the slow address within this after its fast link goes down


@dataclass
class FailoverLab:
    lab: hostlab.HostLab
    up: object  # tests.test_hosts_cluster.Up
    secret: str
    references: list[str]
    order: list[tuple[hostlab.Host, int]]  # the hosts in pipeline order, with node ports


@pytest.fixture(scope="module")
def failover_lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FailoverLab]:
    from tests import test_hosts_cluster as hosts  # imported here: it skips where no lab runs

    directory = tmp_path_factory.mktemp("failover")
    the_lab = hostlab.HostLab(directory / "lab", root_on_fast=True).start()
    cluster_file = directory / "cluster.toml"
    up = None
    try:
        command = the_lab.cluster_command()
        hosts.write_cluster_file(cluster_file, the_lab, hosts.lab_nodes(the_lab, command))
        up = hosts.start_up(cluster_file, directory / "up.log")
        secret = (the_lab.directory / "secret").read_text().strip()
        state = FailoverLab(the_lab, up, secret, [], [])
        state.order = pipeline(state)
        state.references = run_streams(state)  # undisturbed
        yield state
    finally:
        if up is not None:
            up.stop()
        if cluster_file.exists():
            hosts.cluster("down", "--hosts", str(cluster_file))
        the_lab.close()


def run_streams(lab: FailoverLab, started: threading.Barrier | None = None) -> list[str]:
    """The 6 greedy streams' texts; each waits at `started` once its first token came."""
    texts: list[str | BaseException] = [""] * STREAMS

    def stream(i: int) -> None:
        try:
            client = lab.up.client()
            model = client.models.list().data[0].id
            chunks = client.completions.create(
                model=model,
                prompt=PROMPTS[i],
                max_tokens=STREAM_TOKENS,
                temperature=0,
                stream=True,
                timeout=120,
            )
            for n, chunk in enumerate(chunks):
                texts[i] += chunk.choices[0].text
                if n == 0 and started is not None:
                    started.wait(timeout=60)
        except BaseException as error:  # reported by the caller, with the stream's index
            texts[i] = error

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(STREAMS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=180)
    for i, text in enumerate(texts):
        assert isinstance(text, str), f"stream {i} failed: {text!r}"
    return texts


def cluster_status(lab: FailoverLab) -> dict:
    """`cluster status --json` of the lab's coordinator."""
    return json.loads(
        subprocess.run(
            [sys.executable, "-m", "cluster", "status", "--url", lab.up.url, "--json"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
    )


def pipeline(lab: FailoverLab) -> list[tuple[hostlab.Host, int]]:
    """The lab's hosts in pipeline order (head first), each with its node's port."""
    status = cluster_status(lab)
    order = []
    for node in status["nodes"]:
        host, port = node["address"].rsplit(":", 1)
        order.append((next(h for h in lab.lab.hosts if h.slow_address == host), int(port)))
    return order


def node_infos(lab: FailoverLab) -> list[pb.NodeInfo]:
    """Each node's Info in pipeline order, asked over the slow network (which only the
    partition test cuts)."""
    from cluster.transport.node_client import NodeClient

    async def ask() -> list[pb.NodeInfo]:
        infos = []
        for host, port in lab.order:
            client = NodeClient(f"{host.slow_address}:{port}", lab.secret)
            try:
                infos.append(await client.info(timeout=5))
            finally:
                await client.close()
        return infos

    return asyncio.run(ask())


def hop_host(info: pb.NodeInfo) -> str:
    return info.hop.address.rsplit(":", 1)[0]


def poll(condition, what: str, deadline_s: float) -> float:
    """Seconds until `condition()` held (AssertionError past `deadline_s`)."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > deadline_s:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)
    return time.monotonic() - started


def disrupted_streams(lab: FailoverLab, disrupt) -> tuple[list[str], float | None]:
    """Run the streams; once each has its first token, `disrupt()`, which returns the
    seconds a move took (measured while the streams run)."""
    started = threading.Barrier(STREAMS + 1)
    result: dict[str, object] = {}

    def disrupt_when_started() -> None:
        started.wait(timeout=60)
        try:
            result["moved_s"] = disrupt()
        except BaseException as error:
            result["error"] = error

    disruptor = threading.Thread(target=disrupt_when_started)
    disruptor.start()
    texts = run_streams(lab, started)
    disruptor.join(timeout=60)
    if "error" in result:
        raise result["error"]
    return texts, result.get("moved_s")


@needs_lab
def test_a_middle_host_losing_its_fast_link_keeps_every_stream_exact(failover_lab):
    lab = failover_lab
    (_, _), (middle, _), (tail, _) = lab.order
    before = node_infos(lab)
    assert hop_host(before[0]) == middle.fast_address  # the fast network, measured
    loads = [info.shard_loads for info in before]

    def cut() -> float:
        lab.lab.set_link(middle, "fast0", up=False)
        return poll(
            lambda: hop_host(node_infos(lab)[0]) == middle.slow_address,
            "the hop into the middle host to move to its slow address",
            30.0,
        )

    texts, moved_s = disrupted_streams(lab, cut)
    assert texts == lab.references
    assert moved_s < MOVE_S, f"the hop moved after {moved_s:.1f} s"
    infos = node_infos(lab)
    assert [info.shard_loads for info in infos] == loads  # nothing loaded again
    assert infos[0].hop.degraded and infos[0].hop.failovers >= 1
    assert "no answer" in infos[0].hop.last_failover or "broke" in infos[0].hop.last_failover
    assert hop_host(infos[1]) == tail.slow_address  # the middle host's own hop moved too

    lab.lab.set_link(middle, "fast0", up=True)  # idle now: the hops move back
    poll(
        lambda: (
            [hop_host(i) for i in node_infos(lab)[:2]] == [middle.fast_address, tail.fast_address]
        ),
        "the hops to move back to the fast network",
        60.0,
    )
    assert not node_infos(lab)[0].hop.degraded
    assert run_streams(lab) == lab.references


@needs_lab
def test_the_coordinator_link_to_the_head_fails_over_and_back(failover_lab):
    lab = failover_lab
    head = lab.order[0][0]
    loads = [info.shard_loads for info in node_infos(lab)]
    log = lab.up.log
    moved = "link coordinator -> "
    seen = log.read_text().count(moved)

    def cut() -> float:
        lab.lab.set_link(head, "fast0", up=False)
        return poll(
            lambda: log.read_text().count(moved) > seen,
            "the coordinator's link to the head to move",
            30.0,
        )

    texts, moved_s = disrupted_streams(lab, cut)
    assert texts == lab.references
    assert moved_s < MOVE_S, f"the coordinator's link moved after {moved_s:.1f} s"
    assert [info.shard_loads for info in node_infos(lab)] == loads
    text = log.read_text()
    assert f"moved from {head.fast_address}" in text, text[-5000:]
    # The status shows it: off its best address (the head's fast one), and why it moved.
    steps = cluster_status(lab)["coordinator_links"][0]
    assert steps["role"] == "steps" and steps["address"].startswith(head.slow_address), steps
    assert steps["degraded"] and steps["failovers"] >= 1 and steps["last_failover"], steps

    lab.lab.set_link(head, "fast0", up=True)
    poll(
        lambda: f"moved back to {head.fast_address}" in log.read_text(),
        "the coordinator's link to move back",
        60.0,
    )
    poll(
        lambda: not cluster_status(lab)["coordinator_links"][0]["degraded"],
        "the status to show the coordinator's link back on its best address",
        60.0,
    )
    assert run_streams(lab) == lab.references


@needs_lab
def test_a_node_cut_off_from_the_coordinator_is_replayed_or_named_never_a_hang(failover_lab):
    lab = failover_lab
    middle = lab.order[1][0]
    lab.lab.cut_from_root(middle, cut=True)
    try:
        started = time.monotonic()
        texts: list[str] | None = None
        error: AssertionError | None = None
        try:
            texts = run_streams(lab)
        except AssertionError as failed:  # a stream that failed: it must say which link
            error = failed
        assert time.monotonic() - started < 170  # every stream ended: no hang
        text = lab.up.log.read_text()
        assert "coordinator's link to" in text or "no address of" in text, text[-5000:]
        if error is None:
            assert texts == lab.references  # replayed on the nodes the coordinator reaches
        else:
            assert "link" in str(error) or "unreachable" in str(error), error
    finally:
        lab.lab.cut_from_root(middle, cut=False)
