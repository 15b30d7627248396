"""`cluster status`: the cluster table of a running coordinator, asked over its HTTP API."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import click

from cluster.commands.options import api_key_option
from coordinator.api_keys import API_KEY_ENV


@click.command("status")
@click.option("--url", default="http://127.0.0.1:8000", show_default=True)
@api_key_option("The coordinator's API key.")
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
    if note := data.get("model", {}).get("note"):  # e.g. a model without its MTP head
        click.echo(note)
    if warmup := data.get("warmup"):  # "warming 3/15: decode batch 4 (...)", "warm in 4.2 s"
        click.echo(warmup.get("line") or warmup.get("state", ""))
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
            + ("  -> measuring" if node.get("hop_state") == "measuring" else "")
        )
    nodes = data.get("nodes", [])
    if links := data.get("coordinator_links"):
        click.echo("coordinator links")
        for link in links:
            click.echo(f"  {_describe_coordinator_link(link)}")
    awake = [n["node_id"] for n in nodes if n.get("keeps_awake")]
    asleep = [f"{n['node_id']} ({n.get('keep_awake_note') or '?'})" for n in nodes
              if not n.get("keeps_awake")]  # fmt: skip
    click.echo(
        f"keeping their Mac awake: {', '.join(awake) or 'none'}"
        + (f"; not: {', '.join(asleep)}" if asleep else "")
    )
    for node in nodes:
        if node.get("kernel_builds"):
            click.echo(f"{node['node_id']}: {node['kernel_builds']}")


def _describe_hop(hop: dict) -> str:
    """The link to the successor: address, kind, the round trip when it was measured; and a
    hop that failed over: flagged while off its best address, with its moves and why."""
    how = f"{hop['rtt_ms']:.2f} ms" if hop["measured"] else "given"
    line = f"{hop['address']} ({hop['kind'] or 'unknown link'}, {how})"
    if hop.get("degraded"):
        line += f"  DEGRADED (best: {hop.get('best_address') or '?'})"
    if failovers := hop.get("failovers"):
        line += f"  failovers {failovers}, last: {hop.get('last_failover') or '?'}"
    return line


# How each role's link runs, seen from the coordinator.
_LINK_DIRECTIONS = {"steps": "steps   ->", "results": "results <-", "control": "control ->"}


def _describe_coordinator_link(link: dict) -> str:
    """One of the coordinator's links to a node, as a hop is shown: where it runs now, over
    what, and, when it failed over, flagged while off its best address with its moves and
    why; FAILED once no address of the node answers."""
    direction = _LINK_DIRECTIONS.get(link["role"], link["role"])
    how = ", ".join(filter(None, (link.get("kind") or "unknown link", link.get("transport"))))
    line = f"{direction} {link['node_id']:<22} {link['address']} ({how})"
    if link.get("failed"):
        line += f"  FAILED: {link['failed']}"
    elif link.get("degraded"):
        line += f"  DEGRADED (best: {link.get('best_address') or '?'})"
    if failovers := link.get("failovers"):
        line += f"  failovers {failovers}, last: {link.get('last_failover') or '?'}"
    return line
