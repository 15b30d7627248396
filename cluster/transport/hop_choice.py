"""The hop to the successor: time a round trip to each of its addresses, stream over the
fastest.

The upstream node does this when it loads its shard, with the successor's addresses from
its NodeInfo (the coordinator passes them in LoadShard). Each address is dialled at the
successor's port; one warm-up ping opens the connection, then the median of a few pings
with a step-sized payload is the address's round trip. An address that does not answer, or
where another node than the successor answers, is skipped. With no answering address the
hop keeps the address it was given.
"""

from __future__ import annotations

import ipaddress
import logging
import statistics
import time
from dataclasses import dataclass

import grpc

from cluster.transport.auth import TLSConfig, open_channel, token_metadata
from proto import cluster_pb2 as pb
from proto import cluster_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

PINGS = 5
PING_TIMEOUT_S = 1.0
PAYLOAD_BYTES = 4096  # a decode step's hidden state is a few KB


@dataclass(frozen=True, slots=True)
class HopChoice:
    address: str  # host:port
    kind: str
    interface: str
    rtt_ms: float
    measured: bool
    tried: tuple[tuple[str, float | None], ...] = ()  # (host:port, median ms or None)

    def to_proto(self) -> pb.HopLink:
        return pb.HopLink(
            address=self.address,
            kind=self.kind,
            interface=self.interface,
            rtt_ms=self.rtt_ms,
            measured=self.measured,
            tried=[
                pb.LinkTried(address=address, rtt_ms=rtt or 0.0, answered=rtt is not None)
                for address, rtt in self.tried
            ],
        )


def split_host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


class _Probe:
    """LinkPing to one address over its own channel."""

    def __init__(self, address: str, token: str, tls: TLSConfig | None):
        self.address = address
        self.channel = open_channel(address, tls)
        self.stub = pb_grpc.NodeStub(self.channel)
        self.metadata = token_metadata(token)
        self.times: list[float] = []
        self.failed = False

    async def ping(self, request: pb.LinkPingRequest) -> pb.LinkPingReply | None:
        started = time.perf_counter()
        try:
            reply = await self.stub.LinkPing(
                request, timeout=PING_TIMEOUT_S, metadata=self.metadata
            )
        except (grpc.aio.AioRpcError, OSError) as error:
            log.info("no round trip to %s: %s", self.address, error)
            self.failed = True
            return None
        self.times.append((time.perf_counter() - started) * 1000)
        return reply


async def round_trips_ms(
    addresses: list[str], expected_node_id: str, token: str, tls: TLSConfig | None
) -> list[float | None]:
    """Median LinkPing round trip to each address; None where it fails or another node
    answers. The addresses take turns, so a busy moment on either end weighs on all alike."""
    request = pb.LinkPingRequest(payload=bytes(PAYLOAD_BYTES))
    probes = [_Probe(address, token, tls) for address in addresses]
    try:
        for probe in probes:  # the warm-up: connects, and says who is there
            reply = await probe.ping(request)
            probe.times.clear()
            if reply is not None and expected_node_id and reply.node_id != expected_node_id:
                log.info("%s is %s, not %s", probe.address, reply.node_id, expected_node_id)
                probe.failed = True
        for _ in range(PINGS):
            for probe in probes:
                if not probe.failed:
                    await probe.ping(request)
        return [None if p.failed else statistics.median(p.times) for p in probes]
    finally:
        for probe in probes:
            await probe.channel.close()


async def choose_hop(
    next_node: str,
    links: list[pb.NodeLink],
    expected_node_id: str,
    token: str,
    tls: TLSConfig | None,
) -> HopChoice:
    """The successor's fastest address (host:port), or `next_node` itself when none answers."""
    given_host, port = split_host_port(next_node)
    given_kind = next((link.kind for link in links if link.address == given_host), "")
    given_interface = next((link.interface for link in links if link.address == given_host), "")
    if not links or _is_loopback(given_host):  # nothing to choose from, or the same machine
        kind = given_kind or ("loopback" if _is_loopback(given_host) else "")
        return HopChoice(next_node, kind, given_interface, 0.0, False)
    candidates = [link for link in links if link.kind != "loopback"]
    if given_host not in {link.address for link in candidates}:
        candidates.append(pb.NodeLink(address=given_host, kind="other"))
    addresses = [join_host_port(link.address, port) for link in candidates]
    rtts = await round_trips_ms(addresses, expected_node_id, token, tls)
    tried = tuple(zip(addresses, rtts, strict=True))
    answered = [(rtt, link) for rtt, link in zip(rtts, candidates, strict=True) if rtt is not None]
    best = min(answered, key=lambda pair: pair[0]) if answered else None
    if best is None:
        log.warning("no address of %s answers a LinkPing; keeping %s", expected_node_id, next_node)
        return HopChoice(next_node, given_kind, given_interface, 0.0, False, tried)
    rtt, link = best
    chosen = join_host_port(link.address, port)
    log.info("hop to %s over %s (%s, %.3f ms); tried %s", expected_node_id, chosen, link.kind,
             rtt, tried)  # fmt: skip
    return HopChoice(chosen, link.kind, link.interface, rtt, True, tried)
