"""Link failover: a hop's stream moves to the successor's next-best address when its path
fails, resending exactly what did not arrive, and back when the best answers again.

The first tests run on loopback anywhere: a relay the test controls stands for the fast
path (127.0.0.2), the direct address (127.0.0.1) for the slow one. The lab tests (below) run
whole clusters across network namespaces (tests/hostlab.py) and skip where it cannot run.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest

from benchmarks.link_failover import FAST, SLOW, Relay
from cluster.transport import failover
from cluster.transport.auth import TokenInterceptor
from cluster.transport.failover import ResultsStreamLink, Route, StepStreamLink
from cluster.transport.step_link import StepListener, StepSender
from cluster.transport.wire import results_to_proto
from node.stage import Subscribers
from proto import cluster_pb2 as pb
from proto import cluster_pb2_grpc as pb_grpc
from tests import hostlab

TOKEN = "failover-test-token"
NODE_ID = "successor"
DEADLINE_S = 30.0


class Pinged(pb_grpc.NodeServicer):
    async def LinkPing(self, request, context):
        return pb.LinkPingReply(node_id=NODE_ID, payload=request.payload)


async def ping_server(host: str, port: int = 0) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server(interceptors=[TokenInterceptor(TOKEN)])
    pb_grpc.add_NodeServicer_to_server(Pinged(), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    return server, bound


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


def test_step_stream_moves_to_the_next_address_and_back_without_losing_a_step(quick_failback):
    async def main():
        received: list[int] = []
        listener = StepListener(TOKEN, lambda message: received.append(message.sequence))
        port = await listener.start(SLOW)
        relay = Relay(port)
        await relay.start()
        pings, grpc_port = await ping_server(FAST)
        routes = (Route(FAST, grpc_port, "thunderbolt"), Route(SLOW, grpc_port, "wifi"))
        link = await StepStreamLink.open("next node", routes, NODE_ID, TOKEN, None, port)
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
            pings, _ = await ping_server(FAST, grpc_port)
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


# -- the hosts lab: whole clusters over two networks ------------------------------------------

LAB_MISSING = hostlab.available()
needs_lab = pytest.mark.skipif(LAB_MISSING is not None, reason=LAB_MISSING or "")
STREAMS = 6
STREAM_TOKENS = 200
PROMPTS = [f"Story {i}: once upon a time" for i in range(STREAMS)]
MOVE_S = 3.0  # the bound on a hop's move to the slow address


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


def pipeline(lab: FailoverLab) -> list[tuple[hostlab.Host, int]]:
    """The lab's hosts in pipeline order (head first), each with its node's port."""
    status = json.loads(
        subprocess.run(
            [sys.executable, "-m", "cluster", "status", "--url", lab.up.url, "--json"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
    )
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

    lab.lab.set_link(head, "fast0", up=True)
    poll(
        lambda: f"moved back to {head.fast_address}" in log.read_text(),
        "the coordinator's link to move back",
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
