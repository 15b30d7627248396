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
from cluster.model.footprint import FootprintError, ModelFootprint, model_max_context
from cluster.placement import (
    DEFAULT_BANDWIDTH_GBPS,
    NodeCapacity,
    PlacementError,
    longest_context,
    plan_longest_context,
    plan_placement,
)

GIB = 1 << 30
DEFAULT_MAX_RUNNING = 8  # as `cluster coordinator --max-running`
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
    "--max-context",
    "--context",
    "max_context",
    type=click.IntRange(min=1),
    default=None,
    metavar="TOKENS",
    help="The longest request served, prompt + max_tokens, as `cluster coordinator "
    "--max-context` [default: the model's context, or the longest that fits].",
)
@click.option(
    "--max-running",
    "--concurrency",
    "max_running",
    type=click.IntRange(min=1),
    default=DEFAULT_MAX_RUNNING,
    show_default=True,
    help="Requests served at once, each with its own caches (the coordinator's admission limit).",
)
@click.option(
    "--no-prefix-cache",
    is_flag=True,
    help="Reserve no conversation snapshots, as `cluster coordinator --no-prefix-cache`.",
)
@layers_option("Fix the split: one half-open range per --node, in order.")
@click.option(
    "--all-nodes", "use_all", is_flag=True, help="Use every node, not only the fewest that fit."
)
def plan_command(
    model_dir: Path,
    node_specs: tuple[str, ...],
    max_context: int | None,
    max_running: int,
    no_prefix_cache: bool,
    layers: list[tuple[int, int]] | None,
    use_all: bool,
) -> None:
    """Show which node would hold which layers and what memory each reserves (weights, KV,
    GatedDeltaNet state, conversation snapshots), and why; exit 1 when the model does not
    fit."""
    if not node_specs:
        raise click.UsageError("give at least one --node ID=MEMORY_GB[@BANDWIDTH_GBPS]")
    nodes = [parse_node(spec) for spec in node_specs]
    kwargs = {
        "concurrency": max_running,
        "layers": layers,
        "use_all": use_all,
        "prefix_cache": not no_prefix_cache,
    }
    try:
        footprint = ModelFootprint.from_dir(model_dir)
        model_context = model_max_context(model_dir)
        if max_context is not None and max_context > model_context:
            raise click.BadParameter(
                f"{max_context} is beyond the model's own context of {model_context} tokens",
                param_hint="--max-context",
            )
        if max_context is None:
            result = plan_longest_context(nodes, footprint, max_context=model_context, **kwargs)
        else:
            result = plan_placement(nodes, footprint, context_tokens=max_context, **kwargs)
    except (FootprintError, PlacementError) as e:
        click.echo(f"error: {e}", err=True)
        if isinstance(e, PlacementError):
            longest = longest_context(
                nodes, footprint, max_context=max_context or model_context, **kwargs
            )
            if longest:
                click.echo(f"hint: --max-context {longest} fits", err=True)
        sys.exit(1)
    click.echo(f"model: {footprint.path} ({footprint.model_type}, {footprint.num_layers} layers)")
    click.echo(_context_line(result.context_tokens, max_context, model_context, max_running))
    click.echo(result.format_table())
    click.echo("")
    for reason in result.reasons:
        click.echo(f"- {reason}")


def _context_line(planned: int, asked: int | None, model_context: int, max_running: int) -> str:
    why = (
        "as asked"
        if asked is not None
        else "the model's own"
        if planned == model_context
        else f"the longest that fits; the model's own {model_context} does not"
    )
    return (
        f"max context: {planned} tokens per request ({why}), reserved for {max_running} "
        "requests at once"
    )
