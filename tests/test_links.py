"""A node's links and their kinds (macOS's hardware port list, Linux's /sys/class/net), and
what a hop reports of measuring its successor's."""

from __future__ import annotations

import ipaddress
from pathlib import Path

from cluster.transport.hop_choice import HopChoice
from cluster.transport.links import linux_interface_kind, local_links, macos_port_kinds
from coordinator.service import hop_status

NETWORKSETUP = """
Hardware Port: Ethernet
Device: en0
Ethernet Address: aa:bb:cc:dd:ee:01

Hardware Port: Wi-Fi
Device: en1
Ethernet Address: aa:bb:cc:dd:ee:02

Hardware Port: Thunderbolt Bridge
Device: bridge0
Ethernet Address: N/A

Hardware Port: Thunderbolt 1
Device: en2
Ethernet Address: aa:bb:cc:dd:ee:03

Hardware Port: iPhone USB
Device: en5
Ethernet Address: aa:bb:cc:dd:ee:04

VLAN Configurations
===================
"""


def test_macos_hardware_ports_give_the_kinds():
    assert macos_port_kinds(NETWORKSETUP) == {
        "en0": "ethernet",
        "en1": "wifi",
        "bridge0": "thunderbolt",
        "en2": "thunderbolt",
        "en5": "other",
    }


def test_linux_sysfs_gives_the_kinds(tmp_path: Path):
    def interface(name: str, kind: str, *extra: str) -> None:
        (tmp_path / name).mkdir()
        (tmp_path / name / "type").write_text(kind + "\n")
        for sub in extra:
            (tmp_path / name / sub).mkdir()

    interface("lo", "772")
    interface("wlan0", "1", "wireless")
    interface("eth0", "1")
    interface("tun0", "65534")
    driver = tmp_path / "drivers" / "thunderbolt-net"
    driver.mkdir(parents=True)
    interface("thunderbolt0", "1", "device")
    (tmp_path / "thunderbolt0" / "device" / "driver").symlink_to(driver)
    kinds = {n: linux_interface_kind(n, tmp_path) for n in ("lo", "wlan0", "eth0", "tun0")}
    assert kinds == {"lo": "loopback", "wlan0": "wifi", "eth0": "ethernet", "tun0": "other"}
    assert linux_interface_kind("thunderbolt0", tmp_path) == "thunderbolt"
    assert linux_interface_kind("gone", tmp_path) == "other"


def test_this_machine_reports_its_loopback_last():
    links = local_links()
    assert links and links[-1].kind == "loopback" and links[-1].address in ("127.0.0.1", "::1")
    for link in links:
        assert (link.kind == "loopback") == ipaddress.ip_address(link.address).is_loopback


def test_a_hops_measured_addresses_reach_the_status_as_measured() -> None:
    """Every address a hop measured comes to the coordinator's status with its round trip, and
    one that did not answer as None (not as a 0 ms round trip)."""
    tried = (("10.0.2.2:5000", 0.41), ("10.0.1.2:5000", 4.6), ("[fe80::1]:5000", None))
    choice = HopChoice("10.0.2.2:5000", "ethernet", "eth1", 0.41, True, tried)
    status = hop_status(choice.to_proto())
    assert (status.address, status.kind, status.rtt_ms, status.measured) == (
        "10.0.2.2:5000", "ethernet", 0.41, True,
    )  # fmt: skip
    assert status.tried == tried
