"""`cluster bench`: the benchmark users run on their own cluster.

cluster bench --local 3 --prompt-tokens 128,2048 --concurrency 1,2,4,8 --out DIR
cluster bench --url http://10.0.0.2:8000 --rate 0.5,2 --out DIR
cluster bench --compare A/bench.json B/bench.json
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click

from cluster.bench import baselines, report
from cluster.bench.benchmark import BenchPlan, run_benchmark
from cluster.bench.client import BenchError
from cluster.bench.cluster_up import ClusterUp, ClusterUpError
from cluster.bench.workload import (
    PromptSource,
    Scenario,
    WorkloadError,
    positive_floats,
    positive_ints,
    scenarios,
)
from cluster.commands.options import model_option
from cluster.config import ModelDirError, bundled_model_path, load_model_config
from cluster.hosts.clusterfile import ClusterFileError, load_cluster_file
from cluster.messages import RequestError, parse_mtp_depth


@click.command("bench")
@click.option("--url", default=None, help="A running coordinator, e.g. http://10.0.0.2:8000.")
@click.option(
    "--api-key", envvar="CLUSTER_API_KEY", default=None, help="The coordinator's API key."
)
@click.option("--local", "local", type=int, default=None, help="Start N local nodes + coordinator.")
@click.option(
    "--hosts",
    type=click.Path(path_type=Path),
    default=None,
    help="Start the cluster on the hosts of FILE (as `cluster up --hosts`).",
)
@model_option(
    "The served model, a directory or a Hugging Face repo id owner/name: its tokenizer makes "
    "the prompts (default: bundled).",
    bundled_default=False,
)
@click.option("--prompt-tokens", default="128,1024", show_default=True, help="Prompt lengths.")
@click.option("--max-tokens", type=int, default=128, show_default=True, help="Generated each.")
@click.option("--concurrency", default="1,2,4,8", show_default=True, help="Closed-loop levels.")
@click.option("--rate", default=None, help="Open-loop rates in requests/s (Poisson), e.g. 0.5,2.")
@click.option("--requests", type=int, default=None, help="Requests per scenario [2 x level].")
@click.option(
    "--sampling",
    default="sampled",
    show_default=True,
    help="greedy, sampled (temperature 0.7) or both: greedy,sampled.",
)
@click.option("--mtp", "mtp_modes", default="on,off", show_default=True, help="on, off or on,off.")
@click.option(
    "--mtp-depth",
    default=None,
    help="MTP drafts per step (0..N or auto) for MTP-on requests [the server's default].",
)
@click.option(
    "--baseline",
    "baseline_kinds",
    default="mlx-lm",
    show_default=True,
    help="mlx-lm, ring, both (mlx-lm,ring) or none; ring: over --local ranks or --hosts.",
)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--prompt-offset",
    type=click.IntRange(min=0),
    default=None,
    help="Where in the prompt corpus the run starts (its JSON records it) [default: a random "
    "place: a server's conversation cache holds earlier runs' prompts].",
)
@click.option("--out", "out_dir", type=click.Path(path_type=Path), default=None)
@click.option(
    "--compare",
    nargs=2,
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="Print two bench.json files side by side (runs nothing).",
)
def bench_command(
    url: str | None,
    api_key: str | None,
    local: int | None,
    hosts: Path | None,
    model_dir: Path | None,
    prompt_tokens: str,
    max_tokens: int,
    concurrency: str,
    rate: str | None,
    requests: int | None,
    sampling: str,
    mtp_modes: str,
    mtp_depth: str | None,
    baseline_kinds: str,
    seed: int,
    prompt_offset: int | None,
    out_dir: Path | None,
    compare: tuple[Path, Path] | None,
) -> None:
    """Benchmark a cluster: TTFT, TPOT, ITL, tokens/s, acceptance, per-node load."""
    if compare is not None:
        try:
            a, b = (report.load(path) for path in compare)
        except ValueError as error:
            raise click.ClickException(str(error)) from None
        click.echo(report.compare(a, b))
        return
    targets = [t for t in (url, local, hosts) if t is not None]
    if len(targets) != 1:
        raise click.UsageError("give exactly one of --url, --local N or --hosts FILE")
    try:
        if hosts is not None:
            if model_dir is not None:
                raise click.UsageError("with --hosts, the model is the cluster file's `model`")
            cluster_file = load_cluster_file(hosts)
            model_dir = cluster_file.model
        model_dir = model_dir or bundled_model_path()
        chosen = _scenarios(
            prompt_tokens, max_tokens, concurrency, rate, requests, sampling, mtp_modes
        )
        plan = BenchPlan(model_dir, load_model_config(model_dir).max_context, chosen, seed)
        kinds = _baseline_kinds(baseline_kinds)
        depth = parse_mtp_depth(mtp_depth) if mtp_depth is not None else None
        # Each run starts at its own place in the corpus: a server's conversation cache holds
        # the prompts of earlier runs, and a repeated prompt would time the cache, not a prefill.
        start = random.randrange(1 << 30) if prompt_offset is None else prompt_offset
        prompts = PromptSource(_tokenizer(model_dir), start=start)
        with _cluster_url(url, local, hosts, model_dir) as target:
            result = _run(target, plan, prompts, api_key, depth)
        result["baselines"] = _baselines(
            kinds, plan, prompts, local, hosts, model_dir, result.get("hardware", [])
        )
    except (
        BenchError,
        WorkloadError,
        ClusterUpError,
        ModelDirError,
        ClusterFileError,
        RequestError,
    ) as error:
        raise click.ClickException(str(error)) from None
    _attach_ratios(result)
    result = {
        "benchmark": "cluster bench",
        "command": "cluster " + shlex.join(sys.argv[1:]),
        "settings": {
            "target": "url" if url else "local" if local else "hosts",
            "local_nodes": local,
            "hosts_file": str(hosts) if hosts else None,
            "model_dir": str(model_dir),
            "seed": seed,
            "prompt_offset": prompts.start,
            "mtp_depth": depth,
            "baselines": kinds,
        },
        "versions": report.versions(),
        **result,
    }
    click.echo(report.table(result))
    if out_dir is not None:
        _write(result, out_dir)
    failed = report.failed_scenarios(result)
    if failed:  # after the others were printed and written
        raise click.ClickException(f"{len(failed)} scenario(s) failed: {', '.join(failed)}")


def _scenarios(
    prompt_tokens: str,
    max_tokens: int,
    concurrency: str,
    rate: str | None,
    requests: int | None,
    sampling: str,
    mtp_modes: str,
) -> tuple[Scenario, ...]:
    """The scenarios the options ask for, or a WorkloadError naming the bad option."""
    if max_tokens < 1:
        raise WorkloadError(f"--max-tokens must be >= 1, got {max_tokens}")
    if requests is not None and requests < 1:
        raise WorkloadError(f"--requests must be >= 1, got {requests}")
    chosen = scenarios(
        prompt_tokens=positive_ints(prompt_tokens, "--prompt-tokens"),
        max_tokens=max_tokens,
        concurrency=positive_ints(concurrency, "--concurrency") if concurrency else [],
        rates=positive_floats(rate, "--rate") if rate else [],
        sampling=_choices(sampling, "--sampling", {"greedy": False, "sampled": True}),
        mtp=_choices(mtp_modes, "--mtp", {"on": True, "off": False}),
        requests=requests,
    )
    return tuple(chosen)


def _choices(text: str, option: str, known: dict[str, bool]) -> list[bool]:
    names = [part.strip() for part in text.split(",")]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise WorkloadError(f"{option} takes {', '.join(known)} (comma-separated); got {text!r}")
    return list(dict.fromkeys(known[n] for n in names))


def _baseline_kinds(text: str) -> list[str]:
    if text == "none":
        return []
    kinds = [part.strip() for part in text.split(",")]
    unknown = [k for k in kinds if k not in baselines.KINDS]
    if unknown:
        raise WorkloadError(f"--baseline takes mlx-lm, ring or none; got {text!r}")
    return list(dict.fromkeys(kinds))


def _tokenizer(model_dir: Path) -> Any:
    from mlx_lm.tokenizer_utils import load

    load_model_config(model_dir)  # a clear error for a directory that is not a model
    return load(model_dir)


@contextlib.contextmanager
def _cluster_url(
    url: str | None, local: int | None, hosts: Path | None, model_dir: Path
) -> Iterator[str]:
    if url is not None:
        yield url
        return
    if hosts is not None:
        click.echo(f"starting the cluster of {hosts} (`cluster up --hosts`) ...", err=True)
        cluster = ClusterUp.hosts(hosts, load_cluster_file(hosts).host)
    else:
        click.echo(f"starting {local} local node(s) and a coordinator ...", err=True)
        cluster = ClusterUp.local(local or 0, model_dir)
    with cluster:
        yield cluster.url


def _run(
    url: str,
    plan: BenchPlan,
    prompts: PromptSource,
    api_key: str | None,
    mtp_depth: int | str | None,
) -> dict[str, Any]:
    with click.progressbar(
        length=plan.total_requests,
        label=f"{len(plan.scenarios)} scenarios",
        file=sys.stderr,
        show_pos=True,
    ) as bar:
        return asyncio.run(
            run_benchmark(
                url,
                plan,
                prompts,
                on_request_done=lambda: bar.update(1),
                api_key=api_key,
                mtp_depth=mtp_depth,
            )
        )


def _baselines(
    kinds: list[str],
    plan: BenchPlan,
    prompts: PromptSource,
    local: int | None,
    hosts: Path | None,
    model_dir: Path,
    pipeline: list[dict[str, Any]],
) -> dict[str, Any]:
    """Each baseline asked for, or why it did not run. mlx-lm in one process, and the ring of
    --local N ranks (all on this machine), need the model to fit this machine; the ring over
    --hosts needs each rank's share to fit its host (checked in `ring_hosts`)."""
    out: dict[str, Any] = {}
    if not kinds:
        return out
    runs = baselines.runs_wanted(plan.scenarios)
    ids = {length: prompts.take(length) for length, _ in runs}
    max_tokens = plan.scenarios[0].max_tokens
    fits = baselines.fits_this_machine(model_dir)
    if "mlx-lm" in kinds:
        if not fits:
            out["mlx-lm"] = {"skipped": "the model does not fit one machine"}
        else:
            click.echo("baseline: mlx-lm stream_generate ...", err=True)
            out["mlx-lm"] = baselines.mlx_lm_baseline(model_dir, ids, runs, max_tokens, plan.seed)
    if "ring" in kinds:
        if hosts is not None:
            click.echo(f"baseline: mlx-lm ring pipeline over the hosts of {hosts} ...", err=True)
            out["ring"] = baselines.ring_hosts_baseline(
                load_cluster_file(hosts), ids, runs, max_tokens, plan.seed, pipeline
            )
        elif local is None:
            out["ring"] = {
                "skipped": "the ring baseline needs the hosts: --local N or --hosts FILE, not --url"
            }
        elif not fits:
            out["ring"] = {"skipped": "the model does not fit this machine (all ranks run here)"}
        else:
            click.echo(f"baseline: mlx-lm ring pipeline over {local} ranks ...", err=True)
            try:
                out["ring"] = baselines.ring_baseline(
                    model_dir, ids, runs, max_tokens, plan.seed, local
                )
            except RuntimeError as error:
                out["ring"] = {"error": f"mlx-lm's ring pipeline did not run: {error}"}
    return out


def _attach_ratios(result: dict[str, Any]) -> None:
    for scenario in result["scenarios"]:
        scenario["ratios"] = {
            name: ratios
            for name, baseline in result.get("baselines", {}).items()
            if (ratios := baselines.ratios(scenario, baseline))
        }


def _write(result: dict[str, Any], out_dir: Path) -> None:
    from cluster.bench.plots import PlotsUnavailable, draw

    written = report.write(result, out_dir)
    try:
        written += draw(result, out_dir)
    except PlotsUnavailable as error:
        click.echo(f"no plots: {error}", err=True)
    click.echo("wrote " + ", ".join(str(p) for p in written))
