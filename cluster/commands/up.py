"""`cluster up` and `cluster down`: a whole cluster started, and stopped, by one command.

`cluster up --local N` runs N node daemons on loopback and the coordinator, all stopped by
Ctrl-C. `cluster up --hosts FILE` installs the nodes as services on the cluster file's hosts
over ssh and runs the coordinator here; Ctrl-C stops the coordinator only, and `cluster down
--hosts FILE` removes the services.
"""

from __future__ import annotations

import os
import queue
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import click

from cluster.commands.coordinator import NO_WARMUP_HELP
from cluster.commands.options import layers_option, model_option, serving_options

if TYPE_CHECKING:
    from cluster.hosts.clusterfile import ClusterFile
    from coordinator.settings import CoordinatorSettings, ServingOptions

NODE_START_TIMEOUT_S = 60.0


def local_node_command(port: int, node_id: str) -> list[str]:
    """A node daemon on loopback (its token comes from CLUSTER_TOKEN in its environment)."""
    return [sys.executable, "-m", "cluster", "node", "--host", "127.0.0.1", "--port", str(port),
            "--node-id", node_id, "--no-advertise"]  # fmt: skip


# What a node prints once it listens (node.server.serve): its port is read from it.
_LISTENING = re.compile(r" listening on \S+:(\d+)$")


def _start_local_nodes(
    count: int, env: dict[str, str], extra: list[str]
) -> tuple[list[subprocess.Popen], list[int]]:
    """`count` node daemons on loopback, each on a port it picks itself (port 0: no other
    process can take it between a choice here and the node's bind), read from the line the
    node prints once it listens. Raises `ClickException` if one exits first or stays silent
    for NODE_START_TIMEOUT_S; the nodes started are then stopped."""
    procs: list[subprocess.Popen] = []
    try:
        for i in range(count):
            procs.append(
                subprocess.Popen(
                    [*local_node_command(0, f"local-{i}"), *extra],
                    env=env,
                    stdout=subprocess.PIPE,
                    text=True,
                )
            )
        deadline = time.monotonic() + NODE_START_TIMEOUT_S
        ports = [_listening_port(proc, f"local-{i}", deadline) for i, proc in enumerate(procs)]
    except BaseException:
        _stop_nodes(procs)
        raise
    return procs, ports


def _listening_port(proc: subprocess.Popen, name: str, deadline: float) -> int:
    """The port in `proc`'s "listening on" line. Its output is read to the end in the
    background (a node blocks on a full pipe)."""
    found: queue.Queue[int | None] = queue.Queue()

    def read() -> None:
        reported = False
        for line in proc.stdout:
            match = _LISTENING.search(line.rstrip())
            if match and not reported:
                found.put(int(match.group(1)))
                reported = True
        found.put(None)  # the end of its output: it exited

    threading.Thread(target=read, name=f"{name}-stdout", daemon=True).start()
    try:
        port = found.get(timeout=max(deadline - time.monotonic(), 0.0))
    except queue.Empty:
        raise click.ClickException(
            f"node {name} did not start within {NODE_START_TIMEOUT_S:.0f} s"
        ) from None
    if port is None:
        raise click.ClickException(f"node {name} exited with {proc.wait()}")
    return port


def _stop_nodes(procs: list[subprocess.Popen]) -> None:
    """SIGTERM each node, then kill those still running after 5 s."""
    for proc in procs:
        proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()


@click.command("up")
@click.option("--local", "count", type=int, default=None, help="Number of local nodes.")
@click.option(
    "--hosts",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Cluster file (TOML): node services on these hosts over ssh (deploy/README.md). "
    "Its serving keys (host, api_key_file, mtp_depth, ...) give what no flag gives.",
)
@model_option(bundled_default=False)
@layers_option("Override placement: 0:3,3:6,6:8.")
@click.option("--no-warmup", is_flag=True, help=NO_WARMUP_HELP)
@serving_options
def up_command(
    count: int | None,
    hosts: Path | None,
    model_dir: Path | None,
    layers: list[tuple[int, int]] | None,
    no_warmup: bool,
    serving: ServingOptions,
) -> None:
    """The coordinator plus N local nodes (Ctrl-C stops everything), or nodes on --hosts."""
    if (count is None) == (hosts is None):
        raise click.UsageError("give either --local N or --hosts FILE")
    if hosts is not None:
        if model_dir is not None:
            raise click.UsageError("with --hosts, the model is the cluster file's `model`")
        up_hosts(hosts, layers, serving, warmup=not no_warmup)
        return
    if count < 1:
        raise click.BadParameter("--local needs at least one node")
    up_local(count, model_dir, layers, serving, warmup=not no_warmup)


def up_local(
    count: int,
    model_dir: Path | None,
    layers: list[tuple[int, int]] | None,
    serving: ServingOptions,
    *,
    warmup: bool = True,
) -> None:
    """`count` node daemons on loopback and the coordinator, until Ctrl-C or SIGTERM, which
    stop them all. The settings are checked (keys read, an open endpoint refused) before
    any node starts."""
    from cluster.commands.coordinator import build_settings, serve_coordinator
    from cluster.config import bundled_model_path

    token = os.environ.get("CLUSTER_TOKEN") or secrets.token_hex(16)

    def settings_for(ports: list[int]) -> CoordinatorSettings:
        return build_settings(
            serving,
            model_dir or bundled_model_path(),
            token,
            nodes=tuple(f"127.0.0.1:{p}" for p in ports),
            browse=False,
            layers=layers,
            use_all=True,
            warmup=warmup,
        )

    settings_for([0] * count)  # its refusals, before any node starts
    env = {**os.environ, "CLUSTER_TOKEN": token}
    tls = [f"--tls-{part}={path}" for part, path in (("cert", serving.tls_cert),
           ("key", serving.tls_key)) if path]  # fmt: skip
    # SIGTERM (kill, a service manager) stops everything as Ctrl-C does; by default it would
    # end this process at once, skipping the `finally` below and leaving the nodes running.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    # The nodes share this machine (and its one GPU, where MLX runs on CUDA): each plans its
    # caches, snapshots and MLX's buffer cache within its share, or together they overrun it.
    share = [f"--memory-share={1 / count:.6f}"] if count > 1 else []
    try:
        procs, ports = _start_local_nodes(count, env, [*tls, *share])
    except KeyboardInterrupt:
        return
    try:
        click.echo(f"{count} local node(s) on ports {', '.join(map(str, ports))}")
        serve_coordinator(settings_for(ports))
    except KeyboardInterrupt:
        pass
    finally:
        _stop_nodes(procs)


def hosts_serving(cluster: ClusterFile, flags: ServingOptions) -> ServingOptions:
    """The serving options of `cluster up --hosts`: the flags given, else the cluster file's
    keys (its `host` and `port` too)."""
    from coordinator.settings import ServingOptions

    file = ServingOptions(host=cluster.host, port=cluster.port, **cluster.serving)
    return flags.over(file)


def up_hosts(
    hosts: Path,
    layers: list[tuple[int, int]] | None,
    flags: ServingOptions,
    *,
    warmup: bool = True,
) -> None:
    """Nodes as services on the hosts of `hosts`, then the coordinator here until Ctrl-C.

    Ctrl-C stops the coordinator only: the node services keep running (and keep their
    shards), so the next `cluster up --hosts` serves again without reloading."""
    from cluster.commands.coordinator import build_settings, serve_coordinator
    from cluster.hosts.bringup import BringUpError, bring_up
    from cluster.hosts.clusterfile import ClusterFileError, load_cluster_file
    from cluster.secret import SecretFileError

    try:
        cluster = load_cluster_file(hosts)
    except ClusterFileError as error:
        raise click.ClickException(str(error)) from error
    serving = hosts_serving(cluster, flags)
    if serving.tls_cert is not None:
        raise click.UsageError(
            "TLS with --hosts: the node services that `up` installs do not serve TLS; start "
            "the nodes and the coordinator by hand (deploy/README.md)"
        )
    # Checked with a stand-in secret before any host is touched: a bad key file or an open
    # endpoint stops here, with nothing started.
    build_settings(serving, cluster.model, "unchecked")
    try:
        secret, nodes = bring_up(cluster, say=click.echo)
    except (BringUpError, SecretFileError) as error:
        raise click.ClickException(str(error)) from error
    for node in nodes:
        click.echo(node.describe())
    click.echo(f"{len(nodes)} node(s) up; `cluster down --hosts {hosts}` stops them")
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    settings = build_settings(
        serving,
        cluster.model,
        secret,
        nodes=tuple(node.address for node in nodes),
        browse=False,
        layers=layers,
        use_all=True,
        pinned_addresses=frozenset(n.address for n in nodes if n.node.address),
        adopt_shards=True,  # nodes that outlived a previous `up` keep their shards
        warmup=warmup,
    )
    serve_coordinator(settings)


@click.command("down")
@click.option(
    "--hosts",
    type=click.Path(dir_okay=False, path_type=Path),
    required=True,
    help="The cluster file that `cluster up --hosts` used.",
)
def down_command(hosts: Path) -> None:
    """Stop and remove the node services that `cluster up --hosts` installed."""
    from cluster.hosts.bringup import BringUpError, bring_down
    from cluster.hosts.clusterfile import ClusterFileError, load_cluster_file

    try:
        # The model is never read here: a repo id is not resolved (nor downloaded).
        bring_down(load_cluster_file(hosts, resolve_model=False), say=click.echo)
    except (ClusterFileError, BringUpError) as error:
        raise click.ClickException(str(error)) from error
