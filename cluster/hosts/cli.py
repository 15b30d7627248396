"""`cluster up --hosts FILE` (the coordinator in the foreground) and `cluster down --hosts FILE`."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import click

from cluster.hosts.bringup import BringUpError, bring_down, bring_up
from cluster.hosts.clusterfile import ClusterFileError, load_cluster_file
from cluster.model.shard import parse_layers
from cluster.secret import SecretFileError


def up_hosts(hosts: Path, layers: str | None, port: int | None) -> None:
    """Nodes as services on the hosts of `hosts`, then the coordinator here until Ctrl-C.

    Ctrl-C stops the coordinator only: the node services keep running (and keep their
    shards), so the next `cluster up --hosts` serves again without reloading."""
    from coordinator.service import run_coordinator

    try:
        cluster = load_cluster_file(hosts)
        secret, nodes = bring_up(cluster, say=click.echo)
    except (ClusterFileError, BringUpError, SecretFileError) as error:
        raise click.ClickException(str(error)) from error
    for node in nodes:
        click.echo(node.describe())
    click.echo(f"{len(nodes)} node(s) up; `cluster down --hosts {hosts}` stops them")
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        asyncio.run(
            run_coordinator(
                cluster.model,
                nodes=[node.address for node in nodes],
                token=secret,
                host=cluster.host,
                port=port or cluster.port,
                browse=False,
                layers=parse_layers(layers) if layers else None,
                use_all=True,
                pinned_addresses=frozenset(n.address for n in nodes if n.node.address),
                adopt_shards=True,  # nodes that outlived a previous `up` keep their shards
            )
        )
    except KeyboardInterrupt:
        pass
    except (OSError, ValueError) as error:
        raise click.ClickException(str(error)) from error


@click.command("down")
@click.option(
    "--hosts",
    type=click.Path(dir_okay=False, path_type=Path),
    required=True,
    help="The cluster file that `cluster up --hosts` used.",
)
def down_command(hosts: Path) -> None:
    """Stop and remove the node services that `cluster up --hosts` installed."""
    try:
        bring_down(load_cluster_file(hosts), say=click.echo)
    except (ClusterFileError, BringUpError) as error:
        raise click.ClickException(str(error)) from error
