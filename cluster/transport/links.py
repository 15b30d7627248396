"""Every address of this machine, with the kind of link under it.

On macOS the kind comes from the system's own list of hardware ports
(`networksetup -listallhardwareports`: "Thunderbolt Bridge" -> bridge0, "Wi-Fi" -> en0, ...);
on Linux from /sys/class/net (loopback, wireless, the thunderbolt-net driver, Ethernet).
Addresses are IPv4 and global IPv6 (link-local IPv6 needs a scope that a host:port cannot
carry).
"""

from __future__ import annotations

import ipaddress
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import ifaddr  # zeroconf's own dependency for listing interfaces

from proto import cluster_pb2 as pb

KINDS = ("thunderbolt", "ethernet", "wifi", "loopback", "other")
ARPHRD_ETHER = "1"
ARPHRD_LOOPBACK = "772"


@dataclass(frozen=True, slots=True)
class Link:
    address: str
    interface: str
    kind: str

    def to_proto(self) -> pb.NodeLink:
        return pb.NodeLink(address=self.address, interface=self.interface, kind=self.kind)


def macos_port_kinds(listing: str) -> dict[str, str]:
    """`networksetup -listallhardwareports` output -> {device: kind}."""
    kinds, port = {}, ""
    for line in listing.splitlines():
        if line.startswith("Hardware Port:"):
            port = line.split(":", 1)[1].strip().lower()
        elif line.startswith("Device:") and port:
            device = line.split(":", 1)[1].strip()
            if "thunderbolt" in port:  # "Thunderbolt Bridge", "Thunderbolt 1", ...
                kinds[device] = "thunderbolt"
            elif "wi-fi" in port or "airport" in port:
                kinds[device] = "wifi"
            elif "ethernet" in port or "lan" in port:
                kinds[device] = "ethernet"
            else:
                kinds[device] = "other"
            port = ""
    return kinds


def linux_interface_kind(name: str, sys_class_net: Path = Path("/sys/class/net")) -> str:
    base = sys_class_net / name
    try:
        kind = (base / "type").read_text().strip()
    except OSError:
        return "other"
    if kind == ARPHRD_LOOPBACK:
        return "loopback"
    if (base / "wireless").exists() or (base / "phy80211").exists():
        return "wifi"
    try:
        driver = (base / "device" / "driver").resolve().name
    except OSError:
        driver = ""
    if driver == "thunderbolt-net" or name.startswith("thunderbolt"):
        return "thunderbolt"
    return "ethernet" if kind == ARPHRD_ETHER else "other"


def _interface_kinds() -> dict[str, str]:
    if sys.platform != "darwin":
        return {}
    try:
        listing = subprocess.run(
            ["networksetup", "-listallhardwareports"], capture_output=True, text=True, timeout=5
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    kinds = macos_port_kinds(listing)
    kinds.setdefault("lo0", "loopback")
    return kinds


def local_links() -> list[Link]:
    """This machine's addresses, loopback last."""
    kinds = _interface_kinds()
    links = []
    for adapter in ifaddr.get_adapters():
        for ip in adapter.ips:
            address = ip.ip if ip.is_IPv4 else ip.ip[0]
            parsed = ipaddress.ip_address(address)
            if parsed.version == 6 and parsed.is_link_local:
                continue
            if parsed.is_loopback:
                kind = "loopback"
            elif sys.platform == "darwin":
                kind = kinds.get(adapter.nice_name, "other")
            else:
                kind = linux_interface_kind(adapter.nice_name)
            links.append(Link(address, adapter.nice_name, kind))
    return sorted(links, key=lambda link: link.kind == "loopback")


def interface_address(name: str) -> str | None:
    """The first IPv4 address of interface `name` here (a cluster file may name one)."""
    for link in local_links():
        if link.interface == name and ":" not in link.address:
            return link.address
    return None
