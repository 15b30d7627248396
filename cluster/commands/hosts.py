"""`cluster hosts ...`: what `cluster up --hosts` and `cluster bench --hosts` run on each host
over ssh (hidden from help: not meant to be typed).

Each command prints one JSON object on stdout; a secret travels on stdin, never as an
argument. Light to import, MLX included: each ssh round trip starts a fresh process.
"""

from __future__ import annotations

import json
import sys

import click

from cluster.bench.ring_rank import RING_COMMANDS
from cluster.hosts import remote


def _answer(fields: dict[str, object]) -> None:
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
    _answer(remote.probe(model_dir, kind, address))


@hosts_group.command("install")
@click.option("--name", required=True)
@click.option("--port", type=int, required=True)
@click.option("--service", "kind", default="auto")
@click.option("--state-dir", default=None)
@click.option("--memory-gb", type=float, default=None)
@click.option("--memory-share", type=float, default=1.0)
def install_command(
    name: str,
    port: int,
    kind: str,
    state_dir: str | None,
    memory_gb: float | None,
    memory_share: float,
) -> None:
    """Install and start the node service (the secret on stdin); harmless when it runs."""
    secret = sys.stdin.read().strip()
    if not secret:
        raise click.ClickException("no secret on stdin")
    try:
        answer = remote.install(
            name,
            port,
            kind=kind,
            state_dir=state_dir,
            memory_gb=memory_gb,
            memory_share=memory_share,
            secret=secret,
        )
    except remote.InstallError as error:
        raise click.ClickException(str(error)) from error
    _answer(answer)


@hosts_group.command("remove")
@click.option("--name", required=True)
@click.option("--state-dir", default=None)
def remove_command(name: str, state_dir: str | None) -> None:
    """Stop the node service and delete its definition and state."""
    _answer(remote.remove(name, state_dir))


# `cluster bench --hosts` runs mlx-lm's ring baseline through these (cluster.bench).
for _command in RING_COMMANDS:
    hosts_group.add_command(_command)
