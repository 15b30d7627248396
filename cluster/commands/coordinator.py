"""`cluster coordinator`: the OpenAI-compatible API and the dashboard over node daemons."""

from __future__ import annotations

import asyncio
from pathlib import Path

import click

from cluster.commands.options import layers_option, model_option, serving_options, token_option
from coordinator.settings import CoordinatorSettings, ServingOptions

NO_WARMUP_HELP = (
    "Say ready without running every shape on the nodes first (faster start; the first "
    "requests then wait while kernels build)."
)


def serve_coordinator(settings: CoordinatorSettings) -> None:
    """Run the coordinator's service until Ctrl-C, which ends it quietly; what stops it
    otherwise (a port in use, a model it cannot serve) becomes a click error. Imported here,
    not at the top: the service brings the tokenizer (`transformers`, seconds to import),
    which the commands beside it do without."""
    from coordinator.service import run_coordinator

    try:
        asyncio.run(run_coordinator(settings))
    except KeyboardInterrupt:
        pass
    except (OSError, ValueError) as error:
        raise click.ClickException(str(error)) from error


def build_settings(
    serving: ServingOptions, model_dir: Path, token: str, **rest: object
) -> CoordinatorSettings:
    """`serving.settings(...)` with its refusals as click errors: keys that cannot be read or
    used, an endpoint beyond loopback without a key, and a longest request the model cannot
    serve (before anything is started)."""
    from coordinator.settings import ApiKeyError, MaxContextError, OpenEndpointError

    try:
        return serving.settings(model_dir, token, **rest)
    except OpenEndpointError as error:
        raise click.UsageError(str(error)) from error
    except MaxContextError as error:
        raise click.BadParameter(str(error), param_hint="--max-context / max_context") from error
    except ApiKeyError as error:
        raise click.BadParameter(str(error), param_hint="--api-key / --api-key-file") from error
    except (OSError, ValueError) as error:
        raise click.ClickException(str(error)) from error


@click.command("coordinator")
@click.option("--nodes", default="", help="Static node list HOST:PORT,... (mDNS finds others).")
@model_option()
@token_option(required=True)
@layers_option("Override placement: 0:20,20:40,...")
@click.option("--all-nodes", is_flag=True, help="Use every node, not the fewest that fit.")
@click.option("--no-mdns", is_flag=True, help="Only use --nodes; do not browse mDNS.")
@click.option("--no-warmup", is_flag=True, help=NO_WARMUP_HELP)
@serving_options
def coordinator_command(
    nodes: str,
    model_dir: Path,
    token: str,
    layers: list[tuple[int, int]] | None,
    all_nodes: bool,
    no_mdns: bool,
    no_warmup: bool,
    serving: ServingOptions,
) -> None:
    """Serve the OpenAI-compatible API and the dashboard over a cluster of nodes."""
    settings = build_settings(
        serving,
        model_dir,
        token,
        nodes=tuple(n for n in nodes.split(",") if n),
        browse=not no_mdns,
        layers=layers,
        use_all=all_nodes,
        warmup=not no_warmup,
    )
    serve_coordinator(settings)
