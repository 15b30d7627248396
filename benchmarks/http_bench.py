"""What HTTP and process boundaries cost at 1, 2, 4 and 8 concurrent requests (issue 4).

    python -m benchmarks.http_bench [--json OUT] [--rounds 3] [--max-tokens 64]

A developer's comparison: the figures a user wants of their cluster (tokens/s, TTFT, ITL,
per-node load against concurrency) are `cluster bench`'s; this script reuses its cluster
(`cluster.bench.cluster_up`), its HTTP client and its per-node breakdown for the http way, and
sets that way beside two that no user runs. Three ways of serving the same requests, each
measured at every concurrency level, the order of (way, level) shuffled in each round:

  http     `cluster up --local 3`: streaming `/v1/completions` (SSE) through the coordinator
           and its 3 local nodes, the way a client sees it
  direct   the engine over 3 other local nodes (`open_remote_engine`) with the layer ranges
           the coordinator placed, no HTTP, no coordinator: what the HTTP layer and the
           coordinator add is http over direct
  local    the in-process engine (`open_local_engine`): what batching gains without any
           process boundary; its scaling is the engine's ceiling on this machine

Every request samples (temperature 0.7) with its own fixed seed, picked at the start so that
it decodes all its tokens without a stop token (the same seeds for every way and round), up to
--max-tokens tokens, MTP on; a trial starts `c` requests at once. Aggregate tokens/s is the
trial's completion tokens over its wall time; ratios are to 1 request of the same way in the
same round (medians over rounds). Time to first token is the median over every request of a
level (HTTP: the first SSE event, which the API sends once the first token is decoded).

Where the time goes: around each http trial the nodes' own counters (`cluster.bench.nodes`:
step batches and their compute time, read through the coordinator) give each node's step time
and busy share of the trial; the busiest node sets the pace. What one decode step over 8
requests costs against 1, the ceiling of these ratios, is `benchmarks.step_profile`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from benchmarks.common import (
    CODE_PROMPTS,
    SAMPLED_TEMPERATURE,
    LocalNodes,
    bench_parser,
    default_model,
    load_tokenizer,
    machine,
    median,
    paired_ratios,
    spread,
    write_json,
)
from cluster.bench import nodes
from cluster.bench.benchmark import counters_since
from cluster.bench.client import Client
from cluster.bench.cluster_up import ClusterUp
from cluster.bench.workload import Scenario
from cluster.decode.engine import GenerationEngine, GenerationRequest
from cluster.decode.local_engine import open_local_engine
from cluster.messages import RequestOptions, SamplingParams
from cluster.transport.node_client import open_remote_engine
from coordinator.text_stream import stop_token_ids

WAYS = ("http", "direct", "local")
TEXT_PROMPTS = [p for p in CODE_PROMPTS if not p.startswith("CHAT:")]


@dataclass(frozen=True, slots=True)
class Trial:
    way: str
    level: int
    round: int
    wall_s: float
    tokens: int
    ttft_s: list[float]
    nodes: list[dict] = field(default_factory=list)  # http only: Info deltas per node

    @property
    def tps(self) -> float:
        return self.tokens / self.wall_s


# ---- one trial of each way ----


HTTP_SCENARIO = Scenario(1, 1, 1, sampled=True, mtp=True, concurrency=1)  # max_tokens: per run


async def http_request(
    client: Client, ids: tuple[int, ...], max_tokens: int, seed: int
) -> tuple[int, float]:
    """`cluster bench`'s streaming request (token ids, stop tokens ignored, usage counts)."""
    scenario = replace(HTTP_SCENARIO, prompt_tokens=len(ids), max_tokens=max_tokens)
    record = await client.complete(ids, scenario, seed, time.perf_counter())
    if not record.ok:
        raise RuntimeError(record.error)
    return record.completion_tokens, record.ttft


async def engine_request(
    engine: GenerationEngine,
    ids: tuple[int, ...],
    max_tokens: int,
    seed: int,
    stops: frozenset[int],
) -> tuple[int, float]:
    options = RequestOptions(SamplingParams(temperature=SAMPLED_TEMPERATURE, seed=seed))
    request = GenerationRequest(ids, max_tokens, options, stops)
    start, first, tokens = time.perf_counter(), None, 0
    async for chunk in engine.stream(request):
        if first is None:
            first = time.perf_counter() - start
        tokens += len(chunk.tokens)
    return tokens, first


class Runner:
    def __init__(self, args, tokenizer, client: Client, engines):
        self.args, self.client, self.engines = args, client, engines
        self.prompts = TEXT_PROMPTS
        self.ids = [tuple(tokenizer.encode(p)) for p in self.prompts]
        self.stops = stop_token_ids(tokenizer)
        self.seeds: list[int] = []

    async def pick_seeds(self, count: int) -> None:
        """For request i (prompt i % 3), the first seed with which the in-process engine
        decodes --max-tokens tokens without a stop token; every way and round then uses it."""
        seeds: dict[int, int] = {}
        candidate = 0
        while len(seeds) < count:
            candidate += 1
            todo = [i for i in range(count) if i not in seeds]
            done = await asyncio.gather(
                *(
                    engine_request(
                        self.engines["local"],
                        self.ids[i % len(self.ids)],
                        self.args.max_tokens,
                        1000 * i + candidate,
                        self.stops,
                    )
                    for i in todo
                )
            )
            for i, (tokens, _) in zip(todo, done, strict=True):
                if tokens == self.args.max_tokens:
                    seeds[i] = 1000 * i + candidate
        self.seeds = [seeds[i] for i in range(count)]

    async def trial(self, way: str, level: int, rnd: int) -> Trial:
        def job(i: int):
            seed = self.seeds[i]
            p = i % len(self.prompts)
            if way == "http":
                return http_request(self.client, self.ids[p], self.args.max_tokens, seed)
            return engine_request(
                self.engines[way], self.ids[p], self.args.max_tokens, seed, self.stops
            )

        before = await counters_since(self.client, time.monotonic()) if way == "http" else {}
        start = time.perf_counter()
        done = await asyncio.gather(*(job(i) for i in range(level)))
        wall = time.perf_counter() - start
        load = []
        if way == "http":  # `cluster bench`'s per-node breakdown
            load = nodes.breakdown(
                before, await counters_since(self.client, time.monotonic()), wall
            )
        return Trial(way, level, rnd, wall, sum(t for t, _ in done), [f for _, f in done], load)


async def measure(args, model_dir: Path) -> tuple[list[Trial], list[int], list[dict]]:
    tokenizer = load_tokenizer(model_dir)
    async with contextlib.AsyncExitStack() as stack:
        cluster = stack.enter_context(ClusterUp.local(3, model_dir))
        local_nodes = stack.enter_context(LocalNodes(3))
        local = await open_local_engine(model_dir, mtp=True)
        stack.callback(local.close)
        client = Client(cluster.url, model_dir.name)
        stack.push_async_callback(client.close)
        placed = nodes.pipeline_nodes(await client.get_json("/api/cluster"))
        ranges = [(n["start"], n["end"]) for n in placed]
        print(f"  placement: {ranges}", flush=True)
        remote = await open_remote_engine(
            model_dir, local_nodes.addresses, token=local_nodes.token, ranges=ranges
        )
        stack.push_async_callback(remote.close)
        engines = {"direct": remote.engine, "local": local.engine}
        runner = Runner(args, tokenizer, client, engines)
        await runner.pick_seeds(max(args.levels))
        for way in WAYS:  # warm up every path
            await runner.trial(way, 2, -1)
        trials: list[Trial] = []
        rng = random.Random(4)
        for rnd in range(args.rounds):
            order = [(w, c) for w in WAYS for c in args.levels]
            rng.shuffle(order)
            for way, level in order:
                trials.append(await runner.trial(way, level, rnd))
            print(f"  round {rnd} done", flush=True)
        return trials, runner.seeds, placed


# ---- report ----


def node_load(trials: list[Trial]) -> dict:
    """Per node (head first), medians over trials: step ms, messages in, busy share."""
    per_node: dict[str, dict[str, list[float]]] = {}
    for t in trials:
        for n in t.nodes:
            row = per_node.setdefault(n["node_id"], {"step": [], "messages": [], "busy": []})
            row["step"].append(n["step_ms"] or 0.0)
            row["messages"].append(n["messages"])
            row["busy"].append(n["busy_share"] or 0.0)
    return {
        node: {
            "step_ms": median(v["step"]),
            "messages_per_trial": median(v["messages"]),
            "busy": median(v["busy"]),
        }
        for node, v in per_node.items()
    }


def summarize(trials: list[Trial], levels: list[int]) -> dict:
    out: dict = {}
    for way in WAYS:
        rows = {}
        ones = {t.round: t.tps for t in trials if t.way == way and t.level == 1}
        for level in levels:
            mine = [t for t in trials if t.way == way and t.level == level]
            ratios = [t.tps / ones[t.round] for t in mine if t.round in ones]
            rows[level] = {
                "tps": median(t.tps for t in mine),
                "over_one": median(ratios),
                "over_one_iqr": spread(ratios) if ratios else None,
                "ttft_ms": median(f * 1e3 for t in mine for f in t.ttft_s),
                "tokens_per_request": median(t.tokens / level for t in mine),
            }
            if way == "http":
                rows[level]["nodes"] = node_load(mine)
        out[way] = rows
    http_direct = {}
    for level in levels:
        pairs = [
            (h.tps, d.tps)
            for h in trials
            for d in trials
            if h.way == "http"
            and d.way == "direct"
            and h.level == d.level == level
            and h.round == d.round
        ]
        http_direct[level] = median(paired_ratios([h for h, _ in pairs], [d for _, d in pairs]))
    out["http_over_direct"] = http_direct
    return out


def print_report(summary: dict, placed: list[dict], args) -> None:
    layers = ", ".join(f"{n['node_id']} [{n['start']}, {n['end']})" for n in placed)
    print(f"\nplacement (coordinator's, also used by direct): {layers}")
    print(
        f"\naggregate tokens/s, {args.max_tokens} tokens per request, temperature "
        f"{SAMPLED_TEMPERATURE}, MTP on, {args.rounds} rounds (medians; ratios to 1 request "
        "of the same way and round, IQR in brackets)"
    )
    print(f"{'way':<7} {'conc':>4} {'tokens/s':>9} {'over 1':>18} {'TTFT ms':>8} {'tok/req':>7}")
    for way in WAYS:
        for level, row in summary[way].items():
            iqr = row["over_one_iqr"]
            cell = f"{row['over_one']:.2f} [{iqr[0]:.2f}-{iqr[1]:.2f}]" if iqr else "-"
            print(
                f"{way:<7} {level:>4} {row['tps']:>9.1f} {cell:>18} {row['ttft_ms']:>8.0f} "
                f"{row['tokens_per_request']:>7.0f}"
            )
    print(
        "http over direct (what HTTP + coordinator cost): "
        + ", ".join(f"{c}: {r:.2f}" for c, r in summary["http_over_direct"].items())
    )
    print(
        "http nodes, head first: step ms (compute time / batches) / "
        "step messages in / busy share of the trial"
    )
    for level, row in summary["http"].items():
        cells = [
            f"{n}: {v['step_ms']:.1f} / {v['messages_per_trial']:.0f} / {v['busy']:.0%}"
            for n, v in row["nodes"].items()
        ]
        print(f"  {level} concurrent: " + "   ".join(cells))


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser("http_bench", __doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--levels", default="1,2,4,8")
    args = parser.parse_args(argv)
    args.levels = [int(c) for c in args.levels.split(",")]
    model_dir = args.model or default_model()
    started = time.perf_counter()
    trials, seeds, placed = asyncio.run(measure(args, model_dir))
    summary = summarize(trials, args.levels)
    print_report(summary, placed, args)
    print(f"({time.perf_counter() - started:.0f} s)")
    write_json(
        args.json,
        {
            "benchmark": "http_bench",
            "command": "python -m benchmarks.http_bench "
            + " ".join(sys.argv[1:] if argv is None else argv),
            "machine": machine(),
            "model": str(model_dir),
            "settings": {
                "rounds": args.rounds,
                "max_tokens": args.max_tokens,
                "levels": args.levels,
                "temperature": SAMPLED_TEMPERATURE,
                "prompts": TEXT_PROMPTS,
            },
            "summary": summary,
            "seeds": seeds,
            "placement": placed,
            "trials": [asdict(t) | {"tps": t.tps} for t in trials],
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
