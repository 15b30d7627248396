"""`cluster plan`: where the layers of a model would go on a (hypothetical) cluster.

It runs the same pure `plan_placement` as the coordinator, on nodes described on the command
line, so a layout can be checked before any Mac is switched on. Asking live nodes for their
capacities waits for the node Info RPC.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import click

from cluster.commands.options import layers_option, model_option
from cluster.model.footprint import FootprintError, ModelFootprint
from cluster.placement import DEFAULT_BANDWIDTH_GBPS, NodeCapacity, PlacementError, plan_placement

GIB = 1 << 30
DEFAULT_CONTEXT = 32768
_NODE_SPEC = re.compile(r"^(?P<id>[^=\s]+)=(?P<mem>[0-9.]+)(?:@(?P<bw>[0-9.]+))?$")


def parse_node(spec: str) -> NodeCapacity:
    """`ID=MEMORY_GB[@BANDWIDTH_GBPS]`: free memory in GiB (as macOS counts a "GB"), memory
    bandwidth in GB/s."""
    match = _NODE_SPEC.match(spec.strip())
    if match is None:
        raise click.BadParameter(f"expected ID=MEMORY_GB[@BANDWIDTH_GBPS], got {spec!r}")
    try:
        memory = float(match["mem"])
        bandwidth = float(match["bw"]) if match["bw"] else DEFAULT_BANDWIDTH_GBPS
        return NodeCapacity(match["id"], "", int(memory * GIB), bandwidth)
    except (ValueError, PlacementError) as e:
        raise click.BadParameter(f"{spec!r}: {e}") from e


@click.command("plan")
@model_option(
    "Model: a directory (Hugging Face or MLX layout) or a Hugging Face repo id owner/name.",
    show_default="the bundled qwen3_5-tiny-mtp",
)
@click.option(
    "--node",
    "node_specs",
    multiple=True,
    metavar="ID=MEMORY_GB[@BANDWIDTH_GBPS]",
    help="A node: free memory in GiB, memory bandwidth in GB/s "
    f"(default {DEFAULT_BANDWIDTH_GBPS:g}). Repeat for each node.",
)
@click.option(
    "--context",
    "context_tokens",
    type=click.IntRange(min=1),
    default=DEFAULT_CONTEXT,
    show_default=True,
    help="Tokens of context budgeted per request.",
)
@click.option(
    "--concurrency",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Requests served at once, each with its own caches.",
)
@layers_option("Fix the split: one half-open range per --node, in order.")
@click.option(
    "--all-nodes", "use_all", is_flag=True, help="Use every node, not only the fewest that fit."
)
def plan_command(
    model_dir: Path,
    node_specs: tuple[str, ...],
    context_tokens: int,
    concurrency: int,
    layers: list[tuple[int, int]] | None,
    use_all: bool,
) -> None:
    """Show which node would hold which layers, and why; exit 1 when the model does not fit."""
    if not node_specs:
        raise click.UsageError("give at least one --node ID=MEMORY_GB[@BANDWIDTH_GBPS]")
    nodes = [parse_node(spec) for spec in node_specs]
    try:
        footprint = ModelFootprint.from_dir(model_dir)
        result = plan_placement(
            nodes,
            footprint,
            context_tokens=context_tokens,
            concurrency=concurrency,
            layers=layers,
            use_all=use_all,
        )
    except (FootprintError, PlacementError) as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(1)
    click.echo(f"model: {footprint.path} ({footprint.model_type}, {footprint.num_layers} layers)")
    click.echo(result.format_table())
    click.echo("")
    for reason in result.reasons:
        click.echo(f"- {reason}")
