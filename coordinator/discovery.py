"""The coordinator's view of which nodes exist: static addresses plus mDNS-browsed ones.

Static nodes (`--nodes HOST:PORT,...`) are always listed: mDNS fails over SSH sessions, Wi-Fi
client isolation and some Thunderbolt bridges, and a static list must still work. Browsed
nodes come and go with their DNS-SD records; a node that stops says goodbye and leaves the
view within about a second. A node that dies without a goodbye stays listed until its record
expires (zeroconf floors the PTR lifetime at about 19 minutes): liveness is the RPC layer's
job, with its deadlines, not discovery's.

Discovery hands out plain data (`DiscoveredNode`) and never imports gRPC: whoever dials the
nodes builds its own clients from the addresses.
"""

from __future__ import annotations

import asyncio
import enum
import ipaddress
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType

from zeroconf import InterfaceChoice, IPVersion, ServiceStateChange, Zeroconf
from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf

from cluster.transport.advertise import (
    SERVICE_TYPE,
    TXT_DEVICE,
    TXT_MEMORY,
    TXT_NODE_ID,
    TXT_VERSION,
    Interfaces,
)

log = logging.getLogger(__name__)

_RESOLVE_TIMEOUT_MS = 3000


class DiscoveryError(ValueError):
    """A static address that cannot be used as given."""


class NodeSource(enum.Enum):
    STATIC = "static"
    MDNS = "mdns"


class NodeChange(enum.Enum):
    ADDED = "added"
    UPDATED = "updated"
    REMOVED = "removed"


@dataclass(frozen=True, slots=True)
class DiscoveredNode:
    """One node as the coordinator knows it. Static nodes know only their address until
    someone asks them; browsed ones carry what their TXT record says."""

    node_id: str
    address: str  # host:port to dial
    source: NodeSource
    memory_bytes: int | None = None
    device: str = ""
    version: str = ""
    addresses: tuple[str, ...] = ()  # every host:port the node announced, `address` first


NodeListener = Callable[[NodeChange, DiscoveredNode], None]


def parse_address(text: str) -> str:
    """Validate a `host:port` (IPv6 as `[::1]:port`) and return it normalised."""
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise DiscoveryError(f"expected HOST:PORT, got {text!r}")
    return f"{host}:{int(port)}"


def format_address(host: str, port: int) -> str:
    """host:port, with IPv6 hosts in brackets."""
    try:
        if ipaddress.ip_address(host.split("%")[0]).version == 6:
            return f"[{host}]:{port}"
    except ValueError:
        pass
    return f"{host}:{port}"


class NodeDirectory:
    """Static nodes plus those browsed over zeroconf, with change callbacks.

    Listeners are called on the event loop, synchronously, after the view has changed;
    a listener that raises is logged and does not stop the others.
    """

    def __init__(
        self,
        static_addresses: Sequence[str] = (),
        *,
        browse: bool = True,
        interfaces: Interfaces = InterfaceChoice.All,
        ip_version: IPVersion = IPVersion.V4Only,
        service_type: str = SERVICE_TYPE,
    ) -> None:
        addresses = dict.fromkeys(parse_address(a) for a in static_addresses)
        self._static = [DiscoveredNode(a, a, NodeSource.STATIC) for a in addresses]
        self._browse = browse
        self._interfaces = interfaces
        self._ip_version = ip_version
        self._service_type = service_type
        self._browsed: dict[str, DiscoveredNode] = {}  # by DNS-SD instance name
        self._resolving: dict[str, asyncio.Task[None]] = {}
        self._listeners: list[NodeListener] = []
        self._zeroconf: AsyncZeroconf | None = None
        self._browser: AsyncServiceBrowser | None = None

    def nodes(self) -> list[DiscoveredNode]:
        """Static nodes in the order given (replaced by their browsed record when one
        announces the same address), then the other browsed nodes by id."""
        browsed = sorted(self._browsed.values(), key=lambda n: (n.node_id, n.address))
        by_address = {a: n for n in browsed for a in n.addresses}
        listed, seen = [], set()
        for static in self._static:
            node = by_address.get(static.address, static)
            if node.address not in seen:
                listed.append(node)
                seen.add(node.address)
        listed.extend(n for n in browsed if n.address not in seen)
        return listed

    def add_listener(self, listener: NodeListener) -> Callable[[], None]:
        """Call `listener(change, node)` on every change; returns a function that removes it."""
        self._listeners.append(listener)

        def remove() -> None:
            if listener in self._listeners:
                self._listeners.remove(listener)

        return remove

    async def start(self) -> None:
        if not self._browse or self._zeroconf is not None:
            return
        self._zeroconf = AsyncZeroconf(interfaces=self._interfaces, ip_version=self._ip_version)
        self._browser = AsyncServiceBrowser(
            self._zeroconf.zeroconf, self._service_type, handlers=[self._on_service_state_change]
        )

    async def stop(self) -> None:
        """Stop browsing; browsed nodes are forgotten (without REMOVED calls), static ones stay."""
        browser, zc = self._browser, self._zeroconf
        self._browser = self._zeroconf = None
        for task in self._resolving.values():
            task.cancel()
        await asyncio.gather(*self._resolving.values(), return_exceptions=True)
        self._resolving.clear()
        self._browsed.clear()
        if browser is not None:
            await browser.async_cancel()
        if zc is not None:
            await zc.async_close()

    async def __aenter__(self) -> NodeDirectory:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    def _on_service_state_change(
        self,
        zeroconf: Zeroconf,
        service_type: str,
        name: str,
        state_change: ServiceStateChange,
    ) -> None:
        """zeroconf's browser callback, run on the event loop."""
        if state_change is ServiceStateChange.Removed:
            self._cancel_resolve(name)
            if (node := self._browsed.pop(name, None)) is not None:
                log.info("node %s (%s) left", node.node_id, node.address)
                self._notify(NodeChange.REMOVED, node)
            return
        self._cancel_resolve(name)
        task = asyncio.get_running_loop().create_task(self._resolve(service_type, name))
        self._resolving[name] = task
        task.add_done_callback(lambda done: self._forget_resolve(name, done))

    def _forget_resolve(self, name: str, task: asyncio.Task[None]) -> None:
        if self._resolving.get(name) is task:
            del self._resolving[name]
        if not task.cancelled() and (error := task.exception()) is not None:
            log.error("resolving %s failed", name, exc_info=error)

    def _cancel_resolve(self, name: str) -> None:
        if (task := self._resolving.pop(name, None)) is not None:
            task.cancel()

    async def _resolve(self, service_type: str, name: str) -> None:
        """Fetch the SRV, TXT and address records of `name` and add or update the node."""
        if self._zeroconf is None:
            return
        info = AsyncServiceInfo(service_type, name)
        if not await info.async_request(self._zeroconf.zeroconf, _RESOLVE_TIMEOUT_MS):
            log.warning("could not resolve %s within %d ms", name, _RESOLVE_TIMEOUT_MS)
            return
        node = self._node_from_info(info, name)
        if node is None:
            return
        change = NodeChange.UPDATED if name in self._browsed else NodeChange.ADDED
        if self._browsed.get(name) == node:
            return
        self._browsed[name] = node
        log.info("node %s at %s %s", node.node_id, node.address, change.value)
        self._notify(change, node)

    def _node_from_info(self, info: AsyncServiceInfo, name: str) -> DiscoveredNode | None:
        props = info.decoded_properties
        addresses = tuple(format_address(a, info.port) for a in info.parsed_addresses())
        if not addresses or not info.port:
            log.warning("%s announces no address or port; ignored", name)
            return None
        memory = props.get(TXT_MEMORY)
        if memory is not None and not memory.isdigit():
            log.warning("%s announces memory=%r; ignored", name, memory)
            return None
        return DiscoveredNode(
            node_id=props.get(TXT_NODE_ID) or name.removesuffix("." + info.type),
            address=addresses[0],
            source=NodeSource.MDNS,
            memory_bytes=int(memory) if memory is not None else None,
            device=props.get(TXT_DEVICE) or "",
            version=props.get(TXT_VERSION) or "",
            addresses=addresses,
        )

    def _notify(self, change: NodeChange, node: DiscoveredNode) -> None:
        for listener in list(self._listeners):
            try:
                listener(change, node)
            except Exception:
                log.exception("node listener %r failed on %s %s", listener, change, node)
