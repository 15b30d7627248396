"""`cluster coordinator`, `cluster up` and `cluster status`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import click

from cluster.config import bundled_model_path
from cluster.messages import MtpDepth, RequestError, parse_mtp_depth
from cluster.model.shard import parse_layers
from cluster.transport.auth import TLSConfig
from coordinator.api_keys import API_KEY_ENV, ApiKeys, read_api_keys

NODE_START_TIMEOUT_S = 60.0


def _serve(model_dir: Path, **settings: object) -> None:
    """Run the coordinator's service to its end. Imported here, not at the top: the service
    brings the tokenizer (`transformers`, seconds to import), which `cluster status` does
    without."""
    from coordinator.service import run_coordinator

    asyncio.run(run_coordinator(model_dir, **settings))


@click.command("coordinator")
@click.option("--nodes", default="", help="Static node list HOST:PORT,... (mDNS finds others).")
@click.option(
    "--model",
    "model_dir",
    type=click.Path(path_type=Path),
    default=None,
    help="Model directory (default: the bundled tiny Qwen3.5).",
)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=8000, show_default=True)
@click.option("--token", envvar="CLUSTER_TOKEN", required=True, help="Cluster secret.")
@click.option("--layers", default=None, help="Override placement: 0:20,20:40,...")
@click.option("--all-nodes", is_flag=True, help="Use every node, not the fewest that fit.")
@click.option("--no-mdns", is_flag=True, help="Only use --nodes; do not browse mDNS.")
@click.option("--max-running", type=int, default=8, show_default=True)
@click.option("--max-queued", type=int, default=64, show_default=True)
@click.option(
    "--tls-cert",
    envvar="CLUSTER_TLS_CERT",
    type=click.Path(exists=True),
    default=None,
    help="Cluster certificate (PEM) when the nodes serve TLS.",
)
@click.option(
    "--tls-key",
    envvar="CLUSTER_TLS_KEY",
    type=click.Path(exists=True),
    default=None,
    help="The certificate's key: with TLS, needed to serve weights to nodes.",
)
@click.option(
    "--weights-port",
    type=int,
    default=0,
    help="Port of the weights service that nodes fetch from [default: any free port].",
)
@click.option(
    "--api-key",
    envvar=API_KEY_ENV,
    default=None,
    help=f"Require 'Authorization: Bearer KEY' on /v1 (also ${API_KEY_ENV}).",
)
@click.option(
    "--api-key-file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="Accepted API keys, one a line (with or instead of --api-key).",
)
@click.option(
    "--mtp-depth",
    default="1",
    show_default=True,
    help="MTP drafts per step for requests that do not name theirs: 0-8 or auto.",
)
@click.option(
    "--open-monitoring",
    is_flag=True,
    help="With API keys: leave /metrics, /health and the dashboard's data open.",
)
@click.option(
    "--no-prefix-cache",
    is_flag=True,
    help="Do not keep conversation (prefix) snapshots on the nodes.",
)
def coordinator_command(
    nodes: str,
    model_dir: Path | None,
    host: str,
    port: int,
    token: str,
    layers: str | None,
    all_nodes: bool,
    no_mdns: bool,
    max_running: int,
    max_queued: int,
    tls_cert: str | None,
    tls_key: str | None,
    weights_port: int,
    api_key: str | None,
    api_key_file: Path | None,
    mtp_depth: str,
    open_monitoring: bool,
    no_prefix_cache: bool,
) -> None:
    """Serve the OpenAI-compatible API and the dashboard over a cluster of nodes."""
    static = [n for n in nodes.split(",") if n]
    try:
        keys = ApiKeys.of(read_api_keys(api_key, api_key_file), open_monitoring=open_monitoring)
    except (OSError, ValueError) as error:
        raise click.BadParameter(str(error), param_hint="--api-key / --api-key-file") from error
    try:
        _serve(
            model_dir or bundled_model_path(),
            nodes=static,
            token=token,
            host=host,
            port=port,
            browse=not no_mdns,
            layers=parse_layers(layers) if layers else None,
            use_all=all_nodes,
            max_running=max_running,
            max_queued=max_queued,
            tls=TLSConfig.from_files(tls_cert, tls_key),
            weights_port=weights_port,
            api_keys=keys,
            mtp_depth=_mtp_depth(mtp_depth),
            prefix_cache=not no_prefix_cache,
        )
    except KeyboardInterrupt:
        pass
    except (OSError, ValueError) as error:
        raise click.ClickException(str(error)) from error


def _mtp_depth(text: str) -> MtpDepth:
    try:
        return parse_mtp_depth(text)
    except RequestError as error:
        raise click.BadParameter(str(error), param_hint="--mtp-depth") from error


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_node_command(port: int, node_id: str) -> list[str]:
    """A node daemon on loopback (its token comes from CLUSTER_TOKEN in its environment)."""
    return [sys.executable, "-m", "cluster", "node", "--host", "127.0.0.1", "--port", str(port),
            "--node-id", node_id, "--no-advertise"]  # fmt: skip


def _wait_for_nodes(procs: list[subprocess.Popen], ports: list[int]) -> None:
    deadline = time.monotonic() + NODE_START_TIMEOUT_S
    for proc, port in zip(procs, ports, strict=True):
        while True:
            if proc.poll() is not None:
                raise click.ClickException(f"node on port {port} exited with {proc.returncode}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
                break
            if time.monotonic() > deadline:
                raise click.ClickException(f"node on port {port} did not start")
            time.sleep(0.1)


@click.command("up")
@click.option("--local", "count", type=int, default=None, help="Number of local nodes.")
@click.option(
    "--hosts",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Cluster file (TOML): node services on these hosts over ssh (deploy/README.md).",
)
@click.option(
    "--model",
    "model_dir",
    type=click.Path(path_type=Path),
    default=None,
    help="Model directory (default: the bundled tiny Qwen3.5).",
)
@click.option("--port", type=int, default=None, help="HTTP port [default: 8000, or the file's].")
@click.option("--layers", default=None, help="Override placement: 0:3,3:6,6:8.")
def up_command(
    count: int | None,
    hosts: Path | None,
    model_dir: Path | None,
    port: int | None,
    layers: str | None,
) -> None:
    """The coordinator plus N local nodes (Ctrl-C stops everything), or nodes on --hosts."""
    if (count is None) == (hosts is None):
        raise click.UsageError("give either --local N or --hosts FILE")
    if hosts is not None:
        if model_dir is not None:
            raise click.UsageError("with --hosts, the model is the cluster file's `model`")
        from cluster.hosts.cli import up_hosts

        up_hosts(hosts, layers, port)
        return
    port = port or 8000
    if count < 1:
        raise click.BadParameter("--local needs at least one node")
    token = os.environ.get("CLUSTER_TOKEN") or secrets.token_hex(16)
    env = {**os.environ, "CLUSTER_TOKEN": token}
    # SIGTERM (kill, a service manager) stops everything as Ctrl-C does; by default it would
    # end this process at once, skipping the `finally` below and leaving the nodes running.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    ports = [_free_port() for _ in range(count)]
    procs = [
        subprocess.Popen(local_node_command(p, f"local-{i}"), env=env, stdout=subprocess.DEVNULL)
        for i, p in enumerate(ports)
    ]
    try:
        _wait_for_nodes(procs, ports)
        click.echo(f"{count} local node(s) on ports {', '.join(map(str, ports))}")
        _serve(
            model_dir or bundled_model_path(),
            nodes=[f"127.0.0.1:{p}" for p in ports],
            token=token,
            port=port,
            browse=False,
            layers=parse_layers(layers) if layers else None,
            use_all=True,
        )
    except KeyboardInterrupt:
        pass
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()


@click.command("status")
@click.option("--url", default="http://127.0.0.1:8000", show_default=True)
@click.option("--api-key", envvar=API_KEY_ENV, default=None, help="The coordinator's API key.")
@click.option("--json", "as_json", is_flag=True, help="Print the coordinator's cluster document.")
def status_command(url: str, api_key: str | None, as_json: bool) -> None:
    """Print the cluster table of a running coordinator."""
    request = urllib.request.Request(f"{url.rstrip('/')}/api/cluster")
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            data = json.load(response)
    except urllib.error.HTTPError as error:
        if error.code == 401:
            raise click.ClickException(
                f"the coordinator at {url} needs its API key (--api-key or ${API_KEY_ENV})"
            ) from error
        raise click.ClickException(f"the coordinator at {url} answered {error}") from error
    except (urllib.error.URLError, OSError) as error:
        raise click.ClickException(f"cannot reach the coordinator at {url}: {error}") from error
    if as_json:
        click.echo(json.dumps(data, indent=2))
        return
    stats = data.get("stats", {})
    click.echo(
        f"model {stats.get('model_id', '?')}  {stats.get('tokens_per_s', 0):.1f} tokens/s  "
        f"acceptance {stats.get('acceptance_rate', 0):.0%}  "
        f"in flight {stats.get('requests_in_flight', 0)}"
    )
    header = f"{'node':<22} {'address':<22} {'layers':<10} {'role':<10} {'state':<6} "
    click.echo(header + f"{'memory':>18} {'step ms':>8}")
    for node in data.get("nodes", []):
        role = "+".join(r for r in ("head", "tail") if node.get(f"is_{r}")) or "-"
        layers = f"[{node['start']}, {node['end']})" if node["end"] > node["start"] else "standby"
        memory = (
            f"{node['memory_used_bytes'] / 2**30:.1f}/{node['memory_total_bytes'] / 2**30:.1f} GiB"
        )
        fetching = node.get("weights_fraction")
        click.echo(
            f"{node['node_id']:<22} {node['address']:<22} {layers:<10} {role:<10} "
            f"{'up' if node['up'] else 'DOWN':<6} {memory:>18} {node['step_latency_ms']:>8.2f}"
            + (f"  fetching weights {fetching:.0%}" if fetching is not None else "")
            + (f"  -> {_describe_hop(node['hop'])}" if node.get("hop") else "")
        )


def _describe_hop(hop: dict) -> str:
    """The link to the successor: address, kind, and the round trip when it was measured."""
    how = f"{hop['rtt_ms']:.2f} ms" if hop["measured"] else "given"
    return f"{hop['address']} ({hop['kind'] or 'unknown link'}, {how})"
