"""What `cluster up --hosts` does on each host, over ssh (`cluster hosts probe|install|remove`,
wired in `cluster.commands.hosts`): each returns the JSON object that the command prints.

These run in the host's own installation of the project, so the node service is started with
exactly that Python (`sys.executable -m cluster node`). Light to import: no MLX.
"""

from __future__ import annotations

import os
import platform
import socket
import sys
import time
from pathlib import Path

from cluster import __version__
from cluster.hosts.service import NodeService, ServiceError, default_state_dir, resolve_kind
from cluster.secret import read_secret, write_secret

NODE_START_DEADLINE_S = 60.0
# Carried into the service's environment: where this installation finds its code.
PASSED_ENV = ("PYTHONPATH",)


class InstallError(RuntimeError):
    """The node service could not be installed or did not start (the message says why)."""


def probe(model_dir: str, kind: str, address: str | None) -> dict[str, object]:
    """This host's version, platform, the address ssh came in on, the cluster file's
    `address` resolved (an interface name becomes its address), the service manager `kind`
    resolves to (or why none does), and whether the model is at `model_dir`."""
    from cluster.transport.links import interface_address

    connection = os.environ.get("SSH_CONNECTION", "").split()
    if address is not None:
        address = interface_address(address) or address
    try:
        resolved, kind_error = resolve_kind(kind), ""
    except ServiceError as error:
        resolved, kind_error = "", str(error)
    return {
        "version": __version__,
        "platform": platform.system(),
        "hostname": socket.gethostname(),
        "ssh_address": connection[2] if len(connection) >= 3 else "",
        "address": address or "",
        "model_present": (Path(model_dir) / "config.json").is_file(),
        "service": resolved,
        "service_error": kind_error,
    }


def node_argv(
    name: str, port: int, secret: Path, memory_gb: float | None, memory_share: float = 1.0
) -> list[str]:
    """The node service's command line: this Python's `cluster node` on all addresses, its
    secret read from the file `secret`."""
    argv = [sys.executable, "-m", "cluster", "node", "--host", "0.0.0.0", "--port", str(port),
            "--node-id", name, "--token-file", str(secret), "--no-advertise"]  # fmt: skip
    if memory_gb is not None:
        argv += ["--memory-gb", f"{memory_gb:g}"]
    if memory_share < 1:
        argv += ["--memory-share", f"{memory_share:.6f}"]
    return argv


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def _state_dir(name: str, state_dir: str | None) -> Path:
    return Path(state_dir).expanduser() if state_dir else default_state_dir(name)


def install(
    name: str,
    port: int,
    *,
    kind: str,
    state_dir: str | None,
    memory_gb: float | None,
    secret: str,
    memory_share: float = 1.0,
) -> dict[str, object]:
    """Install and start the node service `name` on `port`, listening once this returns;
    nothing is restarted when the same service already runs with the same secret. Raises
    InstallError when the port is another program's or the node does not start (the service
    is then removed)."""
    state = _state_dir(name, state_dir)
    secret_path = state / "secret"
    try:
        desired = NodeService(
            name,
            resolve_kind(kind),
            str(state),
            tuple(node_argv(name, port, secret_path, memory_gb, memory_share)),
            tuple((k, os.environ[k]) for k in PASSED_ENV if k in os.environ),
        )
    except ServiceError as error:
        raise InstallError(str(error)) from error
    existing = NodeService.recorded(state)
    try:
        same_secret = read_secret(secret_path) == secret
    except OSError:
        same_secret = False
    if existing == desired and same_secret and existing.running() and _listening(port):
        return {"state": "running", "service": desired.kind, "state_dir": str(state)}
    if existing is not None:
        existing.remove()
    if _listening(port):
        raise InstallError(
            f"port {port} is in use by another program: stop it, or set port = N in this "
            "host's [[node]] table"
        )
    write_secret(secret_path, secret)
    try:
        desired.install()
    except ServiceError as error:
        desired.remove()
        raise InstallError(str(error)) from error
    deadline = time.monotonic() + NODE_START_DEADLINE_S
    while not _listening(port):
        if time.monotonic() > deadline or not desired.running():
            log = state / "node.log"
            tail = log.read_text()[-2000:] if log.exists() else ""
            desired.remove()
            raise InstallError(f"the node did not start listening on {port}:\n{tail}")
        time.sleep(0.1)
    state_now = "restarted" if existing else "started"
    return {"state": state_now, "service": desired.kind, "state_dir": str(state)}


def remove(name: str, state_dir: str | None) -> dict[str, object]:
    """Stop the node service `name` and delete its definition and state (none: "absent")."""
    existing = NodeService.recorded(_state_dir(name, state_dir))
    if existing is None:
        return {"state": "absent"}
    existing.remove()
    return {"state": "removed", "service": existing.kind}
