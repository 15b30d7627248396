"""The `cluster` command."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from pathlib import Path

import click

from cluster.config import bundled_model_path
from cluster.messages import RequestError, RequestOptions, SamplingParams, parse_mtp_depth

log = logging.getLogger(__name__)


class _Commands(click.Group):
    """The `cluster` group. `cluster hosts ...`, which `cluster up --hosts` runs over ssh on
    every host, imports only what it needs (not MLX and the coordinator): each ssh round
    trip then takes a fraction of a second instead of seconds."""

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name == "hosts":
            from cluster.hosts.remote import hosts_group

            return hosts_group
        _register_commands()
        return super().get_command(ctx, name)

    def list_commands(self, ctx: click.Context) -> list[str]:
        _register_commands()
        return super().list_commands(ctx)


@click.group(cls=_Commands)
@click.option("-v", "--verbose", count=True, help="More logging (-v info, -vv debug).")
def main(verbose: int) -> None:
    """Serve Qwen3.5 models across several Macs, pipeline-parallel, with MTP decoding."""
    level = [logging.WARNING, logging.INFO, logging.DEBUG][min(verbose, 2)]
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


@main.command()
@click.option(
    "--model",
    "model_dir",
    type=click.Path(path_type=Path),
    default=None,
    help="Model directory (default: the bundled tiny Qwen3.5).",
)
@click.option("--prompt", required=True, help="Prompt text.")
@click.option("--chat", is_flag=True, help="Wrap the prompt in the model's chat template.")
@click.option("--max-tokens", type=int, default=128, show_default=True)
@click.option("--temp", type=float, default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--top-k", type=int, default=0, show_default=True)
@click.option("--min-p", type=float, default=0.0, show_default=True)
@click.option("--seed", type=int, default=None)
@click.option("--no-mtp", is_flag=True, help="Decode without the MTP head.")
@click.option(
    "--mtp-depth",
    default="1",
    show_default=True,
    help="MTP drafts per step: 0-8, or auto (the tail picks the depth that pays).",
)
@click.option("--layers", default=None, help="Layer ranges per shard, e.g. 0:3,3:8.")
@click.option("--nodes", default=None, help="Run on node daemons: HOST:PORT,HOST:PORT,...")
@click.option("--token", envvar="CLUSTER_TOKEN", default=None, help="Cluster secret (--nodes).")
@click.option(
    "--tls-cert",
    envvar="CLUSTER_TLS_CERT",
    type=click.Path(exists=True),
    default=None,
    help="Cluster certificate (PEM) to reach TLS nodes (--nodes).",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def generate(
    model_dir: Path | None,
    prompt: str,
    chat: bool,
    max_tokens: int,
    temp: float,
    top_p: float,
    top_k: int,
    min_p: float,
    seed: int | None,
    no_mtp: bool,
    mtp_depth: str,
    layers: str | None,
    nodes: str | None,
    token: str | None,
    tls_cert: str | None,
    as_json: bool,
) -> None:
    """Generate text for one prompt, in this process or across node daemons."""
    from cluster.generate import run_generate

    model_dir = model_dir or bundled_model_path()
    try:
        options = RequestOptions(
            sampling=SamplingParams(temp, top_p, top_k, min_p, seed),
            mtp=not no_mtp,
            mtp_depth=parse_mtp_depth(mtp_depth),
        )
        result = asyncio.run(
            run_generate(
                model_dir,
                prompt,
                chat=chat,
                max_tokens=max_tokens,
                options=options,
                layers=layers,
                nodes=nodes,
                token=token,
                tls_cert=tls_cert,
                stream_to=None if as_json else sys.stdout,
            )
        )
    except (RequestError, ValueError, OSError, ConnectionError) as error:
        raise click.ClickException(str(error)) from error
    if as_json:
        click.echo(json.dumps(result))
    else:
        click.echo()
        click.echo(
            f"[{result['prompt_tokens']} prompt tokens, {len(result['tokens'])} generated, "
            f"{result['generation_tps']:.1f} tokens/s, MTP accepted "
            f"{result['accepted']}/{result['drafted']}]",
            err=True,
        )


def _register_commands() -> None:
    """Commands that live beside their concern: the node daemon, the planner, conversion."""
    if "node" in main.commands:
        return
    from cluster.bench.cli import bench_command
    from cluster.hosts.cli import down_command
    from cluster.hosts.remote import hosts_group
    from cluster.weights.listing import models_command
    from coordinator.cli import coordinator_command, status_command, up_command
    from coordinator.plan_cli import plan
    from node.server import node_command

    commands = (
        node_command,
        plan,
        coordinator_command,
        up_command,
        down_command,
        status_command,
        models_command,
        bench_command,
    )
    for command in commands:
        main.add_command(command)
    main.add_command(hosts_group)
    try:
        from cluster.model.convert import convert_command
    except ImportError:
        return
    main.add_command(convert_command, "convert")
