"""Links that survive their network path: a step stream or a results stream to one node over
the best of its addresses, moved to the next-best when that one breaks or falls silent, and
back when the best answers again and the link is idle.

Both streams are the resumable kind (`cluster.transport.step_link`, `results_link`): the end
that receives counts what it took, so a stream that reconnects over another address resends
exactly what did not arrive; nothing is computed twice or lost, and no request notices more
than the pause.

A link is judged by its own traffic: the receiving end answers every frame and every keepalive
(sent after KEEPALIVE_S without traffic), so an answer due for STALL_S means the path is gone,
whether the connection was reset or an interface went down under it and TCP still retries.
Only when no address of the node answers does the link fail, naming every address it tried.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from cluster.transport.auth import TLSConfig, client_context, open_channel, token_metadata
from cluster.transport.hop_choice import HopChoice, join_host_port, split_host_port
from cluster.transport.results_link import ResultsLink
from cluster.transport.step_link import UNKNOWN_STREAM, StepLinkError, StepSender
from proto import cluster_pb2 as pb
from proto import cluster_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

TICK_S = 0.25  # how often a link looks at its own health
KEEPALIVE_S = 0.5  # a link quiet this long asks for an answer
STALL_S = 1.5  # an answer due this long: the path is gone
OPEN_TIMEOUT_S = 2.0  # to connect and be answered over one address
FAILBACK_IDLE_S = 1.0  # a link with nothing in flight for this long may move back
FAILBACK_EVERY_S = 1.0  # how often a degraded link pings its best address
PING_TIMEOUT_S = 1.0


class LinkLost(StepLinkError):
    """No address of the node answers, or the node lost the stream's state (it restarted)."""


@dataclass(frozen=True, slots=True)
class Route:
    """One address of a node as a link may take it: the host, the node's gRPC port (for
    LinkPing), the kind of link under it, and its measured round trip (None: no answer)."""

    host: str
    port: int
    kind: str = ""
    interface: str = ""
    rtt_ms: float | None = None

    @property
    def address(self) -> str:
        return join_host_port(self.host, self.port)

    def describe(self) -> str:
        how = self.kind or "unknown link"
        if self.interface:
            how += f", {self.interface}"
        return f"{self.host} ({how})"


def routes_of(choice: HopChoice, links: list[pb.NodeLink]) -> tuple[Route, ...]:
    """The addresses `choice` measured, best first (those that answered by round trip, then
    the others); the chosen one alone where nothing was measured."""
    kinds = {link.address: (link.kind, link.interface) for link in links}
    routes = []
    for address, rtt in choice.tried:
        host, port = split_host_port(address)
        kind, interface = kinds.get(host, ("", ""))
        routes.append(Route(host, port, kind, interface, rtt))
    routes.sort(key=lambda route: (route.rtt_ms is None, route.rtt_ms or 0.0))
    if not routes:
        host, port = split_host_port(choice.address)
        routes.append(Route(host, port, choice.kind, choice.interface, choice.rtt_ms))
    return tuple(routes)


@dataclass(slots=True)
class LinkState:
    """Where a link runs now and how it got there, for `cluster status`, the dashboard and
    /metrics. `degraded`: it runs over another address than its best."""

    name: str
    routes: tuple[Route, ...]
    current: Route
    failovers: int = 0
    failbacks: int = 0
    last_reason: str = ""
    moved_at: float = 0.0  # time.time() of the last move; 0: never moved
    failed: str = ""  # why no address answers any more

    @property
    def degraded(self) -> bool:
        return self.current != self.routes[0]

    def as_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "address": self.current.host,
            "kind": self.current.kind,
            "interface": self.current.interface,
            "best": self.routes[0].host,
            "degraded": self.degraded,
            "failovers": self.failovers,
            "failbacks": self.failbacks,
            "last_reason": self.last_reason,
            "failed": self.failed,
        }


def new_stream_id() -> bytes:
    return os.urandom(16)


async def answers(route: Route, node_id: str, token: str, tls: TLSConfig | None) -> bool:
    """Whether the node `node_id` answers a LinkPing at `route` within PING_TIMEOUT_S, over
    a connection of its own: one that a lost path left stuck would say no after it healed."""
    channel = open_channel(route.address, tls, own_connection=True)
    try:
        reply = await pb_grpc.NodeStub(channel).LinkPing(
            pb.LinkPingRequest(), timeout=PING_TIMEOUT_S, metadata=token_metadata(token)
        )
        return not node_id or reply.node_id == node_id
    except (grpc.aio.AioRpcError, OSError):
        return False
    finally:
        await channel.close()


class _FailoverLink:
    """What both kinds of link share: the routes, the state, the watchdog, the moves."""

    def __init__(
        self,
        name: str,
        routes: tuple[Route, ...],
        node_id: str,
        token: str,
        tls: TLSConfig | None,
        port: int,
        on_moved: Callable[[LinkState], None] | None,
    ):
        if not routes:
            raise ValueError(f"no address for the link {name}")
        self.state = LinkState(name, routes, routes[0])
        self._node_id = node_id
        self._token = token
        self._tls = tls
        self._port = port  # the node's step port, on every address
        self._on_moved = on_moved
        self._lock = asyncio.Lock()
        self._watch: asyncio.Task | None = None
        self._failback_tried = 0.0
        self.failure: LinkLost | None = None
        self.lost = asyncio.get_running_loop().create_future()  # set once no address answers

    async def _open_over_best(self, failure: str) -> None:
        """Connect over the first of the routes that answers and start watching; StepLinkError
        (`failure`, then why each address failed) if none does."""
        errors: list[str] = []
        for route in self.state.routes:
            try:
                await self._connect(route)
            except (StepLinkError, OSError) as error:
                errors.append(f"{route.describe()}: {error}")
                continue
            self.state.current = route
            self._watch = asyncio.create_task(self._watch_loop())
            return
        raise StepLinkError(f"{failure}: " + "; ".join(errors))

    async def _watch_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while self.failure is None:
            await asyncio.sleep(TICK_S)
            try:
                await self._tick(loop.time())
            except LinkLost:
                return
            except Exception:  # a watchdog that dies would leave a dead link unnoticed
                log.exception("watching the link %s", self.state.name)

    async def _tick(self, now: float) -> None:
        raise NotImplementedError

    async def _connect(self, route: Route) -> None:
        """Open the stream over `route` and catch it up; StepLinkError or OSError if not."""
        raise NotImplementedError

    def _drop_current(self) -> None:
        raise NotImplementedError

    def _idle(self, now: float) -> bool:
        raise NotImplementedError

    async def _move(self, reason: str, *, back: bool = False) -> None:
        """With the lock held: reconnect over the next-best address (`back`: over the best,
        and only it), raising LinkLost when none answers."""
        current = self.state.current
        self._drop_current()
        if back:
            candidates = [self.state.routes[0]]
        else:  # the next-best first; the address that failed only as the last resort
            candidates = [r for r in self.state.routes if r != current] + [current]
        errors = []
        for route in candidates:
            try:
                await self._connect(route)
            except LinkLost as error:
                self._lose(str(error))
            except (StepLinkError, OSError) as error:
                errors.append(f"{route.describe()}: {error}")
                self._drop_current()
                continue
            self._moved(route, reason, back)
            return
        if back:  # the best did not take it after all: stay where the link was
            await self._connect_or_lose(current, errors)
            return
        self._lose(f"no address of {self.state.name} answers ({reason}): " + "; ".join(errors))

    async def _connect_or_lose(self, route: Route, errors: list[str]) -> None:
        try:
            await self._connect(route)
        except (StepLinkError, OSError) as error:
            errors.append(f"{route.describe()}: {error}")
            self._lose(f"no address of {self.state.name} answers: " + "; ".join(errors))

    def _moved(self, route: Route, reason: str, back: bool) -> None:
        state = self.state
        if route == state.current and not back:
            log.info("link %s reconnected over %s (%s)", state.name, route.describe(), reason)
            return
        previous, state.current = state.current, route
        state.moved_at = time.time()
        if back:
            state.failbacks += 1
            # As visible as the failover it ends: an operator reading one reads the other.
            log.warning("link %s moved back to %s", state.name, route.describe())
        else:
            state.failovers += 1
            state.last_reason = reason
            log.warning(
                "link %s moved from %s to %s: %s",
                state.name,
                previous.describe(),
                route.describe(),
                reason,
            )
        if self._on_moved is not None:
            self._on_moved(state)

    def _lose(self, why: str) -> None:
        self.state.failed = why
        self.failure = LinkLost(why)
        if not self.lost.done():
            self.lost.set_result(why)
        raise self.failure

    async def _maybe_fail_back(self, now: float) -> None:
        """A degraded, idle link moves back to its best address once that answers a ping."""
        if not self.state.degraded or not self._idle(now):
            return
        if now - self._failback_tried < FAILBACK_EVERY_S:
            return
        self._failback_tried = now
        best = self.state.routes[0]
        if not await answers(best, self._node_id, self._token, self._tls):
            return
        async with self._lock:
            if self.failure is None and self.state.degraded and self._idle(now):
                await self._move(f"{best.describe()} answers again", back=True)

    async def _stop_watch(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch


class StepStreamLink(_FailoverLink):
    """The step stream to a node (a successor, or the driver's head) that fails over among
    the node's addresses: `send` as `StepSender.send`, raising LinkLost only when no address
    answers. Each frame is kept until the node says it took it."""

    def __init__(
        self,
        name: str,
        routes: tuple[Route, ...],
        node_id: str,
        token: str,
        tls: TLSConfig | None,
        port: int,
        on_moved: Callable[[LinkState], None] | None = None,
    ):
        super().__init__(name, routes, node_id, token, tls, port, on_moved)
        self._stream_id = new_stream_id()
        self._sender: StepSender | None = None
        self._kept: deque[tuple[int, bytes, bool]] = deque()  # (frame number, payload, records)
        self._numbered = 0
        self._last_send = 0.0  # the last step frame
        self._last_keepalive = 0.0
        self._stall_reason = ""
        self._opened = False  # connected once: the node knows the stream id since

    @classmethod
    async def open(
        cls,
        name: str,
        routes: tuple[Route, ...],
        node_id: str,
        token: str,
        tls: TLSConfig | None,
        port: int,
        on_moved: Callable[[LinkState], None] | None = None,
    ) -> StepStreamLink:
        """Open over the best address that answers (StepLinkError if none does)."""
        link = cls(name, routes, node_id, token, tls, port, on_moved)
        await link._open_over_best(f"no step stream to {name}")
        return link

    @property
    def address(self) -> str:
        return join_host_port(self.state.current.host, self._port)

    @property
    def broken(self) -> bool:
        return self.failure is not None

    async def ended(self) -> None:
        """Wait until no address of the node answers."""
        await asyncio.wait([self.lost])

    async def send(self, payload: bytes, records: bool = False) -> None:
        async with self._lock:
            if self.failure is not None:
                raise self.failure
            self._numbered += 1
            self._kept.append((self._numbered, payload, records))
            self._last_send = asyncio.get_running_loop().time()
            sender = self._sender
            if sender is None or sender.broken:
                await self._move(self._stall_reason or f"the stream over {self._where()} closed")
                return
            try:
                await sender.send(payload, records)
            except (StepLinkError, OSError) as error:
                reason = self._stall_reason or f"the stream over {self._where()} broke: {error}"
                await self._move(reason)
            self._trim()

    def _where(self) -> str:
        return self.state.current.describe()

    def _trim(self) -> None:
        if self._sender is not None:
            while self._kept and self._kept[0][0] <= self._sender.acked:
                self._kept.popleft()

    async def _connect(self, route: Route) -> None:
        sender = await StepSender.open(
            route.host,
            self._port,
            self._token,
            OPEN_TIMEOUT_S,
            self._stream_id,
            tls_context=client_context(self._tls),
        )
        self._sender = sender
        self._stall_reason = ""
        if sender.resumed_at == UNKNOWN_STREAM:
            if self._opened:  # what it took is unknown: resending could compute a step twice
                sender.abort()
                raise LinkLost(f"{self.state.name} lost the step stream (the node restarted?)")
            self._opened = True
        else:
            while self._kept and self._kept[0][0] <= sender.resumed_at:
                self._kept.popleft()
        for _, payload, records in list(self._kept):  # what the node did not take
            await sender.send(payload, records)

    def _drop_current(self) -> None:
        if self._sender is not None:
            self._sender.abort()
            self._sender = None

    def _idle(self, now: float) -> bool:
        self._trim()
        return not self._kept and now - self._last_send > FAILBACK_IDLE_S

    async def _tick(self, now: float) -> None:
        self._trim()
        sender = self._sender
        if sender is not None and not sender.broken:
            if sender.waiting_since is not None and now - sender.waiting_since > STALL_S:
                self._stall_reason = f"no answer over {self._where()} for {STALL_S:.1f} s"
                sender.abort()  # a send waiting on the dead path fails, and moves the link
            elif (
                sender.waiting_since is None
                and now - max(self._last_send, self._last_keepalive) > KEEPALIVE_S
            ):
                sender.keepalive()
                self._last_keepalive = now
        if self._lock.locked():
            return
        if self._sender is None or self._sender.broken:
            async with self._lock:
                if self.failure is None and (self._sender is None or self._sender.broken):
                    reason = self._stall_reason or f"the stream over {self._where()} closed"
                    await self._move(reason)
            return
        await self._maybe_fail_back(now)

    async def close(self) -> None:
        await self._stop_watch()
        self._drop_current()


class ResultsStreamLink(_FailoverLink):
    """A driver's results stream from a node that fails over among the node's addresses: each
    batch to `on_batch`; `on_lost` is told once, why, when no address answers any more."""

    def __init__(
        self,
        name: str,
        routes: tuple[Route, ...],
        node_id: str,
        token: str,
        tls: TLSConfig | None,
        port: int,
        on_batch: Callable[[pb.ResultBatch], None],
        on_lost: Callable[[str], None],
        on_moved: Callable[[LinkState], None] | None = None,
    ):
        super().__init__(name, routes, node_id, token, tls, port, on_moved)
        self._on_batch = on_batch
        self._on_lost = on_lost
        self._stream_id = new_stream_id()
        self._link: ResultsLink | None = None
        self._received = 0
        self._last_ack = 0.0
        self._last_batch = 0.0
        self._closed_reason = ""
        self._closing = False

    @classmethod
    async def open(
        cls,
        name: str,
        routes: tuple[Route, ...],
        node_id: str,
        token: str,
        tls: TLSConfig | None,
        port: int,
        on_batch: Callable[[pb.ResultBatch], None],
        on_lost: Callable[[str], None],
        on_moved: Callable[[LinkState], None] | None = None,
    ) -> ResultsStreamLink:
        """Subscribe over the best address that answers (StepLinkError if none does)."""
        link = cls(name, routes, node_id, token, tls, port, on_batch, on_lost, on_moved)
        await link._open_over_best(f"no results stream from {name}")
        return link

    def _batch(self, batch: pb.ResultBatch) -> None:
        self._last_batch = asyncio.get_running_loop().time()
        self._on_batch(batch)

    def _closed(self, why: str) -> None:
        self._closed_reason = why  # the watchdog moves the link at its next look

    async def _connect(self, route: Route) -> None:
        self._link = await ResultsLink.open(
            route.host,
            self._port,
            self._token,
            self._batch,
            self._closed,
            OPEN_TIMEOUT_S,
            stream_id=self._stream_id,
            received=self._received,
            tls_context=client_context(self._tls),
        )
        self._closed_reason = ""

    def _drop_current(self) -> None:
        if self._link is not None:
            self._received = self._link.received
            self._link.close()
            self._link = None

    def _idle(self, now: float) -> bool:
        return now - self._last_batch > FAILBACK_IDLE_S

    async def _tick(self, now: float) -> None:
        link = self._link
        reason = ""
        if link is None:
            reason = f"the results stream over {self.state.current.describe()} closed"
        elif self._closed_reason:
            reason = f"the results stream over {self.state.current.describe()}: "
            reason += self._closed_reason
        elif now - link.heard_at > STALL_S:
            reason = f"no answer over {self.state.current.describe()} for {STALL_S:.1f} s"
        if reason:
            async with self._lock:
                try:
                    await self._move(reason)
                except LinkLost as error:
                    if not self._closing:
                        self._on_lost(str(error))
                    raise
            return
        if now - self._last_ack >= KEEPALIVE_S:
            link.send_ack()
            self._last_ack = now
        await self._maybe_fail_back(now)

    async def close(self) -> None:
        self._closing = True
        await self._stop_watch()
        self._drop_current()
