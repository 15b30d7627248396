"""What `cluster up --hosts` runs on each host, over ssh: `cluster hosts probe|install|remove`.

Each command prints one JSON object on stdout. The secret travels on stdin, never as an
argument. These run in the host's own installation of the project, so the node service is
started with exactly that Python (`sys.executable -m cluster node`).
"""

from __future__ import annotations

import json
import os
import platform
import socket
import sys
import time
from pathlib import Path

import click

from cluster import __version__
from cluster.hosts.service import NodeService, ServiceError, default_state_dir, resolve_kind
from cluster.secret import read_secret, write_secret

NODE_START_DEADLINE_S = 60.0
# Carried into the service's environment: where this installation finds its code.
PASSED_ENV = ("PYTHONPATH",)


def _answer(**fields: object) -> None:
    click.echo(json.dumps(fields))


@click.group("hosts", hidden=True)
def hosts_group() -> None:
    """Run on a host by `cluster up --hosts` over ssh (not meant to be typed)."""


@hosts_group.command("probe")
@click.option("--model", "model_dir", required=True, help="The coordinator's model path.")
@click.option("--service", "kind", default="auto")
@click.option("--address", default=None, help="The cluster file's address: an IP or interface.")
def probe_command(model_dir: str, kind: str, address: str | None) -> None:
    """Version, platform, the address ssh came in on, and whether the model is here."""
    from cluster.transport.links import interface_address

    connection = os.environ.get("SSH_CONNECTION", "").split()
    if address is not None:  # an interface name becomes its address here
        address = interface_address(address) or address
    try:
        resolved, kind_error = resolve_kind(kind), ""
    except ServiceError as error:
        resolved, kind_error = "", str(error)
    _answer(
        version=__version__,
        platform=platform.system(),
        hostname=socket.gethostname(),
        ssh_address=connection[2] if len(connection) >= 3 else "",
        address=address or "",
        model_present=(Path(model_dir) / "config.json").is_file(),
        service=resolved,
        service_error=kind_error,
    )


def node_argv(name: str, port: int, secret: Path, memory_gb: float | None) -> list[str]:
    argv = [sys.executable, "-m", "cluster", "node", "--host", "0.0.0.0", "--port", str(port),
            "--node-id", name, "--token-file", str(secret), "--no-advertise"]  # fmt: skip
    if memory_gb is not None:
        argv += ["--memory-gb", f"{memory_gb:g}"]
    return argv


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


@hosts_group.command("install")
@click.option("--name", required=True)
@click.option("--port", type=int, required=True)
@click.option("--service", "kind", default="auto")
@click.option("--state-dir", default=None)
@click.option("--memory-gb", type=float, default=None)
def install_command(
    name: str, port: int, kind: str, state_dir: str | None, memory_gb: float | None
) -> None:
    """Install and start the node service (the secret on stdin); harmless when it runs."""
    secret = sys.stdin.read().strip()
    if not secret:
        raise click.ClickException("no secret on stdin")
    state = Path(state_dir).expanduser() if state_dir else default_state_dir(name)
    secret_path = state / "secret"
    try:
        desired = NodeService(
            name,
            resolve_kind(kind),
            str(state),
            tuple(node_argv(name, port, secret_path, memory_gb)),
            tuple((k, os.environ[k]) for k in PASSED_ENV if k in os.environ),
        )
    except ServiceError as error:
        raise click.ClickException(str(error)) from error
    existing = NodeService.recorded(state)
    try:
        same_secret = read_secret(secret_path) == secret
    except OSError:
        same_secret = False
    if existing == desired and same_secret and existing.running() and _listening(port):
        _answer(state="running", service=desired.kind, state_dir=str(state))
        return
    if existing is not None:
        existing.remove()
    if _listening(port):
        raise click.ClickException(
            f"port {port} is in use by another program: stop it, or set port = N in this "
            "host's [[node]] table"
        )
    write_secret(secret_path, secret)
    try:
        desired.install()
    except ServiceError as error:
        desired.remove()
        raise click.ClickException(str(error)) from error
    deadline = time.monotonic() + NODE_START_DEADLINE_S
    while not _listening(port):
        if time.monotonic() > deadline or not desired.running():
            log = state / "node.log"
            tail = log.read_text()[-2000:] if log.exists() else ""
            desired.remove()
            raise click.ClickException(f"the node did not start listening on {port}:\n{tail}")
        time.sleep(0.1)
    _answer(
        state="restarted" if existing else "started", service=desired.kind, state_dir=str(state)
    )


@hosts_group.command("remove")
@click.option("--name", required=True)
@click.option("--state-dir", default=None)
def remove_command(name: str, state_dir: str | None) -> None:
    """Stop the node service and delete its definition and state."""
    state = Path(state_dir).expanduser() if state_dir else default_state_dir(name)
    existing = NodeService.recorded(state)
    if existing is None:
        _answer(state="absent")
        return
    existing.remove()
    _answer(state="removed", service=existing.kind)


def _add_ring_commands() -> None:
    """`cluster bench --hosts` runs mlx-lm's ring baseline through these (cluster.bench)."""
    from cluster.bench.ring_rank import RING_COMMANDS

    for command in RING_COMMANDS:
        hosts_group.add_command(command)


_add_ring_commands()
