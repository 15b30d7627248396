"""`cluster generate`: one prompt, in this process or across node daemons."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import click

from cluster.commands.options import (
    layers_option,
    model_option,
    mtp_depth_option,
    tls_cert_option,
    token_option,
)


@click.command("generate")
@model_option()
@click.option("--prompt", required=True, help="Prompt text.")
@click.option("--chat", is_flag=True, help="Wrap the prompt in the model's chat template.")
@click.option("--max-tokens", type=int, default=128, show_default=True)
@click.option("--temp", type=float, default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--top-k", type=int, default=0, show_default=True)
@click.option("--min-p", type=float, default=0.0, show_default=True)
@click.option("--seed", type=int, default=None)
@click.option("--no-mtp", is_flag=True, help="Decode without the MTP head.")
@mtp_depth_option(
    "MTP drafts per step: 0-8, or auto (the tail drafts where it pays) [default: auto; 1 with "
    "--seed and a temperature, so that the same seed gives the same tokens]."
)
@layers_option("Layer ranges per shard, e.g. 0:3,3:8.")
@click.option("--nodes", default=None, help="Run on node daemons: HOST:PORT,HOST:PORT,...")
@token_option("Cluster secret (--nodes).")
@tls_cert_option("Cluster certificate (PEM) to reach TLS nodes (--nodes).")
@click.option(
    "--no-warmup",
    is_flag=True,
    help="Time the request cold. By default a synthetic request of the same prompt length "
    "and MTP setting runs first, untimed, so tokens/s and the time to the first token are "
    "a warm engine's (its seconds: `warmup_s` in --json).",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def generate_command(
    model_dir: Path,
    prompt: str,
    chat: bool,
    max_tokens: int,
    temp: float,
    top_p: float,
    top_k: int,
    min_p: float,
    seed: int | None,
    no_mtp: bool,
    mtp_depth: int | str | None,
    layers: list[tuple[int, int]] | None,
    nodes: str | None,
    token: str | None,
    tls_cert: str | None,
    no_warmup: bool,
    as_json: bool,
) -> None:
    """Generate text for one prompt, in this process or across node daemons."""
    from cluster.decode.mtp_depth import served_depth
    from cluster.generate import Shards, run_generate
    from cluster.messages import RequestError, RequestOptions, SamplingParams
    from cluster.model.loading import NO_MTP_HEAD, has_mtp_head
    from cluster.transport.auth import TLSConfig

    try:
        sampling = SamplingParams(temp, top_p, top_k, min_p, seed)
        if mtp_depth is None:
            mtp_depth = served_depth("auto", sampling)
        mtp = not no_mtp
        if mtp and not has_mtp_head(model_dir):  # the tail could not draft: say so, ask none
            click.echo(f"{model_dir.name}: {NO_MTP_HEAD}", err=True)
            mtp, mtp_depth = False, 0
        options = RequestOptions(sampling=sampling, mtp=mtp, mtp_depth=mtp_depth)
        shards = Shards(layers)
        if nodes:
            tls = TLSConfig.from_files(tls_cert)
            shards = Shards(layers, tuple(nodes.split(",")), token or "", tls)
        result = asyncio.run(
            run_generate(
                model_dir,
                prompt,
                chat=chat,
                max_tokens=max_tokens,
                options=options,
                shards=shards,
                stream_to=None if as_json else sys.stdout,
                warmup=not no_warmup,
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
            f"{result['accepted']}/{result['drafted']}"
            + (f", after a {result['warmup_s']:.1f} s warm-up]" if result["warmup_s"] else "]"),
            err=True,
        )
