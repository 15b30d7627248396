"""The `cluster` command."""

from __future__ import annotations

import asyncio
import importlib
import json
import logging
import sys
from pathlib import Path

import click

from cluster.config import bundled_model_path
from cluster.messages import RequestError, RequestOptions, SamplingParams, parse_mtp_depth

log = logging.getLogger(__name__)


# The commands that live beside their concern, by name: the module each is in and its name
# there. Only the command that runs is imported: a node's start then imports the node's code,
# not the coordinator's tokenizer (`transformers`, 2.4 s on a 2-core Linux VM) nor the
# benchmark's HTTP client, and `cluster hosts ...`, which `cluster up --hosts` runs over ssh
# on every host, not MLX either: each ssh round trip takes a fraction of a second.
COMMAND_MODULES: dict[str, tuple[str, str]] = {
    "node": ("node.server", "node_command"),
    "plan": ("coordinator.plan_cli", "plan"),
    "coordinator": ("coordinator.cli", "coordinator_command"),
    "up": ("coordinator.cli", "up_command"),
    "down": ("cluster.hosts.cli", "down_command"),
    "status": ("coordinator.cli", "status_command"),
    "models": ("cluster.weights.listing", "models_command"),
    "bench": ("cluster.bench.cli", "bench_command"),
    "convert": ("cluster.model.convert", "convert_command"),
    "hosts": ("cluster.hosts.remote", "hosts_group"),
}


class _Commands(click.Group):
    """The `cluster` group: `generate` is here, every other command is imported when asked
    for (`COMMAND_MODULES`)."""

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in self.commands or name not in COMMAND_MODULES:
            return super().get_command(ctx, name)
        module_name, attribute = COMMAND_MODULES[name]
        command = getattr(importlib.import_module(module_name), attribute)
        self.add_command(command, name)
        return command

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(self.commands) | set(COMMAND_MODULES))  # `hosts` is hidden in help


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
