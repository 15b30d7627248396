"""A node announces itself on the local network over mDNS / DNS-SD (zeroconf).

The coordinator browses `_qwencluster._tcp.local.` (coordinator/discovery.py) and learns each
node's gRPC host:port and what it offers from the TXT record. mDNS is a convenience: it fails
over SSH-only setups, Wi-Fi client isolation and some Thunderbolt bridges, so a static host
list always works as well. This module defines the record; the browser reads it back.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from importlib import metadata
from types import TracebackType

import ifaddr  # zeroconf's own dependency for listing interfaces
from zeroconf import InterfaceChoice, IPVersion, NonUniqueNameException
from zeroconf.asyncio import AsyncServiceInfo, AsyncZeroconf

SERVICE_TYPE = "_qwencluster._tcp.local."
TXT_NODE_ID, TXT_MEMORY, TXT_DEVICE, TXT_VERSION, TXT_PORT = (
    "node_id",
    "memory",
    "device",
    "version",
    "port",
)
_MAX_LABEL_BYTES = 63  # DNS label limit, for the instance name

Interfaces = Sequence[str | int] | InterfaceChoice

log = logging.getLogger(__name__)


class AdvertiseError(RuntimeError):
    """The node could not be announced (name taken by another node, bad id...)."""


@dataclass(frozen=True, slots=True)
class NodeRecord:
    """What a node announces: the TXT record's fields, plus where to dial it."""

    node_id: str
    port: int
    memory_bytes: int  # free memory the node offers for weights and caches
    device: str = ""
    version: str = ""

    def __post_init__(self) -> None:
        if not self.node_id or len(self.node_id.encode()) > _MAX_LABEL_BYTES:
            raise AdvertiseError(f"node_id must be 1-{_MAX_LABEL_BYTES} bytes: {self.node_id!r}")
        if "." in self.node_id:
            raise AdvertiseError(f"node_id must not contain '.': {self.node_id!r}")
        if not 0 < self.port < 65536:
            raise AdvertiseError(f"port must be in 1..65535, got {self.port}")
        if self.memory_bytes < 0:
            raise AdvertiseError(f"memory_bytes must be >= 0, got {self.memory_bytes}")

    def properties(self) -> dict[str, str]:
        return {
            TXT_NODE_ID: self.node_id,
            TXT_MEMORY: str(self.memory_bytes),
            TXT_DEVICE: self.device,
            TXT_VERSION: self.version,
            TXT_PORT: str(self.port),
        }


def instance_name(node_id: str, service_type: str = SERVICE_TYPE) -> str:
    """The DNS-SD instance name of a node: its id under the service type."""
    return f"{node_id}.{service_type}"


def package_version() -> str:
    """The installed project's version, announced so the coordinator can refuse a mismatch."""
    try:
        return metadata.version("qwen-cluster")
    except metadata.PackageNotFoundError:
        return "0+unknown"


class NodeAdvertiser:
    """Registers one node's service record while started; says goodbye on stop.

    `interfaces` and `ip_version` go to zeroconf (tests pass ["127.0.0.1"]); `addresses` are
    the IPs put in the record, by default those of `interfaces` when they are IPs, else every
    non-loopback IPv4 address of the machine (127.0.0.1 when it has none). The record is of
    `service_type`, the type coordinators browse.
    """

    service_type = SERVICE_TYPE

    def __init__(
        self,
        node_id: str,
        port: int,
        *,
        memory_bytes: int,
        device: str = "",
        version: str | None = None,
        addresses: Sequence[str] | None = None,
        interfaces: Interfaces = InterfaceChoice.All,
        ip_version: IPVersion = IPVersion.V4Only,
    ) -> None:
        self.record = NodeRecord(
            node_id, port, memory_bytes, device, package_version() if version is None else version
        )
        self._interfaces = interfaces
        self._ip_version = ip_version
        self._addresses = list(addresses or _default_addresses(interfaces, ip_version))
        self._zeroconf: AsyncZeroconf | None = None
        self._info: AsyncServiceInfo | None = None

    @property
    def service_name(self) -> str:
        return instance_name(self.record.node_id, self.service_type)

    @property
    def addresses(self) -> list[str]:
        return list(self._addresses)

    async def start(self) -> None:
        """Announce the node; raises AdvertiseError if another node has its id."""
        if self._zeroconf is not None:
            return
        zc = AsyncZeroconf(interfaces=self._interfaces, ip_version=self._ip_version)
        info = self._service_info()
        try:
            await (await zc.async_register_service(info))
        except NonUniqueNameException as e:
            await zc.async_close()
            raise AdvertiseError(
                f"another node already announces {self.service_name}: node ids must be unique"
            ) from e
        except BaseException:
            await zc.async_close()
            raise
        self._zeroconf, self._info = zc, info
        log.info(
            "announcing %s at %s port %d", self.service_name, self._addresses, self.record.port
        )

    async def update(self, *, memory_bytes: int) -> None:
        """Re-announce with a new free-memory figure (after loading or freeing a model)."""
        self.record = replace(self.record, memory_bytes=memory_bytes)
        if self._zeroconf is None:
            return
        self._info = self._service_info()
        await (await self._zeroconf.async_update_service(self._info))

    async def stop(self) -> None:
        """Say goodbye (browsers drop the node within about a second) and close.

        Closing the zeroconf instance unregisters, and waits for the goodbye packets; the
        node then leaves every coordinator's view without waiting for a record to expire.
        """
        zc = self._zeroconf
        self._zeroconf = self._info = None
        if zc is not None:
            await zc.async_close()

    async def __aenter__(self) -> NodeAdvertiser:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    def _service_info(self) -> AsyncServiceInfo:
        return AsyncServiceInfo(
            self.service_type,
            self.service_name,
            port=self.record.port,
            properties=self.record.properties(),
            server=f"qwencluster-{self.record.node_id}.local.",
            parsed_addresses=self._addresses,
        )


def _default_addresses(interfaces: Interfaces, ip_version: IPVersion) -> list[str]:
    """The IPs to announce: those named in `interfaces`, else the machine's own."""
    want_v6 = ip_version != IPVersion.V4Only
    want_v4 = ip_version != IPVersion.V6Only
    if not isinstance(interfaces, InterfaceChoice):
        named = [i for i in interfaces if isinstance(i, str)]
        return [a for a in named if _family_ok(a, want_v4, want_v6)]
    found = []
    for adapter in ifaddr.get_adapters():
        for ip in adapter.ips:
            if ip.is_IPv4 and want_v4 and not ipaddress.ip_address(ip.ip).is_loopback:
                found.append(ip.ip)
    return found or ["127.0.0.1"]


def _family_ok(address: str, want_v4: bool, want_v6: bool) -> bool:
    try:
        version = ipaddress.ip_address(address).version
    except ValueError:
        return False
    return want_v4 if version == 4 else want_v6
