"""`cluster up --hosts` and `cluster down --hosts`: every host at once, all or nothing.

`up` probes every host first (reachable, the project installed at this version, the model
there or to be streamed); only when all pass does it install the node services, and if one of
those fails it removes the ones it started, so a failed `up` leaves nothing half-started.
Running `up` again finds the services running and changes nothing.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass

from cluster import __version__
from cluster.hosts.clusterfile import ClusterFile, HostNode
from cluster.hosts.ssh import SSH, SSH_FAILED, in_parallel, remote_words
from cluster.secret import ensure_secret

log = logging.getLogger(__name__)

COMMAND_NOT_FOUND = 127
INSTALL_TIMEOUT_S = 120.0


class BringUpError(RuntimeError):
    """One or more hosts failed; the message has a line per host, naming it and what to do."""


@dataclass(frozen=True, slots=True)
class HostProbe:
    node: HostNode
    version: str
    platform: str
    ssh_address: str
    address: str  # the cluster file's address, an interface resolved on the host
    model_present: bool
    service: str


@dataclass(frozen=True, slots=True)
class UpNode:
    """A node that `up` brought up (or found up)."""

    node: HostNode
    address: str  # host:port the coordinator dials
    state: str  # started, restarted, running
    service: str

    def describe(self) -> str:
        return (
            f"{self.node.name} ({self.node.ssh}) at {self.address}: {self.state} [{self.service}]"
        )


def hosts_command(
    ssh: SSH, node: HostNode, *args: str, stdin: str = "", timeout: float = 30.0
) -> dict:
    """Run `cluster hosts ARGS` on the node's host; its JSON answer, or a clear error."""
    done = ssh.run(
        node.ssh, remote_words(node.cluster, "hosts", *args), stdin=stdin, timeout=timeout
    )
    where = f"host {node.ssh!r}"
    detail = (done.stderr.strip().splitlines() or [""])[-1]
    if done.returncode == SSH_FAILED:
        raise BringUpError(
            f"{where}: ssh cannot reach it ({detail or 'no detail'}); check that `ssh {node.ssh}` "
            "logs in without a password prompt"
        )
    if done.returncode == COMMAND_NOT_FOUND:
        raise BringUpError(
            f"{where}: the project is not installed there ({node.cluster!r} not found); install "
            f'it on that host, or give its path as cluster = "..." in the [[node]] table'
        )
    if done.returncode != 0:
        # A crash there: its last line (the exception) says what; the rest is its traceback.
        said = done.stderr.strip()
        said = said.splitlines()[-1] if "Traceback (most recent call last)" in said else said
        raise BringUpError(f"{where}: `cluster hosts {args[0]}` failed: {said}")
    try:
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise BringUpError(
            f"{where}: {node.cluster!r} answered something else than this project would "
            f"({done.stdout.strip()[:200]!r}); is it this project's `cluster` command?"
        ) from None


def probe(ssh: SSH, cluster: ClusterFile, node: HostNode) -> HostProbe:
    args = ["probe", "--model", str(cluster.model), "--service", node.service]
    if node.address is not None:
        args += ["--address", node.address]
    answer = hosts_command(ssh, node, *args)
    version = str(answer.get("version", "unknown"))
    if version != __version__:
        raise BringUpError(
            f"host {node.ssh!r} has cluster {version}, this machine {__version__}: install "
            "the same version on both (e.g. git pull && pip install -e . there)"
        )
    try:
        result = HostProbe(
            node,
            version,
            answer["platform"],
            answer["ssh_address"],
            answer.get("address", ""),
            answer["model_present"],
            answer["service"],
        )
    except KeyError as error:
        raise BringUpError(
            f"host {node.ssh!r}: its `cluster hosts probe` lacks {error}; it is another "
            f"version: install {__version__} there"
        ) from None
    if answer.get("service_error"):
        raise BringUpError(f"host {node.ssh!r}: {answer['service_error']}")
    if not result.ssh_address and node.address is None:
        raise BringUpError(
            f"host {node.ssh!r}: cannot tell which address ssh reached it on; give "
            'address = "..." in its [[node]] table'
        )
    return result


def _install(ssh: SSH, secret: str, node: HostNode) -> dict:
    args = ["install", "--name", node.name, "--port", str(node.port), "--service", node.service]
    if node.state_dir:
        args += ["--state-dir", node.state_dir]
    if node.memory_gb is not None:
        args += ["--memory-gb", f"{node.memory_gb:g}"]
    if node.memory_share < 1:
        args += ["--memory-share", f"{node.memory_share:.6f}"]
    return hosts_command(ssh, node, *args, stdin=secret + "\n", timeout=INSTALL_TIMEOUT_S)


def _remove(ssh: SSH, node: HostNode) -> dict:
    args = ["remove", "--name", node.name]
    if node.state_dir:
        args += ["--state-dir", node.state_dir]
    return hosts_command(ssh, node, *args)


def _failures(results: list, nodes: list[HostNode]) -> list[str]:
    return [
        str(r) if isinstance(r, BringUpError) else f"host {n.ssh!r}: {r}"
        for n, r in zip(nodes, results, strict=True)
        if isinstance(r, BaseException)
    ]


def dial_address(address: str, port: int) -> str:
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


def bring_up(
    cluster: ClusterFile, *, ssh: SSH | None = None, say: Callable[[str], None] = print
) -> tuple[str, list[UpNode]]:
    """Start (or find) every node's service; the secret and the nodes, head first."""
    ssh = ssh or SSH(cluster.ssh_config)
    secret = ensure_secret(cluster.secret_path)
    nodes = cluster.nodes
    probes = in_parallel(lambda n: probe(ssh, cluster, n), nodes)
    if failures := _failures(probes, nodes):
        raise BringUpError("\n".join(failures) + "\nnothing was started")
    for p in probes:
        if not p.model_present:
            say(
                f"{p.node.name}: no model at {cluster.model}; it will be streamed from this "
                "machine when the shard loads"
            )
    installs = in_parallel(lambda n: _install(ssh, secret, n), nodes)
    if failures := _failures(installs, nodes):
        started = [
            n for n, r in zip(nodes, installs, strict=True)
            if isinstance(r, dict) and r.get("state") != "running"
        ]  # fmt: skip
        in_parallel(lambda n: _remove(ssh, n), started)
        undone = f"\nstopped again: {', '.join(n.name for n in started)}" if started else ""
        raise BringUpError("\n".join(failures) + undone)
    up = [
        UpNode(
            p.node,
            dial_address(p.address or p.ssh_address, p.node.port),
            r["state"],
            r["service"],
        )
        for p, r in zip(probes, installs, strict=True)
    ]
    return secret, up


def bring_down(
    cluster: ClusterFile, *, ssh: SSH | None = None, say: Callable[[str], None] = print
) -> None:
    """Stop and remove every node service `up` installed."""
    ssh = ssh or SSH(cluster.ssh_config)
    results = in_parallel(lambda n: _remove(ssh, n), cluster.nodes)
    for node, result in zip(cluster.nodes, results, strict=True):
        if isinstance(result, dict):
            say(f"{node.name} ({node.ssh}): {result['state']}")
    if failures := _failures(results, cluster.nodes):
        raise BringUpError("\n".join(failures))
