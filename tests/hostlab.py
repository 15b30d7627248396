"""Pretend Macs for `cluster up --hosts` tests: Linux network namespaces, each with its own sshd.

Each host is a namespace joined to two networks: "slow" (which the root namespace, where the
test runs `cluster up`, is on too; ssh and the coordinator's traffic use it) and "fast" (only
between the hosts). The slow network is a userspace hub that holds every frame `delay_s`
before passing it on (this kernel has no netem qdisc): three tap devices, one per host plus
the root's, read and written by a thread of the test. The fast one is a kernel bridge.
Everything is made with a random tag and removed by `close()`: namespaces, links, daemons.

`sudo python -m tests.hostlab DIR` starts a lab for trying `cluster up|bench --hosts` by hand:
it writes DIR/cluster.toml (the bundled model, one node per host) and runs until Ctrl-C or
SIGTERM, which take the nodes down (`cluster down --hosts`) and the lab away.
"""

from __future__ import annotations

import contextlib
import fcntl
import heapq
import os
import random
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

SSHD = "/usr/sbin/sshd"
TUNSETIFF = 0x400454CA
IFF_TAP = 0x0002
IFF_NO_PI = 0x1000


def available() -> str | None:
    """Why the lab cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    if not Path(SSHD).exists() or shutil.which("ssh") is None:
        return "needs openssh-server and ssh (apt-get install openssh-server)"
    if shutil.which("ip") is None or not Path("/dev/net/tun").exists():
        return "needs iproute2 and /dev/net/tun"
    return None


def _ip(*args: str, ns: str | None = None) -> None:
    argv = ["ip", *(["-n", ns] if ns else []), *args]
    subprocess.run(argv, check=True, capture_output=True)


class DelayHub:
    """A hub over tap devices: every frame read from one is written to all others after
    `delay_s` (a slow link that the kernel cannot make here)."""

    def __init__(self, names: list[str], delay_s: float):
        self.delay_s = delay_s
        self.fds = {}
        for name in names:
            fd = os.open("/dev/net/tun", os.O_RDWR)
            fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TAP | IFF_NO_PI))
            self.fds[fd] = name
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.frames = 0

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        queue: list[tuple[float, int, int, bytes]] = []  # (due, seq, from fd, frame)
        seq = 0
        fds = list(self.fds)
        while not self._stop.is_set():
            timeout = max(0.0, queue[0][0] - time.monotonic()) if queue else 0.1
            readable, _, _ = select.select(fds, [], [], timeout)
            now = time.monotonic()
            for fd in readable:
                with contextlib.suppress(OSError):
                    frame = os.read(fd, 65536)
                    heapq.heappush(queue, (now + self.delay_s, seq, fd, frame))
                    seq += 1
            while queue and queue[0][0] <= time.monotonic():
                _, _, source, frame = heapq.heappop(queue)
                self.frames += 1
                for fd in fds:
                    if fd != source:
                        with contextlib.suppress(OSError):
                            os.write(fd, frame)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2)
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)


@dataclass
class Host:
    name: str  # the ssh alias in the lab's ssh config
    namespace: str
    slow_address: str
    fast_address: str
    sshd: subprocess.Popen | None = None


@dataclass
class HostLab:
    directory: Path
    count: int = 3
    delay_s: float = 0.002
    tag: str = field(default_factory=lambda: f"{random.randrange(16**4):04x}")
    hosts: list[Host] = field(default_factory=list)
    hub: DelayHub | None = None
    root_slow_address: str = ""
    # With `root_on_fast`, the root namespace (the coordinator's) joins the fast network too,
    # at `root_fast_address`: its own links to the hosts then have two paths, as a Mac's do.
    root_on_fast: bool = False
    root_fast_address: str = ""
    _links: list[str] = field(default_factory=list)

    @property
    def ssh_config(self) -> Path:
        return self.directory / "ssh_config"

    @property
    def key(self) -> Path:
        return self.directory / "id_ed25519"

    def start(self) -> HostLab:
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def _start(self) -> None:
        t = self.tag
        octet = random.randrange(16, 250)
        slow, fast = f"10.{octet}.1", f"10.{octet}.2"
        self.root_slow_address = f"{slow}.254"
        self.directory.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.key)], check=True
        )
        host_key = self.directory / "host_key"
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(host_key)], check=True
        )
        shutil.copy(self.directory / "id_ed25519.pub", self.directory / "authorized_keys")
        Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation directory

        taps = [f"ql{t}s{i}" for i in range(self.count)] + [f"ql{t}sr"]
        self.hub = DelayHub(taps, self.delay_s)
        self._links.append(f"ql{t}sr")
        _ip("addr", "add", f"{self.root_slow_address}/24", "dev", f"ql{t}sr")
        _ip("link", "set", f"ql{t}sr", "up")
        bridge = f"ql{t}F"
        _ip("link", "add", bridge, "type", "bridge")
        self._links.append(bridge)
        _ip("link", "set", bridge, "up")
        if self.root_on_fast:
            self.root_fast_address = f"{fast}.254"
            _ip("link", "add", f"ql{t}fr", "type", "veth", "peer", "name", f"ql{t}fb")
            self._links.append(f"ql{t}fr")
            _ip("link", "set", f"ql{t}fb", "master", bridge)
            _ip("link", "set", f"ql{t}fb", "up")
            _ip("addr", "add", f"{self.root_fast_address}/24", "dev", f"ql{t}fr")
            _ip("link", "set", f"ql{t}fr", "up")
        config_lines = []
        for i in range(self.count):
            ns = f"ql{t}n{i}"
            _ip("netns", "add", ns)
            host = Host(f"lab{t}-{i}", ns, f"{slow}.{i + 1}", f"{fast}.{i + 1}")
            self.hosts.append(host)
            _ip("link", "set", f"ql{t}s{i}", "netns", ns)
            _ip("link", "set", f"ql{t}s{i}", "name", "slow0", ns=ns)
            _ip("link", "add", f"ql{t}f{i}", "type", "veth", "peer", "name", "fast0", "netns", ns)
            self._links.append(f"ql{t}f{i}")
            _ip("link", "set", f"ql{t}f{i}", "master", bridge)
            _ip("link", "set", f"ql{t}f{i}", "up")
            _ip("addr", "add", f"{host.slow_address}/24", "dev", "slow0", ns=ns)
            _ip("addr", "add", f"{host.fast_address}/24", "dev", "fast0", ns=ns)
            for dev in ("lo", "slow0", "fast0"):
                _ip("link", "set", dev, "up", ns=ns)
            config = self.directory / f"sshd_{i}.conf"
            config.write_text(
                f"ListenAddress {host.slow_address}\nHostKey {host_key}\n"
                f"AuthorizedKeysFile {self.directory}/authorized_keys\nStrictModes no\n"
                "PermitRootLogin prohibit-password\nPasswordAuthentication no\nUsePAM no\n"
                f"PidFile {self.directory}/sshd_{i}.pid\nAcceptEnv NONE\n"
            )
            host.sshd = subprocess.Popen(
                ["ip", "netns", "exec", ns, SSHD, "-D", "-e", "-f", str(config)],
                stdout=subprocess.DEVNULL,
                stderr=(self.directory / f"sshd_{i}.log").open("w"),
            )
            # The alias and the bare address alike (`ssh root@ADDRESS`, as cluster files write).
            config_lines.append(
                f"Host {host.name} {host.slow_address}\n  HostName {host.slow_address}\n"
                "  User root\n"
                f"  IdentityFile {self.key}\n  IdentitiesOnly yes\n"
                "  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n"
            )
        # A host that refuses ssh at once (nothing listens on its port 2).
        config_lines.append(
            f"Host lab{t}-refusing\n  HostName {self.hosts[0].slow_address}\n  Port 2\n"
            f"  User root\n  IdentityFile {self.key}\n  StrictHostKeyChecking no\n"
            "  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n"
        )
        self.ssh_config.write_text("".join(config_lines))
        self.hub.start()
        for host in self.hosts:
            self.wait_for_ssh(host)

    def ssh(self, host: Host, command: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["ssh", "-F", str(self.ssh_config), "-o", "BatchMode=yes", host.name, command],
            capture_output=True,
            text=True,
            timeout=30,
        )

    def wait_for_ssh(self, host: Host, deadline_s: float = 20.0) -> None:
        deadline = time.monotonic() + deadline_s
        while (done := self.ssh(host, "true")).returncode != 0:
            if time.monotonic() > deadline:
                log = (self.directory / f"sshd_{self.hosts.index(host)}.log").read_text()
                raise AssertionError(f"sshd in {host.namespace} not answering: {done.stderr}{log}")
            time.sleep(0.1)

    def cluster_command(self) -> Path:
        """A `cluster` for the hosts: this checkout, whichever directory it is in."""
        script = self.directory / "cluster"
        repo = Path(__file__).resolve().parent.parent
        script.write_text(
            f'#!/bin/sh\nexport PYTHONPATH={repo}\nexec {sys.executable} -m cluster "$@"\n'
        )
        script.chmod(0o755)
        return script

    def set_link(self, host: Host, device: str, up: bool) -> None:
        """Take one of a host's interfaces ("fast0", "slow0") down or up again."""
        _ip("link", "set", device, "up" if up else "down", ns=host.namespace)

    def cut_from_root(self, host: Host, cut: bool) -> None:
        """Drop (or again pass) every packet from `host` to the root namespace on either
        network, while the hosts still reach each other: a partition of the coordinator."""
        for address in filter(None, (self.root_slow_address, self.root_fast_address)):
            action = "add" if cut else "del"
            _ip("route", action, "blackhole", f"{address}/32", ns=host.namespace)

    def close(self) -> None:
        for host in self.hosts:
            if host.sshd is not None and host.sshd.poll() is None:
                host.sshd.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    host.sshd.wait(timeout=5)
            # Whatever still runs in the namespace (a node a failed test left) goes too.
            pids = subprocess.run(
                ["ip", "netns", "pids", host.namespace], capture_output=True, text=True
            ).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), 9)
            subprocess.run(["ip", "netns", "del", host.namespace], capture_output=True)
        for link in self._links:
            subprocess.run(["ip", "link", "del", link], capture_output=True)
        if self.hub is not None:
            self.hub.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_cluster_file(lab: HostLab, path: Path) -> Path:
    """A cluster file for every host of the lab: the bundled model, supervised processes."""
    from cluster.config import bundled_model_path

    command = lab.cluster_command()
    lines = [
        f'model = "{bundled_model_path()}"',
        f"port = {_free_port()}",
        f'ssh_config = "{lab.ssh_config}"',
        f'secret_file = "{lab.directory / "secret"}"',
    ]
    for i, host in enumerate(lab.hosts):
        lines += [
            "[[node]]",
            f'ssh = "{host.name}"',
            f'name = "mac{i}"',
            f'cluster = "{command}"',
            'service = "process"',
            f'state_dir = "{lab.directory / "state" / f"mac{i}"}"',
        ]
    path.write_text("\n".join(lines) + "\n")
    return path


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m tests.hostlab", description=__doc__)
    parser.add_argument("directory", type=Path)
    parser.add_argument("--hosts", type=int, default=3)
    parser.add_argument("--delay-ms", type=float, default=2.0, help="the slow network's delay")
    args = parser.parse_args()
    if (missing := available()) is not None:
        raise SystemExit(f"the lab cannot run here: {missing}")
    lab = HostLab(args.directory / "lab", args.hosts, args.delay_ms / 1000).start()
    cluster_file = args.directory / "cluster.toml"
    try:
        write_cluster_file(lab, cluster_file)
        print(f"hosts: {', '.join(h.name for h in lab.hosts)}; cluster file: {cluster_file}")
        print("Ctrl-C takes the lab away", flush=True)
        signal.signal(signal.SIGTERM, signal.default_int_handler)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        subprocess.run(
            [sys.executable, "-m", "cluster", "down", "--hosts", str(cluster_file)],
            capture_output=True,
        )
        lab.close()


if __name__ == "__main__":
    main()
