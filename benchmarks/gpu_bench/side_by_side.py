"""The paired phase: one process, mlx-lm and the nodes loaded at once, measured round by
round."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import mlx.nn as nn

from benchmarks.common import median
from benchmarks.gpu_bench.node_processes import node_processes
from benchmarks.gpu_bench.one_process import (
    concurrent_decode,
    engine_decode,
    mlx_lm_load,
    mlx_lm_run,
    warm_tokens,
    warm_up,
)
from benchmarks.oracle_node import install_oracle, remove_oracle
from cluster.bench.nodes import NodeSnapshot
from cluster.bench.nodes import breakdown as node_breakdown
from cluster.config import load_model_config
from cluster.decode.engine import GenerationEngine
from cluster.decode.pipeline import LocalPipeline
from cluster.decode.runner import ShardRunner
from cluster.decode.worker import MLXWorker
from cluster.model.loading import load_shard
from cluster.transport.wire import step_phases_ms


@contextlib.contextmanager
def _oracle(alpha: float, seed: int = 3):
    """This process's drafts accepted with probability `alpha` (the nodes have their own)."""
    previous = install_oracle(alpha, seed=seed)
    try:
        yield
    finally:
        remove_oracle(previous)


async def paired(args, path: Path, prompt: tuple[int, ...], report: dict, log: list[str]) -> None:
    """Ours in one process, mlx-lm's `stream_generate` and ours over `--paired-nodes` node
    processes (node i on GPU i % --gpus), all loaded at once and measured in turn, round after
    round: each ratio comes from runs seconds apart and the figure is the median of a ratio's
    rounds. On a host whose speed drifts between phases (the same engine measured 45.9 and
    37.1 tok/s minutes apart, BENCHMARKS.md), ratios of figures taken in separate phases
    are noise; these are not. Then `--concurrent` requests at once in one process and over the
    nodes, with the head's micro-batches and with one batch (`micro_batches=1`), alternated.
    Everything runs at the per-backend defaults (what `cluster` runs)."""
    from cluster.decode.remote_pipeline import PipelineSettings, open_remote_engine

    out: dict[str, Any] = {"nodes": args.paired_nodes, "rounds": []}
    report["paired"] = out
    worker = MLXWorker()
    try:
        shard = await worker.run(load_shard, path, for_decoding=True)
        runner = ShardRunner(shard)
        local = GenerationEngine(
            LocalPipeline([runner], worker, max_context=load_model_config(path).max_context)
        )
        lm = await worker.run(mlx_lm_load, path)
        await worker.run(mlx_lm_run, *lm, prompt, 16)
        await warm_up(local, prompt)
        # One set of node processes per `--node-sets` entry and `--driver-streams` kind (the
        # first is the one reported as "the nodes"), all loaded at once and alternated in each
        # round.
        node_sets = args.node_sets if args.paired_nodes else []
        settings = [(opts, streams) for opts in node_sets for streams in args.driver_streams]
        # The first set stays for the concurrent requests; the others are stopped before them,
        # since every set's shards take GPU memory (two sets, the one process and mlx-lm ran a
        # 27B 4-bit GPU out of memory there).
        async with contextlib.AsyncExitStack() as first_set:
            async with contextlib.AsyncExitStack() as other_sets:
                started = [
                    await (first_set if k == 0 else other_sets).enter_async_context(
                        node_processes(args, args.paired_nodes, log, opts)
                    )
                    for k, (opts, _) in enumerate(settings)
                ]
                remotes: dict[str, Any] = {}
                try:
                    for (opts, streams), (addresses, token) in zip(settings, started, strict=True):
                        remote = await open_remote_engine(
                            path, addresses, PipelineSettings(token, links=streams == "tcp")
                        )
                        remotes[_set_name(opts, streams, args.driver_streams)] = remote
                        await warm_up(remote.engine, prompt)
                    for i in range(args.rounds):
                        row = await _paired_round(args, worker, runner, local, remotes, prompt, lm)
                        out["rounds"].append(row)
                        print(
                            f"  round {i + 1}: "
                            + ", ".join(f"{k} {v:.1f}" for k, v in row.items() if _is_number(v)),
                            flush=True,
                        )
                finally:
                    for remote in remotes.values():
                        await remote.close()
            if args.concurrent > 1:
                addresses, token = started[0] if started else ([], "")
                out["concurrent"] = await _paired_concurrency(
                    args, path, addresses, token, local, prompt
                )
    finally:
        worker.close()
    rounds = out["rounds"]
    ratios = {
        "one_process_off_over_mlx_lm": ("local_off", "mlx_lm"),
        "one_process_on_over_mlx_lm": ("local_on", "mlx_lm"),
        "one_process_on_over_off": ("local_on", "local_off"),
        "one_process_lookahead_on_over_off": ("local_off", "local_off_no_lookahead"),
        "one_process_no_lookahead_over_mlx_lm": ("local_off_no_lookahead", "mlx_lm"),
        "one_process_mtp_ahead_over_waiting": ("local_on_mtp_ahead", "local_on_mtp_waits"),
    }
    if args.paired_nodes:
        ratios |= {
            "nodes_off_over_one_process": ("nodes_off", "local_off"),
            "nodes_on_over_mlx_lm": ("nodes_on", "mlx_lm"),
            "nodes_on_over_off": ("nodes_on", "nodes_off"),
        }
    out["ratios"] = {name: median([r[a] / r[b] for r in rounds]) for name, (a, b) in ratios.items()}
    for name, key in (
        ("one_process_engine_over_its_steps", "local_engine_over_steps"),
        ("one_process_engine_over_steps_no_lookahead", "local_engine_over_steps_no_lookahead"),
        ("one_process_on_engine_over_its_steps", "local_engine_over_steps_on"),
    ):
        out["ratios"][name] = median([r[key] for r in rounds])
    # Each node's step against its layers' share (an even split) of the one-process step.
    out["node_step_over_share"] = [
        median([r["node_step_ms"][k] * args.paired_nodes / r["local_step_ms"] for r in rounds])
        for k in range(args.paired_nodes)
    ]
    if not args.paired_nodes:
        return
    # The goal's ratio over every alternated pair of every round.
    out["ratios"]["nodes_off_over_one_process"] = median(
        [pair for r in rounds for pair in r["nodes_off_pairs"]]
    )
    # A token over the nodes, MTP off: the nodes' steps, and the rest (the hops, the driver).
    token_ms = [1000 / r["nodes_off"] for r in rounds]
    steps_ms = [sum(r["node_step_ms"]) for r in rounds]
    out["nodes_off_token_ms"] = {
        "token": median(token_ms),
        "node_steps": median(steps_ms),
        "outside_steps": median([t - n for t, n in zip(token_ms, steps_ms, strict=True)]),
        "one_process_step": median([r["local_step_ms"] for r in rounds]),
    }
    out["node_steps_ahead"] = rounds[-1]["node_steps_ahead"]
    out["node_phases_ms"] = [
        {
            name: median([r["node_phases_ms"][k].get(name, 0.0) for r in rounds])
            for name in rounds[0]["node_phases_ms"][k]
        }
        for k in range(args.paired_nodes)
    ]
    if "by_set" in rounds[0]:  # every node set's own ratio and steps, side by side
        out["by_set"] = {
            name: {
                "nodes_off_over_one_process": median(
                    [pair for r in rounds for pair in r["by_set"][name]["nodes_off_pairs"]]
                ),
                "node_step_over_share": [
                    median(
                        [
                            r["by_set"][name]["node_step_ms"][k]
                            * args.paired_nodes
                            / r["local_step_ms"]
                            for r in rounds
                        ]
                    )
                    for k in range(args.paired_nodes)
                ],
                "node_steps_ahead": rounds[-1]["by_set"][name]["node_steps_ahead"],
            }
            for name in rounds[0]["by_set"]
        }


def _set_name(node_options: str, streams: str, kinds: list[str]) -> str:
    """A node set's name: its node options, and its driver's streams where they vary."""
    name = node_options.strip() or "default"
    return name if len(kinds) == 1 else f"{name}, driver over {streams}"


async def _node_steps(remote: Any) -> dict[str, list]:
    """Each node's step phases and step (ms) over its last decode, and its decode steps built
    ahead so far, used and undone."""
    infos = [await c.info() for c in remote.pipeline.clients]
    phases = [step_phases_ms(info) for info in infos]
    return {
        "node_phases_ms": phases,
        "node_step_ms": [
            sum(p[name] for name in ("handoff", "decode", "layers", "encode")) for p in phases
        ],
        "node_steps_ahead": [[i.steps_ahead_used, i.steps_ahead_undone] for i in infos],
    }


async def _paired_round(
    args,
    worker: MLXWorker,
    runner: ShardRunner,
    local: GenerationEngine,
    remotes: dict[str, Any],
    prompt: tuple[int, ...],
    lm: tuple[nn.Module, Any],
) -> dict[str, Any]:
    """One decode of each, tokens/s: one process MTP off and on, mlx-lm, the nodes MTP off and
    on; with the one-process step and each node's step (ms) of the MTP-off runs. With more
    than one node set (`remotes`, the first reported as "the nodes"), each set's MTP-off runs
    too, under "by_set"."""
    row: dict[str, Any] = {}
    cost = runner.step_cost
    # MTP off without steps built ahead (`ShardRunner.lookahead`): each step's own time,
    # which the node steps are set against, and what building ahead buys.
    lookahead, runner.lookahead = runner.lookahead, False
    seconds, batches = cost.total_seconds, cost.total_batches
    try:
        off = await engine_decode(local, prompt, args.tokens, 1, False)
    finally:
        runner.lookahead = lookahead
    row["local_off_no_lookahead"] = off["median_tps"]
    row["local_step_ms"] = (cost.total_seconds - seconds) / (cost.total_batches - batches) * 1e3
    row["local_engine_over_steps_no_lookahead"] = off["engine_over_steps"]
    # MTP off in one process and over the nodes, alternated `--off-pairs` times: the goal's
    # own ratio, from runs seconds apart however fast the host happens to be.
    # With several node sets, their order turns from one alternation to the next.
    names = list(remotes)
    local_off, over_steps = [], []
    nodes_off: dict[str, list[float]] = {name: [] for name in names}
    for k in range(args.off_pairs):
        off = await engine_decode(local, prompt, args.tokens, 1, False)
        local_off.append(off["median_tps"])
        over_steps.append(off["engine_over_steps"])
        turn = k % max(len(names), 1)
        for name in names[turn:] + names[:turn]:
            decoded = await engine_decode(remotes[name].engine, prompt, args.tokens, 1, False)
            nodes_off[name].append(decoded["median_tps"])
    row["local_off"] = median(local_off)
    row["local_engine_over_steps"] = median(over_steps)
    by_set = {}
    for name, runs in nodes_off.items():
        by_set[name] = {
            "nodes_off": median(runs),
            "nodes_off_pairs": [n / o for n, o in zip(runs, local_off, strict=True)],
            # Where each node's decode steps of the last MTP-off run went (`pb.StepPhases`),
            # and its step: from the MLX thread's handoff to its output encoded.
            **await _node_steps(remotes[name]),
        }
    if names:
        row.update(by_set[names[0]])
    if len(names) > 1:
        row["by_set"] = by_set
    with _oracle(0.7):
        # MTP on with steps built before the verdict is read and without (`mtp_lookahead`);
        # the backend's default of the two is `local_on`.
        default = runner.mtp_lookahead
        try:
            for ahead in (True, False):
                runner.mtp_lookahead = ahead
                on = await engine_decode(local, prompt, args.tokens, 1, True)
                row["local_on_mtp_ahead" if ahead else "local_on_mtp_waits"] = on["median_tps"]
                if ahead == default:
                    row["local_on"] = on["median_tps"]
                    row["local_engine_over_steps_on"] = on["engine_over_steps"]
        finally:
            runner.mtp_lookahead = default
    row["mlx_lm"] = (await worker.run(mlx_lm_run, *lm, prompt, args.tokens))["tps"]
    if not names:
        return row
    nodes = remotes[names[0]].engine
    row["nodes_on"] = (await engine_decode(nodes, prompt, args.tokens, 1, True))["median_tps"]
    return row


async def _paired_concurrency(
    args,
    path: Path,
    addresses: list[str],
    token: str,
    local: GenerationEngine,
    prompt: tuple[int, ...],
) -> dict[str, Any]:
    """`--concurrent` MTP-on requests at once: in one process, then over the nodes with one
    micro-batch per node (the default) and with a single batch, alternated twice. The nodes
    reload their shards for each setting (LoadShardRequest.micro_batches), so each timed
    batch follows a short untimed one (traces and kernels of the new shard)."""
    from cluster.decode.remote_pipeline import PipelineSettings, open_remote_engine

    out: dict[str, Any] = {"requests": args.concurrent}
    with _oracle(0.7):
        await concurrent_decode(local, prompt, warm_tokens(args), args.concurrent)
        out["one_process"], over_one = [], []
        for _ in range(2):  # each batch against one request decoded just before it
            one = await engine_decode(local, prompt, args.tokens, 1, True)
            batch = await concurrent_decode(local, prompt, args.tokens, args.concurrent)
            out["one_process"].append(batch["aggregate_tps"])
            over_one.append(batch["aggregate_tps"] / one["median_tps"])
        out["one_process_over_one_request"] = median(over_one)
        out["one_process_runs_over_one_request"] = over_one
        # The batch with MTP steps built before their verdicts and waiting for them, in turn.
        runner = local.pipeline.runners[0]
        default, ahead_over_waiting = runner.mtp_lookahead, []
        try:
            for _ in range(2):
                tps = {}
                for ahead in (True, False):
                    runner.mtp_lookahead = ahead
                    await concurrent_decode(local, prompt, warm_tokens(args), args.concurrent)
                    batch = await concurrent_decode(local, prompt, args.tokens, args.concurrent)
                    tps[ahead] = batch["aggregate_tps"]
                ahead_over_waiting.append(tps[True] / tps[False])
        finally:
            runner.mtp_lookahead = default
        out["one_process_mtp_ahead_over_waiting"] = median(ahead_over_waiting)
    if not addresses:
        return out
    settings = {"micro_batched": None, "one_batch": 1}
    runs: dict[str, list[float]] = {name: [] for name in settings}
    loads: dict[str, list[dict[str, Any]]] = {name: [] for name in settings}
    for name in [*settings, *settings]:
        remote = await open_remote_engine(
            path, addresses, PipelineSettings(token, micro_batches=settings[name])
        )
        try:
            await concurrent_decode(remote.engine, prompt, warm_tokens(args), args.concurrent)
            one_decode = engine_decode(remote.engine, prompt, args.tokens, 1, True)
            one_load = await _node_load(remote, one_decode)
            one = one_load.pop("result")
            many = concurrent_decode(remote.engine, prompt, args.tokens, args.concurrent)
            load = await _node_load(remote, many)
            batch = load.pop("result")
        finally:
            await remote.close()
        runs[name].append(batch["aggregate_tps"] / one["median_tps"])
        loads[name].append({"one_request": one_load, "concurrent": load})
        per_node = zip(
            one_load["step_ms"],
            load["step_ms"],
            one_load["busy_share"],
            load["busy_share"],
            strict=True,
        )
        print(
            f"  {args.paired_nodes} nodes, {args.concurrent} concurrent MTP on ({name}): "
            f"{batch['aggregate_tps']:.1f} tok/s, {runs[name][-1]:.2f}x one request; per node "
            "(one request / concurrent) "
            + ", ".join(
                f"step {a:.2f} / {b:.2f} ms, busy {c:.0%} / {d:.0%}" for a, b, c, d in per_node
            ),
            flush=True,
        )
    out["nodes_over_one_request"] = {name: median(r) for name, r in runs.items()}
    out["nodes_runs_over_one_request"] = runs
    out["node_load"] = loads
    return out


async def _node_load(remote: Any, decode: Awaitable[dict[str, Any]]) -> dict[str, Any]:
    """Run `decode` (a coroutine) and say how busy each node was meanwhile, from its own
    counters (`cluster.bench.nodes.breakdown`): its step batches, their mean compute time
    (`step_ms`), their share of the wall time (`busy_share`; prefill included) and the step
    messages per batch (several requests' steps may form one batch). `result` is what
    `decode` returned."""
    clients = remote.pipeline.clients
    before = await _node_counters(clients)
    started = time.perf_counter()
    result = await decode
    wall = time.perf_counter() - started
    rows = node_breakdown(before, await _node_counters(clients), wall)
    return {
        "result": result,
        "wall_s": wall,
        "batches": [row["batches"] for row in rows],
        "step_ms": [row["step_ms"] or 0.0 for row in rows],
        "busy_share": [row["busy_share"] for row in rows],
        "messages_per_batch": [row["messages"] / max(row["batches"], 1) for row in rows],
    }


async def _node_counters(clients: list[Any]) -> NodeSnapshot:
    """The nodes' step counters, head first, as `node_breakdown` reads them."""
    snapshot: NodeSnapshot = {}
    for i, client in enumerate(clients):
        info = await client.info()
        snapshot[str(i)] = {
            "start": info.shard.start,
            "end": info.shard.end,
            "batches_total": info.batches_total,
            "busy_seconds_total": info.busy_seconds_total,
            "steps_total": info.steps_total,
        }
    return snapshot


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
